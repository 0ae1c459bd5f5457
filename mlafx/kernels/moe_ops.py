"""Typed wrapper and fake of ``mlafx::moe_experts`` (schema: ``csrc/moe.cpp``).

Reference: ``moe_reference.py``; the model's eager version is
``mlafx.models.moe.routed_experts_reference`` (same math, grouped by expert).
"""

from __future__ import annotations

import torch

from mlafx.kernels.extension import load_extension

load_extension()  # the schemas must be registered before fakes can attach to them

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@torch.library.register_fake("mlafx::moe_experts")
def _moe_experts_fake(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    # Shapes and dtypes only (the C++ entry repeats them); expert ids are data, checked when
    # the kernel runs.
    torch._check(x.dtype in _FLOAT_DTYPES, lambda: f"x dtype {x.dtype} unsupported")
    torch._check(w13.dtype == x.dtype and w2.dtype == x.dtype, lambda: "w13/w2 must be x's dtype")
    torch._check(topk_ids.dtype == torch.int64, lambda: "topk_ids must be int64")
    torch._check(topk_weights.dtype == torch.float32, lambda: "topk_weights must be float32")
    torch._check(swiglu_limit is None or swiglu_limit > 0, lambda: "swiglu_limit must be > 0")
    torch._check(x.dim() == 2 and topk_ids.dim() == 2 and w13.dim() == 3 and w2.dim() == 3)
    torch._check(topk_ids.shape[0] == x.shape[0] and topk_weights.shape == topk_ids.shape)
    torch._check(w13.shape[2] == x.shape[1] and w13.shape[1] % 2 == 0)
    torch._check(
        w2.shape[0] == w13.shape[0]
        and w2.shape[1] == x.shape[1]
        and w2.shape[2] * 2 == w13.shape[1]
    )
    return x.new_empty(x.shape)  # contiguous, whatever x's strides


def moe_experts(
    x: torch.Tensor,  # [T, D]
    topk_ids: torch.Tensor,  # [T, k] int64
    topk_weights: torch.Tensor,  # [T, k] float32
    w13: torch.Tensor,  # [E, 2I, D]: gate rows, then up rows
    w2: torch.Tensor,  # [E, D, I]
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """Routed experts -> [T, D] in x's dtype: per token
    ``sum_j topk_weights[t, j] * (silu(g) * u) @ w2[e]^T``, ``[g | u] = x[t] @ w13[e]^T``,
    ``e = topk_ids[t, j]``, summed in fp32; with ``swiglu_limit`` g and u are clamped first
    (DeepSeek-V4: ``moe_reference.clamped_swiglu``). Ids may repeat; an id outside ``[0, E)``
    raises ``IndexError``."""
    return torch.ops.mlafx.moe_experts(x, topk_ids, topk_weights, w13, w2, swiglu_limit)
