"""LongCat-Flash's decoder layer (``longcat_flash``): two MLA blocks, two dense MLPs and a
shortcut MoE with zero-computation experts (transformers' ``modeling_longcat_flash.py``).

Per decoder layer, with caches ``c0``, ``c1`` (one per MLA block; the model's cache list
holds them in that order, layer after layer)::

    h   = x + attn0(norm_in0(x), c0)
    a   = norm_post0(h)
    s   = moe(a)                       the shortcut: the first block's MLP input
    h   = h + mlp0(a)
    h   = h + attn1(norm_in1(h), c1)
    out = h + mlp1(norm_post1(h)) + s

The MoE's router scores ``E`` routed and ``Z`` zero experts (softmax over all ``E + Z``, top-k
chosen with the correction bias, weights the scores times ``routed_scaling_factor``); a zero
expert returns its input, so a token's output is ``sum_routed w_k * expert_k(a) + (sum_zero
w_k) * a``. Its MLA blocks scale q and the cached latent (``ModelConfig.mla_q_scale``,
``mla_latent_scale``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mlafx.config import ModelConfig
from mlafx.models.attention import MLAttention
from mlafx.models.layers import RMSNorm, SwiGLU
from mlafx.models.moe import RoutedExperts, Router


class LongcatRouter(Router):
    """The router under transformers' names: ``classifier`` (a float32 linear over the routed
    and zero experts, with a bias when ``router_bias``) and ``e_score_correction_bias``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        del self.weight  # the classifier holds it
        self.classifier = nn.Linear(cfg.hidden_size, cfg.num_router_choices, bias=cfg.router_bias)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(x.to(torch.float32))


class ShortcutMoE(nn.Module):
    """Routed experts plus zero (identity) experts (module docstring), as two terms: the
    routed experts' sum (a per-rank partial sum under tensor parallelism) and the identity
    term (the same on every rank; None without zero experts)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_routed = cfg.n_routed_experts
        self.num_zero = cfg.n_zero_experts
        self.router = LongcatRouter(cfg)
        self.experts = RoutedExperts(cfg)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [T, D] -> (routed [T, D], identity [T, D] float32 or None)."""
        topk_ids, topk_weights = self.router(x)
        if self.num_zero == 0:
            return self.experts(x, topk_ids, topk_weights), None
        zero = topk_ids >= self.num_routed
        identity = x * topk_weights.masked_fill(~zero, 0.0).sum(-1, keepdim=True)  # float32
        # a zero expert's pair still goes to a routed expert, with weight 0 (as transformers)
        stand_in = (topk_ids - self.num_routed) * self.num_routed // self.num_zero
        topk_ids = torch.where(zero, stand_in, topk_ids)
        return self.experts(x, topk_ids, topk_weights.masked_fill(zero, 0.0)), identity


class LongcatDecoderLayer(nn.Module):
    """Two MLA blocks, two dense MLPs and the shortcut MoE (module docstring).

    ``all_reduce``: as ``deepseek.DecoderLayer``'s (None: no tensor parallelism)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        blocks = range(cfg.attention_blocks)
        self.mlp = ShortcutMoE(cfg)
        self.self_attn = nn.ModuleList(MLAttention(cfg) for _ in blocks)
        self.mlps = nn.ModuleList(SwiGLU(cfg.hidden_size, cfg.intermediate_size) for _ in blocks)
        self.input_layernorm = nn.ModuleList(
            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) for _ in blocks
        )
        self.post_attention_layernorm = nn.ModuleList(
            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) for _ in blocks
        )

    def _reduced(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self.all_reduce is None else self.all_reduce(partial)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        caches: list[torch.Tensor],  # one [NB, BS, Lkv+R] per MLA block, mutated
        slot_mapping: torch.Tensor,
        key_slots: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        shortcut = None
        for block, cache in enumerate(caches):
            attn = self.self_attn[block](
                self.input_layernorm[block](x), cos, sin, cache, slot_mapping, key_slots, mask
            )
            x = x + self._reduced(attn)
            mlp_input = self.post_attention_layernorm[block](x)
            if block == 0:
                routed, identity = self.mlp(mlp_input)
                shortcut = self._reduced(routed)
                if identity is not None:
                    shortcut = shortcut + identity.to(shortcut.dtype)
            x = x + self._reduced(self.mlps[block](mlp_input))
        assert shortcut is not None
        return x + shortcut
