"""Typed wrapper and fake of the FP4 routed-experts op (schema: ``csrc/fp4_moe.cpp``).

The format is defined in ``fp4_format.py`` (DeepSeek-V4's experts: e2m1 nibbles, a ue8m0 scale
per 32 along K): the bytes stay as stored and are widened to bf16 in registers (exact). The
eager reference is ``models.deepseek_v4.quantized.moe_experts_fp4_reference``.
"""

from __future__ import annotations

import torch

from mlafx.kernels.extension import load_extension
from mlafx.kernels.fp4_format import GROUP

load_extension()  # the schemas must be registered before fakes can attach to them

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_BYTE_DTYPES = (torch.int8, torch.uint8, torch.float8_e8m0fnu)


def _check_weight(w: torch.Tensor, scale: torch.Tensor, lead: int, rows: int, cols: int) -> None:
    bytes_ok = w.dtype in _BYTE_DTYPES and scale.dtype in _BYTE_DTYPES
    torch._check(bytes_ok, lambda: f"FP4 stacks are bytes, not {w.dtype} / {scale.dtype}")
    torch._check(cols % 2 == 0, lambda: f"FP4 packs two weights per byte: K={cols} is odd")
    want_w, want_s = (lead, rows, cols // 2), (lead, rows, -(-cols // GROUP))
    torch._check(tuple(w.shape) == want_w, lambda: f"weight shape {tuple(w.shape)} != {want_w}")
    torch._check(tuple(scale.shape) == want_s, lambda: f"scale shape {tuple(scale.shape)}")


@torch.library.register_fake("mlafx::moe_experts_fp4")
def _moe_experts_fp4_fake(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    # Shapes and dtypes only; expert ids are data, checked when the kernel runs.
    torch._check(x.dtype in _FLOAT_DTYPES, lambda: f"x dtype {x.dtype} unsupported")
    torch._check(topk_ids.dtype == torch.int64, lambda: "topk_ids must be int64")
    torch._check(topk_weights.dtype == torch.float32, lambda: "topk_weights must be float32")
    torch._check(x.dim() == 2 and topk_ids.dim() == 2 and w13.dim() == 3 and w2.dim() == 3)
    torch._check(topk_ids.shape[0] == x.shape[0] and topk_weights.shape == topk_ids.shape)
    torch._check(swiglu_limit is None or swiglu_limit > 0, lambda: "swiglu_limit must be > 0")
    e, d, inter = w2.shape[0], x.shape[1], 2 * w2.shape[2]
    _check_weight(w13, w13_scale, e, 2 * inter, d)
    _check_weight(w2, w2_scale, e, d, inter)
    return x.new_empty(x.shape)


def moe_experts_fp4(
    x: torch.Tensor,  # [T, D]
    topk_ids: torch.Tensor,  # [T, k] int64
    topk_weights: torch.Tensor,  # [T, k] float32
    w13: torch.Tensor,  # [E, 2I, D/2] int8/uint8 packed e2m1: gate rows, then up rows
    w13_scale: torch.Tensor,  # [E, 2I, ceil(D/32)] ue8m0 (uint8 or float8_e8m0fnu)
    w2: torch.Tensor,  # [E, D, I/2]
    w2_scale: torch.Tensor,  # [E, D, ceil(I/32)]
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """Routed experts over FP4 weights -> [T, D] in x's dtype: ``[g | u] = x @ W13^T`` rounded
    to x's dtype, clamped at ``swiglu_limit`` (g from above, u both sides; None: no clamp),
    ``h = silu(g) * u`` in x's dtype, ``y = h @ W2^T`` rounded, ``sum_j topk_weights * y`` in
    float32, rounded once; each product exact per term, in float32 sums
    (``models.deepseek_v4.quantized.moe_experts_fp4_reference``). The kernels: AVX-512 BF16
    where the CPU has it (bf16 x on VDPBF16PS, other dtypes on fp32 FMAs), else portable
    (``MLAFX_DISABLE_AVX512=1``); they differ only in fp32 summation order. An id outside
    ``[0, E)`` raises ``IndexError``."""
    return torch.ops.mlafx.moe_experts_fp4(
        x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, swiglu_limit
    )


__all__ = ["moe_experts_fp4"]
