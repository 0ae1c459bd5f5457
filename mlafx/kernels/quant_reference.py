"""Slow, obviously right float64 references of the quantized ops, for the tests.

Both start from the *same* quantized activations as the kernels
(``quant_format.quantize_activations``) and the dequantized weight
(``quant_format.dequantize_weight``, exact), then multiply in float64: what is left between a
kernel and these is its fp32 summation and the final rounding to x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mlafx.kernels.kquant_format import kquant_name, unpack_kquant
from mlafx.kernels.quant_format import dequantize_weight, quantize_activations


def dequantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> float64 [M, K]: q_x * d_x, the values the integer dots multiply."""
    q, d = quantize_activations(x)
    return (q.double() * d.double().unsqueeze(-1)).reshape(x.shape[0], -1)[:, : x.shape[1]]


def linear_quantized_f64(
    x: torch.Tensor,  # [M, K]
    packed: torch.Tensor,  # [ceil(N/16), ceil(K/32), S]
    out_features: int,
) -> torch.Tensor:
    """float64 [M, N]: the quantized product before any rounding (no bias)."""
    w = dequantize_weight(packed, out_features, x.shape[1]).double()
    return dequantized_activations(x) @ w.t()


def magnitude_f64(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """|q_x d_x| @ |W|^T in float64: the scale of the fp32 summation error. For a k8/k4
    weight |W| is |d a v| + |dmin m|: the kernels round the two products before subtracting."""
    if kquant_name(packed) is not None:
        v, a, m, d, dmin = unpack_kquant(packed)
        rows, groups = d.shape
        halves = v.view(rows, groups, 8, 2, 16).double() * a.double().unsqueeze(-1)
        scaled = (halves * d.double().view(rows, groups, 1, 1, 1)).abs()
        offset = (m.double() * dmin.double().view(rows, groups, 1)).abs()
        w = (scaled + offset.view(rows, groups, 8, 1, 1)).reshape(rows, -1)
        w = w[:out_features, : x.shape[1]]
    else:
        w = dequantize_weight(packed, out_features, x.shape[1]).double().abs()
    return dequantized_activations(x).abs() @ w.t()


def moe_experts_quantized_f64(
    x: torch.Tensor,  # [T, D]
    topk_ids: torch.Tensor,  # [T, k]
    topk_weights: torch.Tensor,  # [T, k]
    w13: torch.Tensor,  # [E, ceil(2I/16), ceil(D/32), S]
    w2: torch.Tensor,  # [E, ceil(D/16), ceil(I/32), S]
    intermediate_size: int,
) -> torch.Tensor:
    """Per (token, choice), in float64 except where the op rounds to x's dtype (g, u, h and y,
    whose rounding is part of the semantics; h is quantized again for W2) -> float64 [T, D]."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = intermediate_size
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            gate_up = linear_quantized_f64(x[t : t + 1], w13[e], 2 * inter).to(x.dtype)
            h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            y = linear_quantized_f64(h, w2[e], x.shape[1]).to(x.dtype)
            out[t] += float(topk_weights[t, j]) * y[0].double()
    return out
