"""Content keys of full KV blocks, shared by the prefix cache and the KV connectors.

A block's key is a SHA-256 over its parent block's key and its own token ids, so a key
names the whole prefix up to the end of the block (two prompts share a key iff they share
every token up to there). Keys are stable across processes and machines (never Python's
salted ``hash``). A store shared between engines also needs ``cache_fingerprint``: the
cached bytes depend on the model config, the cache dtype, the block size and the row
layout, and a key is only meaningful under one fingerprint.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Sequence

from mlafx.config import ServedConfig
from mlafx.models.step import CACHE_LAYOUT_VERSION

BlockHash = bytes  # 32-byte SHA-256 digest
_ROOT = b"mlafx-block-root"


def hash_block(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The key of a block holding ``token_ids`` whose prefix ends with block ``parent``."""
    digest = hashlib.sha256(_ROOT if parent is None else parent)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def full_block_hashes(
    token_ids: Sequence[int], block_size: int, parent: BlockHash | None = None
) -> list[BlockHash]:
    """Chained keys of every full block of ``token_ids`` (a partial tail block has none)."""
    keys: list[BlockHash] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size])
        keys.append(parent)
    return keys


def cache_fingerprint(config: ServedConfig, dtype: str, block_size: int) -> str:
    """Hex digest of everything that decides a cached block's bytes besides its tokens."""
    facts = {
        "config": config.to_dict(),
        "dtype": str(dtype),
        "block_size": block_size,
        "layout": CACHE_LAYOUT_VERSION,
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()
