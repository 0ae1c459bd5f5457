"""The pre-norm residual decoder layer of the DeepSeek family (MLA, then a dense MLP or the
MoE), shared by the dense and the sparse-attention (``dsa.py``) layers."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mlafx.config import ModelConfig
from mlafx.models.attention import MLAttention
from mlafx.models.layers import RMSNorm, SwiGLU
from mlafx.models.moe import MoE


class DecoderLayer(nn.Module):
    """Pre-norm residual layer: ``x + attn(norm(x))``, then ``x + mlp(norm(x))`` (each branch
    times ``residual_scale`` first when the config scales them: MiniCPM3).

    ``all_reduce`` is None (no op in the graph) unless ``mlafx.parallel`` made this layer a
    tensor-parallel shard: then the attention and MLP outputs are per-rank partial sums
    (row-parallel ``o_proj`` / ``down_proj``) and ``all_reduce`` sums them over the ranks.
    """

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.residual_scale = cfg.residual_scale
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = (
            MoE(cfg) if cfg.is_moe_layer(layer) else SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        caches: list[torch.Tensor],  # [cache [NB, BS, Lkv+R]], mutated
        slot_mapping: torch.Tensor,
        key_slots: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        (cache,) = caches
        attn = self.self_attn(
            self.input_layernorm(x), cos, sin, cache, slot_mapping, key_slots, mask
        )
        return self.mlp_block(self.add_branch(x, attn))

    def add_branch(self, x: torch.Tensor, branch: torch.Tensor) -> torch.Tensor:
        """``x + branch`` (summed over the ranks first, scaled first)."""
        if self.all_reduce is not None:
            branch = self.all_reduce(branch)
        return x + (branch if self.residual_scale == 1.0 else branch * self.residual_scale)

    def mlp_block(self, x: torch.Tensor) -> torch.Tensor:
        """The layer's second half: ``x + mlp(post_attention_layernorm(x))``."""
        return self.add_branch(x, self.mlp(self.post_attention_layernorm(x)))
