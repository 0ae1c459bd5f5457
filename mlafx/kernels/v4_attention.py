"""DeepSeek-V4's attention from the existing C++ ops: the sliding window and the compressed
pool as two ``mla_attention_sparse`` passes merged by ``merge_attn_states``, and the sink.

V4's attention (``models/deepseek_v4/attention.py``, ``attend_with_sinks``) is MLA's absorbed
attention with one 512-wide row per key that is also its value: ``mla_attention_sparse`` with
``kv_lora_rank`` = the row width (no separate rope columns). A query reads its window rows (the
token cache) and its pool entries (a CSA layer's indexer top-k, an HCA layer's every visible
entry) from two caches, so two passes, merged by their log-sum-exps. The sink is a per-head
logit in the denominator only: with ``L`` the merged LSE,

    out = sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{sink}) = out_keys * sigmoid(L - sink),

an empty key set (``L = -inf``) giving 0, as the reference's softmax over the sink alone does.

This is the path the issue names ("window and pool parts merged by the existing merge op"),
measured by ``mlafx bench kernels --only v4`` and held to the reference by
``tests/test_v4_attention_ops.py``; ``V4Attention.sparse_attention`` calls it, eagerly and in
the compiled layers.
"""

from __future__ import annotations

import torch

from mlafx.kernels.attention_ops import merge_attn_states
from mlafx.kernels.dsa_ops import mla_attention_sparse


def v4_sparse_attention(
    q: torch.Tensor,  # [T, H, c] (rotated)
    query_start_loc: torch.Tensor,  # [B + 1] int32
    window_cache: torch.Tensor,  # [NB, BS, c]: one row per token
    window_table: torch.Tensor,  # [B, M] int32
    window_lens: torch.Tensor,  # [B] int32: tokens cached per sequence
    window_selected: torch.Tensor,  # [T, W] int64: each query's window positions (-1 = none)
    sinks: torch.Tensor,  # [H] float32
    scale: float,
    pool: tuple[torch.Tensor, ...] | None = None,
) -> torch.Tensor:  # [T, H, c], q's dtype
    """V4 attention of each query over its window rows and (``pool``: ``(pool_cache [NB', BS',
    c], pool_table [B, M'] int32, pool_lens [B] int32, pool_selected [T, K] int64)``) its pool
    entries, with the sink in the denominator. Positions index each cache through its own
    block table, as ``mla_attention_sparse`` reads them."""
    width = q.shape[-1]
    out, lse = mla_attention_sparse(
        q, window_cache, window_table, window_lens, query_start_loc, window_selected, scale, width
    )
    if pool is not None:
        pool_cache, pool_table, pool_lens, pool_selected = pool
        pool_out, pool_lse = mla_attention_sparse(
            q, pool_cache, pool_table, pool_lens, query_start_loc, pool_selected, scale, width
        )
        out, lse = merge_attn_states(pool_out, pool_lse, out, lse)
    keep = torch.sigmoid(lse - sinks.float()[:, None])  # [H, T]
    return (out.float() * keep.T[..., None]).to(q.dtype)
