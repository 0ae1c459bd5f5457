"""Slow, obviously right float64 references of the block FP8 ops, for the tests: the exact
dequantized weight (``fp8_format.dequantize_fp8`` in float64) times x in float64. What is left
between a kernel and these is its fp32 summation and the final rounding to x's dtype."""

from __future__ import annotations

import torch

from mlafx.kernels.fp8_format import dequantize_fp8, dequantize_gate_up
from mlafx.kernels.moe_reference import clamped_swiglu


def linear_fp8_f64(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """float64 [M, N]: the product before any rounding (no bias)."""
    return x.double() @ dequantize_fp8(weight, scale, block, torch.float64).t()


def magnitude_f64(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """|x| @ |w|^T in float64: the scale of the fp32 summation error."""
    return x.double().abs() @ dequantize_fp8(weight, scale, block, torch.float64).abs().t()


def moe_experts_fp8_f64(
    x: torch.Tensor,  # [T, D]
    topk_ids: torch.Tensor,  # [T, k]
    topk_weights: torch.Tensor,  # [T, k]
    w13: torch.Tensor,  # [E, 2I, D]
    w13_scale: torch.Tensor,
    w2: torch.Tensor,  # [E, D, I]
    w2_scale: torch.Tensor,
    block: tuple[int, int],
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """Per (token, choice) in float64 except where the op rounds to x's dtype (g, u, h and y,
    whose rounding is part of the semantics) -> float64 [T, D]; g and u clamped at
    ``swiglu_limit`` when given."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = w2.shape[-1]
    gate_up_w = dequantize_gate_up(w13, w13_scale, block, torch.float64)
    down_w = dequantize_fp8(w2, w2_scale, block, torch.float64)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gate_up = (x[t : t + 1].double() @ gate_up_w[e].t()).to(x.dtype)
            h = clamped_swiglu(gate_up[:, :inter], gate_up[:, inter:], swiglu_limit)
            y = (h.double() @ down_w[e].t()).to(x.dtype)
            out[t] += float(topk_weights[t, j]) * y[0].double()
    return out
