"""Typed wrappers and fakes of the int8/int4 quantized ops (schemas: ``csrc/quant_*.cpp``).

The formats (what the packed bytes mean, the activation quantization, the semantics) are
defined in ``quant_format.py`` (int8, int4) and ``kquant_format.py`` (k8, k4: GGUF's K-quants,
repacked at load): a weight is quantized once, at load time, with
:func:`quantize_linear_weight`; :func:`linear_quantized` and :func:`moe_experts_quantized`
quantize their activations per row and group of 32 to int8 and take exact integer dots
(W8A8). References: ``quant_format.py`` (the semantics) and ``quant_reference.py`` (float64).
"""

from __future__ import annotations

import torch

from mlafx.kernels.extension import load_extension
from mlafx.kernels.kquant_format import KQUANT_GROUP_BYTES, SUPER, kquant_shape
from mlafx.kernels.quant_format import (
    GROUP,
    QUANT_BYTES,
    bits_of,
    group_bytes,
    packed_shape,
)

load_extension()  # the schemas must be registered before fakes can attach to them

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_GROUP_BYTES = tuple(group_bytes(bits) for bits in QUANT_BYTES)
_KQUANT_GROUP_BYTES = tuple(KQUANT_GROUP_BYTES)  # compared, never hashed: dims may be symbolic


@torch.library.register_fake("mlafx::quantize_linear_weight")
def _quantize_linear_weight_fake(weight: torch.Tensor, bits: int) -> torch.Tensor:
    torch._check(weight.dtype in _FLOAT_DTYPES, lambda: f"weight dtype {weight.dtype} unsupported")
    torch._check(weight.dim() == 2, lambda: f"weight must be 2-D, got {tuple(weight.shape)}")
    torch._check(bits in QUANT_BYTES, lambda: f"bits must be 8 or 4, got {bits}")
    n, k = weight.shape
    return weight.new_empty(packed_shape(n, k, bits), dtype=torch.uint8)


def _check_packed(packed: torch.Tensor, rows: int, width: int, lead: tuple[int, ...] = ()) -> None:
    torch._check(packed.dtype == torch.uint8, lambda: f"packed dtype {packed.dtype} != uint8")
    torch._check(packed.dim() == 3 + len(lead), lambda: f"packed shape {tuple(packed.shape)}")
    last = packed.shape[-1]
    kquant = last in _KQUANT_GROUP_BYTES
    torch._check(last in _GROUP_BYTES or kquant, lambda: f"packed last dim {last}")
    if kquant:
        torch._check(width % SUPER == 0, lambda: f"a k8/k4 weight needs K % {SUPER} == 0")
        blocks, groups, _ = kquant_shape(rows, width, 8)
    else:
        blocks, groups, _ = packed_shape(rows, width, 8)
    torch._check(
        tuple(packed.shape[:-1]) == (*lead, blocks, groups),
        lambda: f"packed shape {tuple(packed.shape)} does not hold [{rows}, {width}]",
    )


