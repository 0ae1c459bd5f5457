"""The engine's side of a KV connector: the connector bound to the engine's caches.

The scheduler asks it, at a request's admission, how many further leading prompt blocks
the store holds and has it load them into freshly allocated blocks; the engine has it save
a request's full prompt blocks once they are computed (see ``kv_connector/base.py``).
DeepSeek-V4's token caches, in blocks of their own (``token_rows``), are read and written
through the token-block map: a chunk still holds every cache's rows of its blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from mlafx.runtime.block_hash import BlockHash
from mlafx.runtime.kv_connector.base import BlockIds, KVConnector, KVConnectorError
from mlafx.runtime.token_rows import TokenRowBlocks

log = logging.getLogger(__name__)


class KVTransfer:
    def __init__(
        self,
        connector: KVConnector,
        caches: list[torch.Tensor],
        token_rows: TokenRowBlocks | None = None,
        token_caches: Sequence[bool] = (),
    ) -> None:
        """``token_rows`` and ``token_caches`` (which caches hold token rows): DeepSeek-V4's
        token caches in blocks of their own."""
        self.connector = connector
        self.caches = caches  # the engine's paged caches, [num_blocks, rows, width] each
        self.token_rows = token_rows
        self.token_caches = tuple(token_caches)

    def lookup(self, keys: Sequence[BlockHash]) -> int:
        """How many leading blocks of ``keys`` the store can provide."""
        return self.connector.lookup(keys) if keys else 0

    def load(self, keys: Sequence[BlockHash], first: int, block_ids: Sequence[int]) -> int:
        """Fill ``block_ids`` with blocks ``first ..`` of ``keys``; returns how many leading
        ones were loaded (the rest are a miss: the engine computes them). Blocks without token
        rows of their own get none (their rows land in the reserved token block 0)."""
        loaded = self.connector.load(keys, first, self.caches, self._ids(block_ids))
        if not 0 <= loaded <= len(block_ids):
            raise RuntimeError(f"KV connector loaded {loaded} of {len(block_ids)} blocks")
        return loaded

    def save(self, keys: Sequence[BlockHash], block_ids: Sequence[int], first: int = 0) -> None:
        """Store a computed prompt's whole chunks from block ``first`` on (``block_ids``: the
        blocks of ``keys[first:]``). A store that fails mid-run costs later hits, not this
        request: the failure is logged and serving goes on."""
        if len(keys) <= first:
            return
        ids = self._ids(block_ids)
        if self.token_rows is not None and not all(map(self.token_rows.has_rows, block_ids)):
            raise RuntimeError("saving blocks whose token rows are no longer kept")
        try:
            if self.token_rows is None and first == 0:  # the contract every connector keeps
                self.connector.save(keys, self.caches, ids)
            else:
                self.connector.save(keys, self.caches, ids, first)
        except KVConnectorError as e:
            log.warning("KV connector save failed (%s); the prefix is not stored", e)

    def _ids(self, block_ids: Sequence[int]) -> BlockIds:
        """``block_ids`` for every cache, or (token rows apart) each cache's: token caches
        through the token-block map."""
        rows = self.token_rows
        if rows is None:
            return block_ids
        tokens = [rows.token_block(b) for b in block_ids]
        return [tokens if token else block_ids for token in self.token_caches]

    def close(self) -> None:
        self.connector.close()
