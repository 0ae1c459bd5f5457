"""V4's RoPE: interleaved pairs on the *trailing* ``qk_rope_head_dim`` dims of a row (the
leading dims are left alone), with the ``main`` or ``compress`` rope of the layer."""

from __future__ import annotations

import torch
from torch import nn

from mlafx.config.deepseek_v4 import V4Rope
from mlafx.models.rope import apply_rope, inv_frequencies, rope_cos_sin


class V4RotaryEmbedding(nn.Module):
    inv_freq: torch.Tensor  # a non-persistent buffer

    def __init__(self, rope: V4Rope, dim: int) -> None:
        super().__init__()
        self.rope, self.dim = rope, dim
        self.scale = 1.0 if rope.scaling is None else rope.scaling.cos_sin_scale
        self.register_buffer("inv_freq", self.frequencies(), persistent=False)

    def frequencies(self) -> torch.Tensor:
        return inv_frequencies(self.dim, self.rope.theta, self.rope.scaling)

    def rotate(
        self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False
    ) -> torch.Tensor:
        """x [T, ..., C] with its last ``dim`` dims rotated by ``positions`` [T] (by minus the
        angle if ``inverse``)."""
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.scale)
        if inverse:
            sin = -sin
        rotated = apply_rope(x[..., -self.dim :], cos, sin, interleave=True)
        return torch.cat([x[..., : -self.dim], rotated], dim=-1)
