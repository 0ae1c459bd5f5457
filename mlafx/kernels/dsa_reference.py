"""Slow, obviously correct Python references for the DSA ops (tests import these).

One query at a time: gather the rows the query may see through the block table (never a row
past its sequence's ``kv_lens``), compute in ``dtype`` (float64 by default; bf16/fp16/fp32
values widen exactly), pick or attend, cast. The attention itself is
``attention_reference._attend``, the one ``mla_attention_paged_ref`` uses.
"""

from __future__ import annotations

import math

import torch

from mlafx.kernels.attention_reference import _attend


def _rows(cache: torch.Tensor, table_row: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """cache rows of one sequence's positions -> [len(positions), W] (same dtype)."""
    block_size = cache.shape[1]
    if not positions:
        return cache.new_zeros((0, cache.shape[2]))
    return torch.stack([cache[int(table_row[p // block_size]), p % block_size] for p in positions])


def dsa_indexer_scores_ref(
    q: torch.Tensor,  # [Hi, Di] one query
    weights: torch.Tensor,  # [Hi]
    keys: torch.Tensor,  # [L, Di]
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:  # [L]
    """``score(j) = sum_h weights[h] * relu(q[h] . keys[j])`` in ``dtype``."""
    dots = keys.to(dtype) @ q.to(dtype).T  # [L, Hi]
    return torch.relu(dots) @ weights.to(dtype)


def dsa_visible_scores_ref(
    q: torch.Tensor,  # [T, Hi, Di]
    weights: torch.Tensor,  # [T, Hi]
    index_cache: torch.Tensor,  # [NB, BS, Di]
    block_table: torch.Tensor,  # [B, M] int32
    kv_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    positions: torch.Tensor,  # [T] int64
    dtype: torch.dtype = torch.float64,
) -> list[torch.Tensor]:  # per query: [visible] scores of positions 0 .. visible-1
    """Every query's scores over the positions it sees (``j < min(kv_lens[b], pos + 1)``)."""
    starts = query_start_loc.tolist()
    scores: list[torch.Tensor] = [torch.empty(0)] * q.shape[0]
    for b in range(block_table.shape[0]):
        kv_len = int(kv_lens[b])
        for t in range(starts[b], starts[b + 1]):
            visible = max(0, min(kv_len, int(positions[t]) + 1))
            keys = _rows(index_cache, block_table[b], list(range(visible)))
            scores[t] = dsa_indexer_scores_ref(q[t], weights[t], keys, dtype)
    return scores


def select_topk_ref(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """[L] scores -> [topk] int64: the positions ranked first by (score descending, position
    ascending) -- a stable descending sort -- in ascending order, padded with -1."""
    order = torch.sort(scores, descending=True, stable=True).indices[:topk]
    picked = torch.sort(order).values
    return torch.cat([picked, picked.new_full((topk - picked.numel(),), -1)])


def dsa_indexer_topk_ref(
    q: torch.Tensor,  # [T, Hi, Di]
    weights: torch.Tensor,  # [T, Hi] float32
    index_cache: torch.Tensor,  # [NB, BS, Di]
    block_table: torch.Tensor,  # [B, M] int32
    kv_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    positions: torch.Tensor,  # [T] int64
    topk: int,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:  # [T, topk] int64
    """Reference for ``mlafx::dsa_indexer_topk``: scores in ``dtype``, stable descending sort."""
    scores = dsa_visible_scores_ref(
        q, weights, index_cache, block_table, kv_lens, query_start_loc, positions, dtype
    )
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int64)
    for t, s in enumerate(scores):
        out[t] = select_topk_ref(s, topk)
    return out


def mla_attention_sparse_ref(
    q: torch.Tensor,  # [T, H, Lkv + R]
    kv_cache: torch.Tensor,  # [NB, BS, Lkv + R]
    block_table: torch.Tensor,  # [B, M] int32
    kv_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    selected: torch.Tensor,  # [T, topk] int64
    scale: float,
    kv_lora_rank: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for ``mlafx::mla_attention_sparse``: query t of sequence b attends (float64)
    to the cache rows of its selected positions (``-1`` ignored); keys are whole rows, values
    their first kv_lora_rank columns. Out-of-range positions raise ``IndexError``."""
    num_tokens, num_heads, _ = q.shape
    out = torch.zeros(num_tokens, num_heads, kv_lora_rank, dtype=torch.float64)
    lse = torch.full((num_heads, num_tokens), -math.inf, dtype=torch.float64)
    starts = query_start_loc.tolist()
    for b in range(block_table.shape[0]):
        kv_len = int(kv_lens[b])
        for t in range(starts[b], starts[b + 1]):
            chosen = [p for p in selected[t].tolist() if p != -1]
            for p in chosen:
                if not 0 <= p < kv_len:
                    raise IndexError(f"selected position {p} of query {t} is out of range")
            keys = _rows(kv_cache, block_table[b], chosen).double()
            o, s = _attend(q[t].double(), keys, keys[:, :kv_lora_rank], scale)
            out[t], lse[:, t] = o, s
    return out.to(q.dtype), lse.float()
