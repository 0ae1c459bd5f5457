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

Partial hits: a block also serves any leading run of the tokens it holds. Every registered
full block, and the partly filled last block of a request (its computed rows so far:
``register_rows``), is indexed by its parent key and its tokens; ``lookup_rows`` finds the
block holding the longest leading run of a request's next tokens. Such a block is never
shared: the new holder gets its own block and the matching rows are copied into it (the
owner of a partly filled block keeps appending rows past those, which never changes the
rows it advertised). A partial entry is forgotten, like a key, when its block is evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

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
        # partial hits: block -> (parent key, the tokens of its computed rows), and the
        # blocks by (parent key, first token)
        self._rows_of: dict[int, tuple[BlockHash | None, tuple[int, ...]]] = {}
        self._by_first: dict[tuple[BlockHash | None, int], set[int]] = {}
        # told of each block handed out afresh (its old rows void): ``TokenRowBlocks.forget``
        self.on_reuse: Callable[[int], None] | None = None
        # ``replaces(holder, block)``: whether ``block`` should take over the key or offered
        # rows that ``holder`` has (DeepSeek-V4: ``holder`` lost the token rows a hit reads,
        # ``block`` has them), instead of leaving them with ``holder``
        self.replaces: Callable[[int, int], bool] | None = None

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
        """Whether ``block`` holds a cached full-block prefix (then it must never be written)."""
        return block in self._key_of

    def is_cached(self, block: int) -> bool:
        """Whether ``block`` holds rows a later request may reuse (a key or partial rows)."""
        return block in self._key_of or block in self._rows_of

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

    def register(
        self,
        block: int,
        key: BlockHash,
        parent: BlockHash | None = None,
        tokens: Sequence[int] | None = None,
    ) -> None:
        """Record that ``block`` (in use, all rows computed) holds the prefix ``key``. A key
        already held by another block keeps that block (this one stays unregistered) unless
        ``replaces`` says this one should take it over. ``parent`` (the previous block's
        key) and ``tokens`` (the block's) also offer its leading rows to partial hits."""
        if not self.enable_prefix_caching or block in self._key_of:
            return
        holder = self._block_of.get(key)
        if holder is not None:
            if self.replaces is None or not self.replaces(holder, block):
                return
            self._unregister(holder)
        self._key_of[block] = key
        self._block_of[key] = block
        if tokens is not None:
            self.register_rows(block, parent, tokens)

    def register_rows(self, block: int, parent: BlockHash | None, tokens: Sequence[int]) -> None:
        """Offer the computed rows of ``block`` (in use) to partial hits: they hold
        ``tokens``, following the prefix ``parent`` (None: the block starts the sequence).
        Called again as its holder computes more rows; rows another block already offers
        are not offered twice (unless ``replaces`` says this block's offer is the better)."""
        if not self.enable_prefix_caching or not tokens:
            return
        held = tuple(tokens)
        if self._rows_of.get(block) == (parent, held):
            return
        self._forget_rows(block)
        first = (parent, held[0])
        for peer in list(self._by_first.get(first, ())):
            if self._rows_of[peer][1][: len(held)] != held:
                continue
            if self.replaces is None or not self.replaces(peer, block):
                return
            self._forget_rows(peer)  # this block offers the same rows, and better
            self._requeue_if_uncached(peer)
        self._rows_of[block] = (parent, held)
        self._by_first.setdefault(first, set()).add(block)

    def lookup_rows(self, parent: BlockHash | None, tokens: Sequence[int]) -> tuple[int, int]:
        """The block whose rows hold the longest leading run of ``tokens`` after the prefix
        ``parent``, and that run's length; ``(0, 0)`` if none does (nothing is taken)."""
        if not self.enable_prefix_caching or not tokens:
            return 0, 0
        best, best_rows = 0, 0
        for block in self._by_first.get((parent, tokens[0]), ()):
            held = self._rows_of[block][1]
            rows = next(
                (i for i, (a, b) in enumerate(zip(held, tokens, strict=False)) if a != b),
                min(len(held), len(tokens)),
            )
            if rows > best_rows or (rows == best_rows and block < best):
                best, best_rows = block, rows
        return best, best_rows

    def _unregister(self, block: int) -> None:
        """``block`` no longer holds its key or offers rows; free, it goes first to reuse."""
        del self._block_of[self._key_of.pop(block)]
        self._forget_rows(block)
        self._requeue_if_uncached(block)

    def _requeue_if_uncached(self, block: int) -> None:
        """A free block that no longer holds anything reusable goes first to reuse."""
        if self._ref_counts[block] == 0 and not self.is_cached(block):
            self._free.move_to_end(block, last=False)

    def _forget_rows(self, block: int) -> None:
        entry = self._rows_of.pop(block, None)
        if entry is not None:
            parent, held = entry
            peers = self._by_first[(parent, held[0])]
            peers.discard(block)
            if not peers:
                del self._by_first[(parent, held[0])]

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
            self._forget_rows(block)
            if self.on_reuse is not None:
                self.on_reuse(block)
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
                if not self.is_cached(block):  # nothing worth keeping: reuse it first
                    self._free.move_to_end(block, last=False)
