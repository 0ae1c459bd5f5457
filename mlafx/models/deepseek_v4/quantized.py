"""V4's modules over the bytes DeepSeek publishes: FP8 e4m3 block-scaled linears
(``models/fp8.Fp8Linear``; here also the grouped ``o_a_proj``) and routed experts in FP4 e2m1
with ue8m0 scales per 32 (``kernels/fp4_format.py``) or in block FP8.

The reference semantics: each weight (an expert's, when the expert runs) is dequantized to
float32 and multiplied in float32, the result rounded once to x's dtype; the bytes stay as
stored. FP4 experts run on ``mlafx::moe_experts_fp4`` (the nibbles widened in registers; the
same products, fp32 sums in another order); ``moe_experts_fp4_reference`` is their definition.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mlafx.kernels.fp4_format import dequantize_fp4
from mlafx.kernels.fp4_ops import moe_experts_fp4
from mlafx.kernels.fp8_format import dequantize_fp8, dequantize_gate_up
from mlafx.models.deepseek_v4.attention import grouped_linear
from mlafx.models.deepseek_v4.moe import clamped_swiglu
from mlafx.models.moe import check_expert_ids, grouped_by_expert


class Fp8GroupedLinear(nn.Module):
    """``GroupedLinear`` over a block-FP8 weight [groups * out, in] and its float32 scales."""

    weight: torch.Tensor
    weight_scale_inv: torch.Tensor

    def __init__(
        self, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], groups: int
    ) -> None:
        super().__init__()
        self.groups, self.block = groups, block
        self.register_buffer("weight", weight)
        self.register_buffer("weight_scale_inv", scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, groups, in] -> [T, groups * out]."""
        w = dequantize_fp8(self.weight, self.weight_scale_inv, self.block)
        return grouped_linear(x.float(), w, self.groups).to(x.dtype)


class StoredExperts(nn.Module):
    """``ClampedExperts`` over stored expert stacks: ``fmt`` "fp4" (``gate_up_weight`` int8
    [E, 2I, D/2], ``gate_up_scale`` ue8m0 [E, 2I, D/32]; ``down_weight`` [E, D, I/2],
    ``down_scale`` [E, D, I/32]) or "fp8" (float8_e4m3fn [E, 2I, D] / [E, D, I] with float32
    block scales, the gate's blocks then the up's)."""

    gate_up_weight: torch.Tensor
    gate_up_scale: torch.Tensor
    down_weight: torch.Tensor
    down_scale: torch.Tensor

    def __init__(
        self,
        fmt: str,
        gate_up: tuple[torch.Tensor, torch.Tensor],
        down: tuple[torch.Tensor, torch.Tensor],
        limit: float,
        block: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        if fmt not in ("fp4", "fp8") or (fmt == "fp8") != (block is not None):
            raise ValueError(f"stored experts are fp4, or fp8 with a block, not {fmt!r}")
        self.fmt, self.limit, self.block = fmt, limit, block
        self.register_buffer("gate_up_weight", gate_up[0])
        self.register_buffer("gate_up_scale", gate_up[1])
        self.register_buffer("down_weight", down[0])
        self.register_buffer("down_scale", down[1])

    def dequantized(self, expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ``expert``'s (gate_up [2I, D], down [D, I]) in float32."""
        if self.fmt == "fp4":
            return (
                dequantize_fp4(self.gate_up_weight[expert], self.gate_up_scale[expert]),
                dequantize_fp4(self.down_weight[expert], self.down_scale[expert]),
            )
        assert self.block is not None
        w2, s2 = self.down_weight[expert], self.down_scale[expert]
        return (
            dequantize_gate_up(self.gate_up_weight[expert], self.gate_up_scale[expert], self.block),
            dequantize_fp8(w2, s2, self.block),
        )

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        if self.fmt == "fp4":
            w13, s13, w2, s2 = self.stacks()
            return moe_experts_fp4(x, ids, weights, w13, s13, w2, s2, self.limit)
        num_experts = self.gate_up_weight.shape[0]
        return stored_experts_reference(x, ids, weights, num_experts, self.dequantized, self.limit)

    def stacks(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(gate_up_weight, gate_up_scale, down_weight, down_scale)."""
        return self.gate_up_weight, self.gate_up_scale, self.down_weight, self.down_scale

    def extra_repr(self) -> str:
        return f"fmt={self.fmt}, num_experts={self.gate_up_weight.shape[0]}, limit={self.limit}"


def stored_experts_reference(
    x: torch.Tensor,  # [T, D]
    ids: torch.Tensor,  # [T, k] int64
    weights: torch.Tensor,  # [T, k] float32
    num_experts: int,
    dequantized: Callable[[int], tuple[torch.Tensor, torch.Tensor]],  # e -> (gate_up, down) fp32
    limit: float,
) -> torch.Tensor:
    """Routed experts over dequantized weights -> [T, D] in x's dtype: ``[g | u] = x @ W13^T``
    in float32 rounded to x's dtype, ``h = clamped_swiglu(g, u)`` in x's dtype, ``y = h @ W2^T``
    in float32 rounded, ``sum_j weights * y`` in float32, rounded once. An id outside
    ``[0, E)`` raises ``IndexError``."""
    check_expert_ids(ids, num_experts)

    def expert_mlp(expert: int, rows: torch.Tensor) -> torch.Tensor:
        gate_up, down = dequantized(expert)
        gate, up = F.linear(rows.float(), gate_up).to(x.dtype).chunk(2, dim=-1)
        return F.linear(clamped_swiglu(gate, up, limit).float(), down).to(x.dtype)

    return grouped_by_expert(x, ids, weights, num_experts, expert_mlp)


def moe_experts_fp4_reference(
    x: torch.Tensor,  # [T, D]
    topk_ids: torch.Tensor,  # [T, k] int64
    topk_weights: torch.Tensor,  # [T, k] float32
    w13: torch.Tensor,  # [E, 2I, D/2] packed e2m1
    w13_scale: torch.Tensor,  # [E, 2I, ceil(D/32)] ue8m0
    w2: torch.Tensor,  # [E, D, I/2]
    w2_scale: torch.Tensor,  # [E, D, ceil(I/32)]
    swiglu_limit: float = math.inf,
) -> torch.Tensor:
    """The semantics of ``mlafx::moe_experts_fp4``: ``stored_experts_reference`` over the
    dequantized FP4 stacks."""

    def dequantized(e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return dequantize_fp4(w13[e], w13_scale[e]), dequantize_fp4(w2[e], w2_scale[e])

    return stored_experts_reference(
        x, topk_ids, topk_weights, w13.shape[0], dequantized, swiglu_limit
    )