@torch.library.register_fake("mlafx::linear_quantized")
def _linear_quantized_fake(
    x: torch.Tensor,
    packed_weight: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    torch._check(x.dtype in _FLOAT_DTYPES, lambda: f"x dtype {x.dtype} unsupported")
    torch._check(x.dim() == 2, lambda: f"x must be 2-D, got {tuple(x.shape)}")
    _check_packed(packed_weight, out_features, x.shape[1])
    if bias is not None:
        torch._check(
            bias.dim() == 1 and bias.shape[0] == out_features,
            lambda: f"bias must be [{out_features}], got {tuple(bias.shape)}",
        )
        torch._check(bias.dtype == x.dtype, lambda: f"bias dtype {bias.dtype} != x's {x.dtype}")
    return x.new_empty((x.shape[0], out_features))


@torch.library.register_fake("mlafx::moe_experts_quantized")
def _moe_experts_quantized_fake(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    intermediate_size: int,
) -> torch.Tensor:
    # Shapes and dtypes only; expert ids are data, checked when the kernel runs.
    torch._check(x.dtype in _FLOAT_DTYPES, lambda: f"x dtype {x.dtype} unsupported")
    torch._check(topk_ids.dtype == torch.int64, lambda: "topk_ids must be int64")
    torch._check(topk_weights.dtype == torch.float32, lambda: "topk_weights must be float32")
    torch._check(x.dim() == 2 and topk_ids.dim() == 2 and w13.dim() == 4 and w2.dim() == 4)
    torch._check(topk_ids.shape[0] == x.shape[0] and topk_weights.shape == topk_ids.shape)
    num_experts = w13.shape[0]
    _check_packed(w13, 2 * intermediate_size, x.shape[1], (num_experts,))
    _check_packed(w2, x.shape[1], intermediate_size, (num_experts,))
    return x.new_empty(x.shape)  # contiguous, whatever x's strides


def quantize_linear_weight(weight: torch.Tensor, bits: int) -> torch.Tensor:
    """weight [N, K] (fp32/bf16/fp16) -> packed uint8 [ceil(N/16), ceil(K/32), S] (S = 544 for
    int8, 288 for int4), bit-identical to ``quant_format.quantize_weight_ref``."""
    return torch.ops.mlafx.quantize_linear_weight(weight, bits)


def linear_quantized(
    x: torch.Tensor,  # [M, K], last dim contiguous
    packed_weight: torch.Tensor,  # quantize_linear_weight(weight [N, K], bits)
    out_features: int,  # N
    bias: torch.Tensor | None = None,  # [N], x's dtype
) -> torch.Tensor:
    """``x @ W^T (+ bias)`` -> [M, N] in x's dtype with x quantized per row and group of
    32 to int8 (``quant_format.linear_quantized_reference``): exact integer dots per group,
    scaled by ``d_x * d_w`` and summed in fp32, rounded once; the bias is added after."""
    return torch.ops.mlafx.linear_quantized(x, packed_weight, out_features, bias)


def moe_experts_quantized(
    x: torch.Tensor,  # [T, D]
    topk_ids: torch.Tensor,  # [T, k] int64
    topk_weights: torch.Tensor,  # [T, k] float32
    w13: torch.Tensor,  # [E, ceil(2I/16), ceil(D/32), S] uint8: gate rows, then up rows
    w2: torch.Tensor,  # [E, ceil(D/16), ceil(I/32), S] uint8
    intermediate_size: int,  # I
) -> torch.Tensor:
    """Routed experts over quantized weights -> [T, D] in x's dtype
    (``models.quantized.moe_experts_quantized_reference``): per token
    ``sum_j topk_weights[t, j] * (silu(g) * u) @ W2[e]^T``, ``[g | u] = x[t] @ W13[e]^T``,
    each product W8A8 and rounded to x's dtype, the k terms summed in fp32. An id outside
    ``[0, E)`` raises ``IndexError``."""
    return torch.ops.mlafx.moe_experts_quantized(
        x, topk_ids, topk_weights, w13, w2, intermediate_size
    )


def quant_cpu_isa() -> str:
    """``"avx512_vnni"``, ``"avx2"`` or ``"portable"``: the kernel the quantized ops take in
    this process for the int8/int4 formats (``MLAFX_DISABLE_AVX512=1`` forces the portable one,
    ``MLAFX_DISABLE_AVX2=1`` the AVX2 tier off alone). The k8/k4 formats (GGUF K-quants) take
    the AVX2 kernel wherever AVX2 is on, AVX-512 hosts included, else the portable one. Every
    path gives bit-identical results."""
    return torch.ops.mlafx.quant_cpu_isa()


def quantize_experts(weights: torch.Tensor, bits: int) -> torch.Tensor:
    """Stacked expert weights [E, N, K] -> [E, ceil(N/16), ceil(K/32), S], one expert at a
    time (``moe_experts_quantized``'s w13 and w2)."""
    return torch.stack([quantize_linear_weight(w, bits) for w in weights])


__all__ = [
    "GROUP",
    "bits_of",
    "linear_quantized",
    "moe_experts_quantized",
    "quant_cpu_isa",
    "quantize_experts",
    "quantize_linear_weight",
]
