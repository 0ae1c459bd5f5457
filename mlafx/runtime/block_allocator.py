"""Fixed-size KV blocks of the paged latent cache: a free list with block 0 reserved.

Block 0 is never handed out, so a block-table entry of 0 (the padding of unused columns)
never points at a live sequence's rows.
"""

from __future__ import annotations

from collections import deque


class OutOfBlocksError(RuntimeError):
    pass


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"the KV cache needs at least 2 blocks (block 0 is reserved), got {num_blocks}"
            )
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(1, num_blocks))

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise OutOfBlocksError(f"asked for {count} KV blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(count)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)
