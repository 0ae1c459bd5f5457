"""Mixture of experts: the router (scores -> top-k experts) and the routed experts.

Router, per token (``logits = x @ W_gate^T`` in float32, ``W_gate: [E, D]``):
  - ``scoring_func``: softmax or sigmoid of the logits;
  - ``topk_method``: ``greedy`` (top-k of the scores), ``group_limited_greedy`` (keep the
    ``topk_group`` of ``n_group`` groups with the best max score), ``noaux_tc`` (add
    ``e_score_correction_bias`` for the choice only; groups ranked by their top-2 sum);
  - weights are the scores of the chosen experts, renormalised if ``norm_topk_prob``,
    then times ``routed_scaling_factor``. (transformers' DeepSeek-V2 code ignores
    ``norm_topk_prob``; no released V2 checkpoint sets it.)
Experts, per token: ``sum_k w_k * (silu(g) * u) @ w2[e_k]^T`` with ``[g | u] = x @ w13[e_k]^T``;
plus the always-on shared experts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mlafx.config import ModelConfig
from mlafx.models.layers import SwiGLU


class Router(nn.Module):
    e_score_correction_bias: torch.Tensor  # a buffer (noaux_tc routers)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # Kept in float32 whatever the model dtype (as transformers does): routing decisions
        # are discontinuous, so a bf16 router would pick different experts.
        self.weight = nn.Parameter(torch.zeros(cfg.num_router_choices, cfg.hidden_size))
        if cfg.topk_method == "noaux_tc":
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.num_router_choices))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, choices] float32."""
        # the weight is float32 itself (loaders keep it so), so the compiler lowers this
        # linear like the others: onto the packed-weight kernel, batch-invariant when asked
        return F.linear(x.to(torch.float32), self.weight)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] -> (topk_ids [T, k] int64, topk_weights [T, k] float32)."""
        cfg = self.cfg
        logits = self.logits(x)
        scores = logits.softmax(-1) if cfg.scoring_func == "softmax" else logits.sigmoid()
        num_tokens = scores.shape[0]
        per_group = cfg.num_router_choices // cfg.n_group
        if cfg.topk_method == "greedy":
            weights, ids = torch.topk(scores, cfg.num_experts_per_tok, dim=-1, sorted=False)
        else:
            if cfg.topk_method == "noaux_tc":
                choice = scores + self.e_score_correction_bias
                group_scores = (
                    choice.view(num_tokens, cfg.n_group, per_group).topk(2, -1)[0].sum(-1)
                )
                masked = float("-inf")
            else:  # group_limited_greedy
                choice = scores
                group_scores = choice.view(num_tokens, cfg.n_group, per_group).amax(-1)
                masked = 0.0
            groups = torch.topk(group_scores, cfg.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, groups, 1.0)
            expert_mask = group_mask.unsqueeze(-1).expand(-1, -1, per_group).reshape(num_tokens, -1)
            choice = choice.masked_fill(expert_mask == 0, masked)
            ids = torch.topk(choice, cfg.num_experts_per_tok, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return ids, weights * cfg.routed_scaling_factor


class RoutedExperts(nn.Module):
    """The fused expert weights, with transformers' in-memory names."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        e, d, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, d))  # w13: gate rows, then up
        self.down_proj = nn.Parameter(torch.empty(e, d, i))  # w2

    def forward(
        self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        return routed_experts_reference(
            x, topk_ids, topk_weights, self.gate_up_proj, self.down_proj
        )


def routed_experts_reference(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
) -> torch.Tensor:
    """x [T, D], topk_ids [T, k], topk_weights [T, k] f32, w13 [E, 2I, D], w2 [E, D, I] -> [T, D].

    Eager, grouped by expert: each expert's weights are read once per call. The grouping
    is data-dependent (the compiler lowers this block to the ``moe_experts`` op).
    """

    def expert_mlp(expert: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(rows, w13[expert]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, w2[expert])

    return grouped_by_expert(x, topk_ids, topk_weights, w13.shape[0], expert_mlp)


def check_expert_ids(topk_ids: torch.Tensor, num_experts: int) -> None:
    """``IndexError`` unless every id is in ``[0, num_experts)`` (the experts ops' contract)."""
    flat_ids = topk_ids.reshape(-1)
    if flat_ids.numel() and not (0 <= int(flat_ids.min()) and int(flat_ids.max()) < num_experts):
        raise IndexError(f"topk_ids out of range for {num_experts} experts")


def grouped_by_expert(
    x: torch.Tensor,  # [T, D]
    topk_ids: torch.Tensor,  # [T, k]
    topk_weights: torch.Tensor,  # [T, k] float32
    num_experts: int,
    expert_mlp: Callable[[int, torch.Tensor], torch.Tensor],  # (e, rows [n, D]) -> [n, D]
) -> torch.Tensor:
    """``sum_j topk_weights[t, j] * expert_mlp(topk_ids[t, j], x[t])`` -> [T, D] in x's
    dtype, each expert run once on all the rows that picked it, the k terms summed in fp32."""
    k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    flat_weights = topk_weights.reshape(-1, 1)
    # One fp32 row per (token, choice) pair, summed over the k choices at the end: a copy
    # per expert instead of a scatter-add, and the same summation order for every batch.
    pair_out = torch.zeros(flat_ids.shape[0], x.shape[1], dtype=torch.float32)
    for expert, pairs in enumerate(torch.split(order, counts)):
        if pairs.numel() == 0:
            continue
        y = expert_mlp(expert, x[pairs // k])
        pair_out.index_copy_(0, pairs, y.to(torch.float32) * flat_weights[pairs])
    return pair_out.view(-1, k, x.shape[1]).sum(1).to(x.dtype)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate = Router(cfg)
        self.experts = RoutedExperts(cfg)
        self.shared_experts = (
            SwiGLU(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
            if cfg.n_shared_experts > 0
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_ids, topk_weights = self.gate(x)
        out = self.experts(x, topk_ids, topk_weights)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
