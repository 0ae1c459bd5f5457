"""``StoreConnector``: the ``KVConnector`` contract over any store of named byte blobs.

The backends (``disk``, ``redis_store``) only keep bytes under names; this module decides
what a chunk is, names it, encodes it (``chunk_codec``) and copies its rows in and out of the
engine's caches. Chunk ``c`` covers prompt blocks ``c*chunk_blocks .. (c+1)*chunk_blocks-1``
and is named after its last block's chained key (which names the whole prefix) and the chunk
size: ``<key hex>.c<chunk_blocks>``. A backend adds the fingerprint as a namespace.

Failure policy: bad arguments are the engine's bug and raise ``ValueError``; anything wrong
with stored data (missing, corrupt, foreign) is a miss with a warning, and the bad entry is
discarded so the next ``save`` replaces it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol

import torch

from mlafx.runtime.block_hash import BlockHash
from mlafx.runtime.kv_connector.base import BlockIds, KVConnector, per_cache
from mlafx.runtime.kv_connector.chunk_codec import (
    ChunkDecodeError,
    ChunkSpec,
    decode_chunk,
    encode_chunk,
)

log = logging.getLogger(__name__)


class ChunkStore(Protocol):
    """Named byte blobs in one fingerprint's namespace. After construction no method raises
    for a backend failure (I/O error, lost connection): it logs a warning and reports a
    miss (``exists`` False, ``get`` None) or drops the write."""

    def exists(self, names: Sequence[str]) -> list[bool]: ...

    def get(self, name: str) -> bytes | None: ...

    def put(self, name: str, data: bytes) -> None:
        """Store ``data`` whole or not at all; a concurrent reader sees the old state or
        the new one, never a part."""

    def discard(self, name: str) -> None: ...

    def close(self) -> None: ...


class StoreConnector(KVConnector):
    """Whole chunks of latent blocks kept in a ``ChunkStore``."""

    supports_token_rows = True

    def __init__(
        self, store: ChunkStore, fingerprint: str, block_size: int, chunk_tokens: int
    ) -> None:
        super().__init__(fingerprint, block_size, chunk_tokens)
        self.store = store

    def lookup(self, keys: Sequence[BlockHash]) -> int:
        present = self.store.exists(self.chunk_names(keys))
        leading = next((c for c, hit in enumerate(present) if not hit), len(present))
        return leading * self.chunk_blocks

    def load(
        self,
        keys: Sequence[BlockHash],
        first: int,
        caches: list[torch.Tensor],
        block_ids: BlockIds,
    ) -> int:
        if not 0 <= first <= len(keys):
            raise ValueError(f"first={first} is outside the {len(keys)} keys")
        self._check_caches(caches)
        ids = per_cache(block_ids, len(caches))
        if any(len(own) != len(keys) - first for own in ids):
            raise ValueError(
                f"{[len(own) for own in ids]} block ids for {len(keys) - first} blocks "
                f"(keys[{first}:])"
            )
        cb = self.chunk_blocks
        loaded = 0
        for chunk in range(first // cb, len(keys) // cb):
            name = self._chunk_name(keys, chunk)
            data = self.store.get(name)
            if data is None:
                log.warning("KV store %s: chunk %s vanished; loading stops", self.store, name)
                break
            spec = self._spec(keys[(chunk + 1) * cb - 1], caches)
            try:
                layers = decode_chunk(spec, data)
            except ChunkDecodeError as e:
                log.warning("KV store %s: chunk %s is unusable (%s); a miss", self.store, name, e)
                self.store.discard(name)
                break
            skip = max(first - chunk * cb, 0)  # blocks of this chunk before `first`
            for cache, own, rows in zip(caches, ids, layers, strict=True):
                dst = torch.tensor(own[loaded : loaded + cb - skip], dtype=torch.int64)
                cache.index_copy_(0, dst, rows[skip:])
            loaded += cb - skip
        return loaded

    def save(
        self,
        keys: Sequence[BlockHash],
        caches: list[torch.Tensor],
        block_ids: BlockIds,
        first: int = 0,
    ) -> None:
        cb = self.chunk_blocks
        if not 0 <= first <= len(keys) or first % cb:
            raise ValueError(f"first={first}: not a chunk boundary within the {len(keys)} keys")
        self._check_caches(caches)
        ids = per_cache(block_ids, len(caches))
        if any(len(own) != len(keys) - first for own in ids):
            raise ValueError(f"{[len(own) for own in ids]} block ids for {len(keys) - first} keys")
        names = self.chunk_names(keys)[first // cb :]
        present = self.store.exists(names)
        for chunk, (name, stored) in enumerate(zip(names, present, strict=True), first // cb):
            if stored:
                continue
            spec = self._spec(keys[(chunk + 1) * cb - 1], caches)
            rows = []
            for cache, own in zip(caches, ids, strict=True):
                at = chunk * cb - first
                src = torch.tensor(own[at : at + cb], dtype=torch.int64)
                rows.append(cache.index_select(0, src))
            self.store.put(name, encode_chunk(spec, rows))

    def close(self) -> None:
        self.store.close()

    def chunk_names(self, keys: Sequence[BlockHash]) -> list[str]:
        """Names of the whole chunks of ``keys``, in prompt order."""
        return [self._chunk_name(keys, c) for c in range(len(keys) // self.chunk_blocks)]

    def _chunk_name(self, keys: Sequence[BlockHash], chunk: int) -> str:
        return f"{keys[(chunk + 1) * self.chunk_blocks - 1].hex()}.c{self.chunk_blocks}"

    def _spec(self, key: BlockHash, caches: list[torch.Tensor]) -> ChunkSpec:
        return ChunkSpec.for_caches(
            self.fingerprint, key, self.block_size, self.chunk_blocks, caches
        )

    def _check_caches(self, caches: list[torch.Tensor]) -> None:
        """Paged caches ``[num_blocks, rows, width]``: the first holds token rows (``rows`` is
        the block size: every model's first cache does), the others token rows or fewer
        dividing it (a DeepSeek-V4 pool's entries per block)."""
        if not caches:
            raise ValueError("no caches given")
        bs = self.block_size
        for i, cache in enumerate(caches):
            rows = cache.shape[1] if cache.dim() == 3 else 0
            if rows < 1 or bs % rows or (i == 0 and rows != bs):
                raise ValueError(
                    f"cache {i} is {tuple(cache.shape)}; expected [num_blocks, {bs}, width] "
                    f"(token rows){'' if i == 0 else f' or fewer rows dividing {bs} (a pool)'}"
                )
        if len({cache.dtype for cache in caches}) != 1:
            raise ValueError("caches of different dtypes")
