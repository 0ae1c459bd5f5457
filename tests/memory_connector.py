"""A KV connector over a dict, written to the contract's first form (one block-id list for
every cache, ``save`` without ``first``): what a user's own connector may look like."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mlafx.runtime.block_hash import BlockHash
from mlafx.runtime.kv_connector.base import KVConnector


class InMemoryConnector(KVConnector):
    """The contract of ``kv_connector/base.py`` over a dict (one block per entry);
    ``drop_after`` makes ``load`` stop early, as a corrupt entry would."""

    def __init__(self, fingerprint: str, block_size: int, drop_after: int | None = None):
        super().__init__(fingerprint, block_size, chunk_tokens=block_size)
        self.blocks: dict[BlockHash, list[torch.Tensor]] = {}
        self.drop_after = drop_after
        self.saves = 0

    def lookup(self, keys: Sequence[BlockHash]) -> int:
        n = 0
        while n < len(keys) and keys[n] in self.blocks:
            n += 1
        return n

    def load(self, keys, first, caches, block_ids) -> int:
        wanted = len(keys) - first
        loadable = wanted if self.drop_after is None else min(wanted, self.drop_after)
        for i in range(loadable):
            for cache, rows in zip(caches, self.blocks[keys[first + i]], strict=True):
                cache[block_ids[i]] = rows
        return loadable

    def save(self, keys, caches, block_ids) -> None:
        self.saves += 1
        for key, block in zip(keys, block_ids, strict=True):
            self.blocks.setdefault(key, [cache[block].clone() for cache in caches])
