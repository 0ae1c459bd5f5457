"""Slow, obviously correct reference for ``mlafx::moe_experts`` (tests compare with it), and the
SwiGLU every experts op and reference shares (``clamped_swiglu``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """``silu(min(g, limit)) * clamp(u, -limit, limit)`` (DeepSeek-V4's experts); ``limit``
    None: the plain ``silu(g) * u``."""
    if limit is None:
        return F.silu(gate) * up
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def moe_experts_ref(
    x: torch.Tensor,  # [T, D]
    topk_ids: torch.Tensor,  # [T, k] int64
    topk_weights: torch.Tensor,  # [T, k] float32
    w13: torch.Tensor,  # [E, 2I, D], gate rows then up rows
    w2: torch.Tensor,  # [E, D, I]
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """Per token ``sum_j topk_weights[t, j] * (silu(g) * u) @ w2[e]^T`` with
    ``[g | u] = x[t] @ w13[e]^T``, ``e = topk_ids[t, j]`` (g and u clamped at ``swiglu_limit``
    when given: ``clamped_swiglu``): one token and one choice at a time, all arithmetic in
    float64, rounded once to x's dtype. Raises ``IndexError`` for an id outside ``[0, E)``."""
    num_experts = w13.shape[0]
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(topk_ids.shape[1]):
            e = int(topk_ids[t, j])
            if not 0 <= e < num_experts:
                raise IndexError(f"topk_ids[{t}, {j}] = {e} is out of range for {num_experts}")
            gate_up = w13[e].double() @ x[t].double()
            h = clamped_swiglu(gate_up[:inter], gate_up[inter:], swiglu_limit)
            out[t] += float(topk_weights[t, j]) * (w2[e].double() @ h)
    return out.to(x.dtype)
