"""The engine's side of a KV connector: the connector bound to the engine's caches.

The scheduler asks it, at a request's admission, how many further leading prompt blocks
the store holds and has it load them into freshly allocated blocks; the engine has it save
a request's full prompt blocks once they are computed (see ``kv_connector/base.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from mlafx.runtime.block_hash import BlockHash
from mlafx.runtime.kv_connector.base import KVConnector, KVConnectorError

log = logging.getLogger(__name__)


class KVTransfer:
    def __init__(self, connector: KVConnector, caches: list[torch.Tensor]) -> None:
        self.connector = connector
        self.caches = caches  # one [num_blocks, block_size, Lkv + R] tensor per layer

    def lookup(self, keys: Sequence[BlockHash]) -> int:
        """How many leading blocks of ``keys`` the store can provide."""
        return self.connector.lookup(keys) if keys else 0

    def load(self, keys: Sequence[BlockHash], first: int, block_ids: Sequence[int]) -> int:
        """Fill ``block_ids`` with blocks ``first ..`` of ``keys``; returns how many leading
        ones were loaded (the rest are a miss: the engine computes them)."""
        loaded = self.connector.load(keys, first, self.caches, block_ids)
        if not 0 <= loaded <= len(block_ids):
            raise RuntimeError(f"KV connector loaded {loaded} of {len(block_ids)} blocks")
        return loaded

    def save(self, keys: Sequence[BlockHash], block_ids: Sequence[int]) -> None:
        """Store a computed prompt's full blocks. A store that fails mid-run costs later
        hits, not this request: the failure is logged and serving goes on."""
        if not keys:
            return
        try:
            self.connector.save(keys, self.caches, block_ids)
        except KVConnectorError as e:
            log.warning("KV connector save failed (%s); the prefix is not stored", e)

    def close(self) -> None:
        self.connector.close()
