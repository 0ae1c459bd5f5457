"""Small building blocks shared by every layer: RMSNorm, the SwiGLU MLP, MiniCPM3's scalings."""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)``, normalised in float32 like transformers."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RMSNorm(nn.Module):
    """:func:`rms_norm` with a learned weight."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class SwiGLU(nn.Module):
    """Dense MLP (and the shared experts): ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def scale_embedding(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x * scale`` with ``scale`` first rounded to x's dtype, as transformers' scaled word
    embedding multiplies by its scale buffer cast to the weight's dtype (MiniCPM3)."""
    if scale == 1.0:
        return x
    return x * float(torch.tensor(scale, dtype=x.dtype))


def scale_logits_input(h: torch.Tensor, divisor: float) -> torch.Tensor:
    """The final norm's output divided by ``divisor`` before ``lm_head`` (MiniCPM3's
    ``hidden_size / dim_model_base``)."""
    return h if divisor == 1.0 else h / divisor


M = TypeVar("M", bound=nn.Module)


def submodule(model: nn.Module, name: str, kind: type[M]) -> M:
    """``model.get_submodule(name)``, which must be a ``kind`` (``TypeError`` naming it
    otherwise)."""
    module = model.get_submodule(name)
    if not isinstance(module, kind):
        raise TypeError(f"{name} is a {type(module).__name__}, not a {kind.__name__}")
    return module
