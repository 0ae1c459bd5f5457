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
  ``save(keys, caches, block_ids, first=0)``  once the prompt's rows are computed (DeepSeek-V4
      with its token rows apart: each whole chunk as soon as it is, ``first`` its first
      block): stores every whole chunk from block ``first`` on not yet stored
      (``block_ids[i]`` holds key ``keys[first + i]``; ``first`` is a chunk boundary).
``block_ids`` is one list for every cache, or one list per cache (``per_cache``): DeepSeek-V4's
token caches keep their rows in blocks of their own (``runtime/token_rows.py``); a block whose
token rows are not wanted is loaded into the reserved token block 0, never read.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import cast

import torch

from mlafx.runtime.block_hash import BlockHash

DEFAULT_CHUNK_TOKENS = 256

# one id list for every cache, or one per cache
BlockIds = Sequence[int] | Sequence[Sequence[int]]


def per_cache(block_ids: BlockIds, num_caches: int) -> list[Sequence[int]]:
    """``block_ids`` as one id list per cache (a single list serves every cache)."""
    if block_ids and not isinstance(block_ids[0], int):
        lists = [cast(Sequence[int], ids) for ids in block_ids]
        if len(lists) != num_caches:
            raise ValueError(f"{len(lists)} block id lists for {num_caches} caches")
        return lists
    return [cast(Sequence[int], block_ids)] * num_caches


class KVConnectorError(RuntimeError):
    """A store that cannot be used at all (bad spec, unreachable, not writable)."""


class KVConnector(ABC):
    # whether ``load`` / ``save`` take one block-id list per cache and ``save(..., first)``:
    # DeepSeek-V4 keeps its token rows apart only with such a connector (or none); with
    # another it keeps every token's rows, and the connector sees one list and ``first`` 0
    supports_token_rows = False

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
        block_ids: BlockIds,
    ) -> int: ...

    @abstractmethod
    def save(
        self,
        keys: Sequence[BlockHash],
        caches: list[torch.Tensor],
        block_ids: BlockIds,
        first: int = 0,
    ) -> None: ...

    def close(self) -> None:  # noqa: B027  (optional hook)
        """Release connections; the engine calls it on shutdown."""
