"""Manifold-constrained hyper-connections (mHC): V4's residual is ``hc_mult`` streams
[T, N, D] per token instead of one.

Around each block (attention, then the MoE), from the streams ``x``:
    flat           = x.view(T, N*D) / rms(x)            (float32, no weight)
    [pre|post|comb] = flat @ fn^T  (N, N, N*N), each times its ``scale`` plus its ``base``
    pre  = sigmoid(.) + eps          collapses the streams into the block's input
    post = 2 sigmoid(.)              spreads the block's output over the streams
    comb = softmax(., rows) + eps, made doubly stochastic by ``hc_sinkhorn_iters`` Sinkhorn
           steps (columns first), mixes the streams: ``out = post * y + comb^T @ x``
At the end ``HyperHead`` collapses the streams with its own ``pre``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mlafx.config.deepseek_v4 import DeepseekV4Config


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps)`` (the mean in float32)."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class HyperConnection(nn.Module):
    """transformers' ``attn_hc`` / ``ffn_hc`` (parameters kept in float32)."""

    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__()
        n = cfg.hc_mult
        self.hc_mult, self.iters, self.eps = n, cfg.hc_sinkhorn_iters, cfg.hc_eps
        self.norm_eps = cfg.rms_norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * cfg.hidden_size))
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, N, D] -> (post [T, N] f32, comb [T, N, N] f32, collapsed [T, D] x's dtype)."""
        n = self.hc_mult
        flat = unweighted_rms_norm(x.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
        comb = comb_w.unflatten(-1, (n, n)) * self.scale[2] + comb_b.view(n, n)
        comb = torch.softmax(comb, dim=-1) + self.eps
        comb = comb / (comb.sum(-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(-2, keepdim=True) + self.eps)
        collapsed = (pre.unsqueeze(-1) * x).sum(1).to(x.dtype)
        return post, comb, collapsed


def expand_streams(
    x: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """The block's output ``y`` [T, D] back onto the streams ``x`` [T, N, D]:
    ``post * y + comb^T @ x`` in x's dtype."""
    dtype = x.dtype
    return post.to(dtype).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), x
    )


class HyperHead(nn.Module):
    """transformers' ``model.hc_head``: the final collapse of the streams."""

    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__()
        n = cfg.hc_mult
        self.eps, self.norm_eps = cfg.hc_eps, cfg.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(n, n * cfg.hidden_size))
        self.hc_base = nn.Parameter(torch.zeros(n))
        self.hc_scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, N, D] -> [T, D]."""
        flat = unweighted_rms_norm(x.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre.unsqueeze(-1) * x).sum(1).to(x.dtype)
