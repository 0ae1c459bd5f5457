"""V4's modules over the bytes DeepSeek publishes: FP8 e4m3 block-scaled linears (here also
the grouped ``o_a_proj``) and routed experts in FP4 e2m1 with ue8m0 scales per 32
(``kernels/fp4_format.py``) or in block FP8.

The semantics: each weight (an expert's, when the expert runs) dequantized to float32 and
multiplied in float32, the result rounded once to x's dtype (``linear_fp8_reference``,
``stored_experts_reference``). The modules run on mlafx's ops, which keep the stored bytes and
widen them in registers: ``linear_fp8``, ``moe_experts_fp8`` and ``moe_experts_fp4`` (the same
exact products; fp32 sums in another order).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mlafx.kernels.fp4_format import dequantize_fp4
from mlafx.kernels.fp4_ops import moe_experts_fp4
from mlafx.kernels.fp8_format import dequantize_fp8, dequantize_gate_up
from mlafx.kernels.fp8_ops import linear_fp8, moe_experts_fp8
from mlafx.kernels.moe_reference import clamped_swiglu
from mlafx.models.deepseek_v4.attention import grouped_linear
from mlafx.models.fp8 import Fp8Linear
from mlafx.models.moe import check_expert_ids, grouped_by_expert


class Fp8KernelLinear(Fp8Linear):
    """``Fp8Linear`` on ``linear_fp8`` (its forward is the dequantizing reference)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        out = linear_fp8(rows, self.weight, self.weight_scale_inv, self.block)
        return out.view(*x.shape[:-1], self.out_features)


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
        """x [T, groups, in] -> [T, groups * out], each group on ``linear_fp8``: over its own
        rows when a group's rows are whole scale blocks (V4's: 1024 rows, blocks of 128), else
        over the whole weight, keeping the group's columns."""
        out, bn = self.weight.shape[0] // self.groups, self.block[0]
        parts = []
        for g in range(self.groups):
            rows = slice(g * out, (g + 1) * out)
            if out % bn == 0:
                blocks = slice(g * out // bn, (g + 1) * out // bn)
                w, s = self.weight[rows], self.weight_scale_inv[blocks]
                parts.append(linear_fp8(x[:, g], w, s, self.block))
            else:
                whole = linear_fp8(x[:, g], self.weight, self.weight_scale_inv, self.block)
                parts.append(whole[:, rows])
        return torch.cat(parts, dim=1)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """The semantics: the dequantized weight in float32, rounded once."""
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
        w13, s13, w2, s2 = self.stacks()
        if self.fmt == "fp4":
            return moe_experts_fp4(x, ids, weights, w13, s13, w2, s2, self.limit)
        assert self.block is not None
        return moe_experts_fp8(x, ids, weights, w13, s13, w2, s2, self.block, self.limit)

    def reference(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The semantics: ``stored_experts_reference`` over the dequantized stacks."""
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
    limit: float | None,
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
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """The semantics of ``mlafx::moe_experts_fp4``: ``stored_experts_reference`` over the
    dequantized FP4 stacks."""

    def dequantized(e: int) -> tuple[torch.Tensor, torch.Tensor]:
        return dequantize_fp4(w13[e], w13_scale[e]), dequantize_fp4(w2[e], w2_scale[e])

    return stored_experts_reference(
        x, topk_ids, topk_weights, w13.shape[0], dequantized, swiglu_limit
    )
