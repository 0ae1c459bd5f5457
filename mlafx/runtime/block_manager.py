"""KV blocks of the paged latent cache: reference counts and a prefix cache of full blocks.

Block 0 is reserved (never handed out), so a block-table entry of 0 (the padding of unused
columns) never points at a live sequence's rows.

A block is *in use* while at least one request holds it (``ref_count > 0``), else *free*.
A full block whose rows are all computed may be registered under its content key
(``block_hash``: chained over the whole prefix). A registered block stays reusable after
its last holder frees it: it waits in the free queue, and a later request whose prefix has
the same key takes it back (``touch``) instead of recomputing it. Only when the allocator
hands the block out again is its key forgotten (eviction). The free queue is ordered for
least-recently-used eviction: unregistered blocks first, then registered blocks in the
order they were freed; a request frees its blocks last-to-first, so a prefix's tail is
evicted before its head (a head without its tail is still a hit; a tail alone is not).
Registered blocks are never written: requests only ever write past their last hit block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from mlafx.runtime.block_hash import BlockHash


class OutOfBlocksError(RuntimeError):
    pass


class BlockManager:
    def __init__(self, num_blocks: int, *, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"the KV cache needs at least 2 blocks (block 0 is reserved), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))
        self._key_of: dict[int, BlockHash] = {}  # registered block -> its key
        self._block_of: dict[BlockHash, int] = {}  # key -> the block holding it

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (some may still hold cached prefixes)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of)

    def ref_count(self, block: int) -> int:
        return self._ref_counts[block]

    def is_registered(self, block: int) -> bool:
        """Whether ``block`` holds a cached prefix (then it must never be written)."""
        return block in self._key_of

    # ----- prefix cache -----
    def lookup(self, keys: Sequence[BlockHash]) -> list[int]:
        """Blocks holding the longest leading run of ``keys`` (nothing is taken)."""
        if not self.enable_prefix_caching:
            return []
        blocks = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def num_free_among(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` sit in the free queue (taking them shrinks it)."""
        return sum(1 for b in blocks if self._ref_counts[b] == 0)

    def touch(self, blocks: Sequence[int]) -> None:
        """Take a reference on cached blocks (found by ``lookup``) for a new holder."""
        for block in blocks:
            if self._ref_counts[block] == 0:
                del self._free[block]
            self._ref_counts[block] += 1

    def register(self, block: int, key: BlockHash) -> None:
        """Record that ``block`` (in use, all rows computed) holds the prefix ``key``. A key
        already held by another block keeps that block; this one stays unregistered."""
        if not self.enable_prefix_caching or block in self._key_of or key in self._block_of:
            return
        self._key_of[block] = key
        self._block_of[key] = block

    # ----- allocation -----
    def allocate(self, count: int) -> list[int]:
        """``count`` blocks for a new holder, evicting the least recently used cached ones."""
        if count > len(self._free):
            raise OutOfBlocksError(f"asked for {count} KV blocks, {len(self._free)} free")
        blocks = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            key = self._key_of.pop(block, None)
            if key is not None:
                del self._block_of[key]
            self._ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block (a request's blocks, in position order)."""
        for block in reversed(blocks):
            if self._ref_counts[block] <= 0:
                raise RuntimeError(f"KV block {block} freed more often than taken")
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                self._free[block] = None
                if block not in self._key_of:  # nothing worth keeping: reuse it first
                    self._free.move_to_end(block, last=False)
