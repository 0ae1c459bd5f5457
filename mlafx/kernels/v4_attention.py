"""DeepSeek-V4's attention over its paged caches: ``mlafx::v4_attention``, one pass over each
query's sliding-window rows and pool entries with the per-head sink (``csrc/v4_attention.cpp``).

V4's attention (``models/deepseek_v4/attention.py``, ``attend_with_sinks``) is MLA's absorbed
attention with one row per key that is also its value. A query reads its window rows (the
token cache) and its pool entries (a CSA layer's indexer top-k, an HCA layer's every visible
entry) from two caches, each through its own block table; the op gathers both into one key
list, so window and pool share one online softmax and the threads. The sink is a per-head
logit in the denominator only: with ``L`` the log-sum-exp over the keys,

    out = sum_j e^{s_j} v_j / (sum_j e^{s_j} + e^{sink}) = out_keys * sigmoid(L - sink),

applied to each fp32 row before its one rounding; an empty key set gives 0, as the reference's
softmax over the sink alone does. The issue's other form (a ``mla_attention_sparse`` pass per
cache, ``merge_attn_states``, the sink in torch) is the baseline of ``mlafx bench kernels --only
v4``. Held to the reference model's ``attend_with_sinks`` by ``tests/test_v4_attention_ops.py``;
``V4Attention.sparse_attention`` calls it, eagerly and in the compiled layers.
"""

from __future__ import annotations

import torch

from mlafx.kernels.attention_ops import _check_float, _check_index
from mlafx.kernels.extension import load_extension

load_extension()  # the schema must be registered before the fake can attach to it


@torch.library.register_fake("mlafx::v4_attention")
def _v4_attention_fake(
    q: torch.Tensor,
    query_start_loc: torch.Tensor,
    window_cache: torch.Tensor,
    window_table: torch.Tensor,
    window_lens: torch.Tensor,
    window_selected: torch.Tensor,
    sinks: torch.Tensor,
    scale: float,
    pool_cache: torch.Tensor | None = None,
    pool_table: torch.Tensor | None = None,
    pool_lens: torch.Tensor | None = None,
    pool_selected: torch.Tensor | None = None,
) -> torch.Tensor:
    _check_float("q", q)
    torch._check(q.dim() == 3, lambda: "q must be [T, H, c]")
    torch._check(window_cache.dtype == q.dtype, lambda: "window_cache must have q's dtype")
    torch._check(window_cache.dim() == 3 and window_cache.shape[2] == q.shape[2])
    _check_index("query_start_loc", query_start_loc, torch.int32, 1)
    _check_index("window_table", window_table, torch.int32, 2)
    _check_index("window_lens", window_lens, torch.int32, 1)
    _check_index("window_selected", window_selected, torch.int64, 2)
    torch._check(window_selected.shape[0] == q.shape[0])
    torch._check(sinks.dtype == torch.float32, lambda: "sinks must be float32")
    torch._check(sinks.dim() == 1 and sinks.shape[0] == q.shape[1])
    pool = (pool_cache, pool_table, pool_lens, pool_selected)
    given = sum(t is not None for t in pool)
    torch._check(given in (0, 4), lambda: "the pool's four tensors go together")
    if pool_cache is not None and pool_selected is not None:
        torch._check(pool_cache.dtype == q.dtype, lambda: "pool_cache must have q's dtype")
        torch._check(pool_cache.dim() == 3 and pool_cache.shape[2] == q.shape[2])
        torch._check(pool_selected.shape[0] == q.shape[0])
    return q.new_empty(q.shape)


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
    block table; each selection holds distinct positions below its lengths, ``-1`` entries
    ignored (anything else raises, naming the selection, query and sequence)."""
    pool_args = (None, None, None, None) if pool is None else pool
    return torch.ops.mlafx.v4_attention(
        q, query_start_loc, window_cache, window_table, window_lens, window_selected,
        sinks.to(torch.float32), scale, *pool_args,
    )  # fmt: skip
