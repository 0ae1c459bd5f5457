"""Linears and routed experts over block-scaled FP8 weights as DeepSeek publishes them
(``kernels/fp8_format.py``): one e4m3 byte per weight plus a float32 scale per block, kept as
the checkpoint stores them (a linear's bytes stay memory-mapped from the file).

Eager, the modules run the plain-PyTorch reference (dequantize to float32, matmul, round once);
the capture (``graph/capture.py``) records them as ``mlafx::linear_fp8`` and
``mlafx::moe_experts_fp8``, which widen the bytes in registers: the two differ only in fp32
rounding of ``w * s`` and summation order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mlafx.kernels.fp8_format import dequantize_fp8, dequantize_gate_up, linear_fp8_reference
from mlafx.kernels.moe_reference import clamped_swiglu
from mlafx.models.moe import check_expert_ids, grouped_by_expert


class Fp8Linear(nn.Module):
    """``nn.Linear`` (no bias) over ``weight`` float8_e4m3fn [out, in] and ``weight_scale_inv``
    float32 [ceil(out/bn), ceil(in/bk)], ``block = (bn, bk)``."""

    weight: torch.Tensor  # buffers (annotated: nn.Module's __getattr__ is typed loosely)
    weight_scale_inv: torch.Tensor

    def __init__(
        self, weight: torch.Tensor, weight_scale_inv: torch.Tensor, block: tuple[int, int]
    ) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.block = block
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale_inv", weight_scale_inv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_fp8_reference(x, self.weight, self.weight_scale_inv, self.block)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}"
        )


class Fp8Experts(nn.Module):
    """``RoutedExperts`` over block FP8 stacks (``fp8_format``'s expert layout):
    ``gate_up_weight`` [E, 2I, D] with ``gate_up_scale`` [E, 2 ceil(I/bn), ceil(D/bk)], and
    ``down_weight`` [E, D, I] with ``down_scale`` [E, ceil(D/bn), ceil(I/bk)]."""

    gate_up_weight: torch.Tensor  # buffers
    gate_up_scale: torch.Tensor
    down_weight: torch.Tensor
    down_scale: torch.Tensor

    def __init__(
        self,
        gate_up: torch.Tensor,
        gate_up_scale: torch.Tensor,
        down: torch.Tensor,
        down_scale: torch.Tensor,
        block: tuple[int, int],
    ) -> None:
        super().__init__()
        self.intermediate_size = down.shape[-1]
        self.block = block
        self.register_buffer("gate_up_weight", gate_up)
        self.register_buffer("gate_up_scale", gate_up_scale)
        self.register_buffer("down_weight", down)
        self.register_buffer("down_scale", down_scale)

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        return moe_experts_fp8_reference(
            x, topk_ids, topk_weights, self.gate_up_weight, self.gate_up_scale,
            self.down_weight, self.down_scale, self.block,
        )  # fmt: skip

    def extra_repr(self) -> str:
        e, d, i = self.down_weight.shape
        return f"num_experts={e}, hidden={d}, intermediate={i}, block={self.block}"


def moe_experts_fp8_reference(
    x: torch.Tensor,  # [T, D]
    topk_ids: torch.Tensor,  # [T, k] int64
    topk_weights: torch.Tensor,  # [T, k] float32
    w13: torch.Tensor,  # [E, 2I, D] float8_e4m3fn
    w13_scale: torch.Tensor,  # [E, 2 ceil(I/bn), ceil(D/bk)]
    w2: torch.Tensor,  # [E, D, I] float8_e4m3fn
    w2_scale: torch.Tensor,  # [E, ceil(D/bn), ceil(I/bk)]
    block: tuple[int, int],
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """Routed experts over block FP8 weights -> [T, D] in x's dtype (the semantics of
    ``mlafx::moe_experts_fp8``): ``[g | u] = x @ W13^T`` rounded to x's dtype, ``h = silu(g) *
    u`` in x's dtype (``clamped_swiglu`` with ``swiglu_limit``), ``y = h @ W2^T`` rounded,
    ``sum_j topk_weights * y`` in float32, rounded once; each product in float32 over the
    dequantized expert. An id outside ``[0, E)`` raises ``IndexError``."""
    num_experts = w13.shape[0]
    check_expert_ids(topk_ids, num_experts)

    def expert_mlp(expert: int, rows: torch.Tensor) -> torch.Tensor:
        gate_up_w = dequantize_gate_up(w13[expert], w13_scale[expert], block)
        gate, up = F.linear(rows.float(), gate_up_w).to(x.dtype).chunk(2, dim=-1)
        down_w = dequantize_fp8(w2[expert], w2_scale[expert], block)
        return F.linear(clamped_swiglu(gate, up, swiglu_limit).float(), down_w).to(x.dtype)

    return grouped_by_expert(x, topk_ids, topk_weights, num_experts, expert_mlp)


def is_fp8(model: nn.Module) -> bool:
    return any(isinstance(m, Fp8Linear | Fp8Experts) for m in model.modules())
