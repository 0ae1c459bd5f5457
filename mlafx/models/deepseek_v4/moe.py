"""V4's MoE: routed experts (top-k of ``sqrtsoftplus`` scores plus the correction bias, or on
``hash_moe`` layers a fixed ``tid2eid[token id]`` table) and one shared expert, every SwiGLU
with its inputs clamped: ``silu(min(g, limit)) * clamp(u, -limit, limit)``.

Router, per token: ``scores = score_fn(x @ W^T)``; the chosen experts' scores, divided by their
sum, times ``routed_scaling_factor``, weight their outputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mlafx.config.deepseek_v4 import DeepseekV4Config
from mlafx.kernels.moe_reference import clamped_swiglu
from mlafx.models.moe import grouped_by_expert


def router_scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    if scoring_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    return logits.softmax(-1) if scoring_func == "softmax" else logits.sigmoid()


class Router(nn.Module):
    """``mlp.gate``: top-k of scores + ``e_score_correction_bias``, or the ``tid2eid`` table."""

    e_score_correction_bias: torch.Tensor
    tid2eid: torch.Tensor

    def __init__(self, cfg: DeepseekV4Config, hashed: bool) -> None:
        super().__init__()
        self.cfg, self.hashed = cfg, hashed
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        if hashed:
            self.register_buffer(
                "tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.long)
            )
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D], input_ids [T] -> (expert ids [T, k] int64, weights [T, k] float32)."""
        cfg = self.cfg
        scores = router_scores(F.linear(x, self.weight).float(), cfg.scoring_func)
        if self.hashed:
            ids = self.tid2eid[input_ids].long()
        else:
            choice = scores + self.e_score_correction_bias
            ids = torch.topk(choice, cfg.num_experts_per_tok, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids, weights * cfg.routed_scaling_factor


class ClampedSwiGLU(nn.Module):
    """The shared expert: ``down(clamped_swiglu(gate(x), up(x)))``."""

    def __init__(self, hidden: int, intermediate: int, limit: float) -> None:
        super().__init__()
        self.limit = limit
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(clamped_swiglu(self.gate_proj(x), self.up_proj(x), self.limit))


class ClampedExperts(nn.Module):
    """The routed experts with transformers' fused in-memory names."""

    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__()
        e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.limit = cfg.swiglu_limit
        self.gate_up_proj = nn.Parameter(torch.zeros(e, 2 * i, d))  # gate rows, then up
        self.down_proj = nn.Parameter(torch.zeros(e, d, i))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        def expert_mlp(expert: int, rows: torch.Tensor) -> torch.Tensor:
            gate, up = F.linear(rows, self.gate_up_proj[expert]).chunk(2, dim=-1)
            return F.linear(clamped_swiglu(gate, up, self.limit), self.down_proj[expert])

        return grouped_by_expert(x, ids, weights, self.gate_up_proj.shape[0], expert_mlp)


class V4MoE(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, layer: int) -> None:
        super().__init__()
        self.gate = Router(cfg, hashed=cfg.mlp_layer_types[layer] == "hash_moe")
        self.experts = ClampedExperts(cfg)
        self.shared_experts = ClampedSwiGLU(
            cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit
        )

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(x, input_ids)
        return self.experts(x, ids, weights) + self.shared_experts(x)
