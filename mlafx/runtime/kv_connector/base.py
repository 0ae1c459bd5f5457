"""The contract between the engine and a KV store (``disk:PATH``, ``redis://HOST:PORT``).

A store holds whole latent blocks of every layer under their chained block keys
(``mlafx.runtime.block_hash``), in chunks of ``chunk_tokens`` (256 by default) aligned at
the start of the sequence. Everything is namespaced by the cache fingerprint (model
config, dtype, block size, row layout), so an incompatible cache is never loaded.

The engine calls, for a new request's prompt with full-block keys ``keys``:
  ``lookup(keys)``  once at admission: how many leading blocks the store can provide;
  ``load(keys, first, caches, block_ids)``  to fill blocks ``first .. len(keys)-1`` of the
      prompt into the engine's cache blocks ``block_ids`` (``block_ids[i]`` receives key
      ``keys[first + i]``); returns how many of them it loaded (a leading run). A corrupt,
      truncated or vanished entry ends the run with a warning: a miss, never wrong data;
  ``save(keys, caches, block_ids)``  once the prompt's rows are computed: stores every
      whole chunk not yet stored (``block_ids[i]`` holds key ``keys[i]``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from mlafx.runtime.block_hash import BlockHash

DEFAULT_CHUNK_TOKENS = 256


class KVConnectorError(RuntimeError):
    """A store that cannot be used at all (bad spec, unreachable, not writable)."""


class KVConnector(ABC):
    def __init__(self, fingerprint: str, block_size: int, chunk_tokens: int) -> None:
        self.fingerprint = fingerprint
        self.block_size = block_size
        # a chunk is a whole number of blocks, at least one
        self.chunk_blocks = max(1, chunk_tokens // block_size)

    @abstractmethod
    def lookup(self, keys: Sequence[BlockHash]) -> int: ...

    @abstractmethod
    def load(
        self,
        keys: Sequence[BlockHash],
        first: int,
        caches: list[torch.Tensor],
        block_ids: Sequence[int],
    ) -> int: ...

    @abstractmethod
    def save(
        self, keys: Sequence[BlockHash], caches: list[torch.Tensor], block_ids: Sequence[int]
    ) -> None: ...

    def close(self) -> None:  # noqa: B027  (optional hook)
        """Release connections; the engine calls it on shutdown."""
