"""Rotary position embedding on the R-wide rope part of q and k (DeepSeek YaRN).

Pairs are interleaved (GPT-J style): dims ``(2i, 2i+1)`` rotate by angle ``pos * inv_freq[i]``,
and the rotated key is stored in that same interleaved order in the latent cache for every
family. ``rope_interleave=False`` (a V3/GLM config option) rotates NeoX halves instead
(``i`` with ``i + R/2``; MiniCPM3 always). cos/sin carry the YaRN or LongRoPE magnitude
``cos_sin_scale``.
"""

from __future__ import annotations

import math

import torch

from mlafx.config import LongRopeScaling, ModelConfig, YarnScaling


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """[R/2] float32 inverse frequencies of the model's RoPE (:func:`inv_frequencies`)."""
    return inv_frequencies(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)


def inv_frequencies(
    dim: int, base: float, yarn: YarnScaling | LongRopeScaling | None
) -> torch.Tensor:
    """[dim/2] float32 inverse frequencies; YaRN blends interpolated and extrapolated ones,
    LongRoPE divides each by its factor."""
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolated = 1.0 / pos_freqs
    if yarn is None:
        return extrapolated
    if isinstance(yarn, LongRopeScaling):
        return 1.0 / (torch.tensor(yarn.factors, dtype=torch.float32) * pos_freqs)
    interpolated = 1.0 / (yarn.factor * pos_freqs)

    def correction_dim(num_rotations: float) -> float:
        ctx = yarn.original_max_position_embeddings
        return (dim * math.log(ctx / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(yarn.beta_fast), correction_dim(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    return interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight


def rope_scale(cfg: ModelConfig) -> float:
    """The factor ``rope_cos_sin`` multiplies cos and sin by (YaRN's, else 1)."""
    return 1.0 if cfg.rope_scaling is None else cfg.rope_scaling.cos_sin_scale


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] int64 -> cos, sin [T, R/2] float32 (already times the YaRN scale)."""
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return angles.cos() * scale, angles.sin() * scale


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool
) -> torch.Tensor:
    """x [T, ..., R] -> rotated x, same shape and dtype (computed in float32).

    cos, sin: [T, R/2]; broadcast over the middle (head) axes of x.
    """
    xf = x.to(torch.float32)
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    c, s = cos.view(shape), sin.view(shape)
    if interleave:
        pairs = xf.unflatten(-1, (-1, 2))
        x1, x2 = pairs[..., 0], pairs[..., 1]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = xf.chunk(2, dim=-1)
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return out.to(x.dtype)
