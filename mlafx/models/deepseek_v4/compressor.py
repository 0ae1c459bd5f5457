"""V4's compressors: every ``m`` tokens of a compressed layer become one pool entry.

Per token the compressor projects the layer input ``x`` to ``kv`` and ``gate`` (cached as token
rows until the window closes). Entry ``w`` of window ``w`` (tokens ``w*m .. w*m+m-1``):
    entry = rope(kv_norm(sum_j softmax_j(gate_j + position_bias_j) * kv_j), position w*m)
with the softmax per channel over the window's slots, in float32. HCA pools its window's m
rows. CSA (``overlap``) projects two series of ``width`` each, ``Ca | Cb``, and pools 2m slots:
window ``w-1``'s ``Ca`` and window ``w``'s ``Cb`` (window 0: its ``Cb`` only).

The CSA indexer compresses its own keys the same way (``index_head_dim`` wide) and scores
each query against the visible entries: ``sum_h w_h relu(q_h . k) / sqrt(c)`` with
``w = weights_proj(x) / sqrt(index_n_heads)``; the query attends to the top ``index_topk``.
"""

from __future__ import annotations

import torch
from torch import nn

from mlafx.config.deepseek_v4 import DeepseekV4Config
from mlafx.kernels.dsa_ops import dsa_indexer_topk
from mlafx.models.deepseek_v4.rope import V4RotaryEmbedding
from mlafx.models.deepseek_v4.step import PoolStep, V4StepMetadata


class FloatRMSNorm(nn.Module):
    """RMSNorm with a float32 weight applied before the cast back (transformers' V4 norms)."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf).to(x.dtype)


class PoolCompressor(nn.Module):
    """One pool's compressor (transformers' ``compressor`` or ``compressor.indexer`` keys)."""

    def __init__(self, cfg: DeepseekV4Config, width: int, rate: int, overlap: bool) -> None:
        super().__init__()
        self.width, self.rate, self.overlap = width, rate, overlap
        self.series_width = (2 if overlap else 1) * width
        self.kv_proj = nn.Linear(cfg.hidden_size, self.series_width, bias=False)
        self.gate_proj = nn.Linear(cfg.hidden_size, self.series_width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, self.series_width))
        self.kv_norm = FloatRMSNorm(width, cfg.rms_norm_eps)

    @property
    def input_width(self) -> int:
        """Width of the token rows it caches: ``kv | gate``."""
        return 2 * self.series_width

    def write_inputs(self, x: torch.Tensor, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Cache the step's ``kv | gate`` projections at their token slots."""
        inputs = torch.cat([self.kv_proj(x), self.gate_proj(x)], dim=-1)
        rows.view(-1, self.input_width).index_copy_(0, slot_mapping, inputs.to(rows.dtype))

    def close(
        self, rows: torch.Tensor, pool_cache: torch.Tensor, pool: PoolStep, rope: V4RotaryEmbedding
    ) -> None:
        """Write the entries whose window closes this step into the pool cache."""
        m, c = self.rate, self.width
        src = rows.view(-1, self.input_width).index_select(0, pool.close_sources.flatten())
        src = src.view(-1, 2 * m, self.input_width)  # [N, 2m, kv | gate]
        kv, gate = src.split(self.series_width, dim=-1)
        gate = gate.float() + self.position_bias.float().repeat(2, 1)
        if self.overlap:  # window w-1's first series, window w's second
            kv = torch.cat([kv[:, :m, :c], kv[:, m:, c:]], dim=1)
            gate = torch.cat([gate[:, :m, :c], gate[:, m:, c:]], dim=1)
            no_previous = ~pool.close_has_previous.view(-1, 1, 1)
            gate[:, :m] = gate[:, :m].masked_fill(no_previous, float("-inf"))
        else:
            kv, gate = kv[:, m:], gate[:, m:]
        weights = gate.softmax(dim=1).to(kv.dtype)
        entries = self.kv_norm((kv * weights).sum(dim=1))
        entries = rope.rotate(entries, pool.close_positions)
        pool_cache.view(-1, c).index_copy_(0, pool.close_slots, entries.to(pool_cache.dtype))


class IndexerScorer(nn.Module):
    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__()
        self.weights_proj = nn.Linear(cfg.hidden_size, cfg.index_n_heads, bias=False)


class Indexer(PoolCompressor):
    """transformers' ``compressor.indexer``: its key pool's compressor, query and scorer."""

    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__(cfg, cfg.index_head_dim, cfg.csa_compress_rate, overlap=True)
        self.heads, self.topk = cfg.index_n_heads, cfg.index_topk
        self.q_b_proj = nn.Linear(
            cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim, bias=False
        )
        self.scorer = IndexerScorer(cfg)

    def select(
        self,
        x: torch.Tensor,  # [T, D] the layer input
        q_latent: torch.Tensor,  # [T, Lq] q_a_norm(q_a_proj(x))
        pool_cache: torch.Tensor,
        meta: V4StepMetadata,
        visible: torch.Tensor,  # [T, E] bool: entries each query may read
        rope: V4RotaryEmbedding,
    ) -> torch.Tensor:  # [T, E] bool: the entries each query attends to
        pool = meta.pool(self.rate)
        keys = pool_cache.view(-1, self.width).index_select(0, pool.entry_slots)  # [E, c]
        q = self.q_b_proj(q_latent).view(x.shape[0], self.heads, self.width)
        q = rope.rotate(q, meta.positions)
        scores = torch.relu(torch.matmul(q.float(), keys.float().t())) * self.width**-0.5
        head_weights = self.scorer.weights_proj(x).float() * self.heads**-0.5  # [T, h]
        scores = (scores * head_weights.unsqueeze(-1)).sum(dim=1)  # [T, E]
        scores = scores.masked_fill(~visible, float("-inf"))
        # the k best; equal scores (all heads' ReLUs zero score exactly 0) go to the earlier
        # entry, whatever the batch: a stable sort, where topk's order among ties is unspecified
        k = min(self.topk, scores.shape[1])
        best = scores.sort(dim=-1, descending=True, stable=True).indices[:, :k]
        chosen = torch.zeros_like(visible).scatter_(1, best, True)
        return chosen & visible

    def select_paged(
        self,
        x: torch.Tensor,  # [T, D] the layer input
        q_latent: torch.Tensor,  # [T, Lq]
        pool_cache: torch.Tensor,  # the indexer's key pool, paged
        meta: V4StepMetadata,  # with ``sparse``
        rope: V4RotaryEmbedding,
    ) -> torch.Tensor:  # [T, index_topk] int64: entries, ascending, -1 padded
        """``select`` on ``dsa_indexer_topk`` over the paged pool: the same scores with the
        scales folded into the head weights, the same tie rule (the earlier entry)."""
        assert meta.sparse is not None
        paged = meta.sparse.pools[self.rate]
        q = self.q_b_proj(q_latent).view(x.shape[0], self.heads, self.width)
        q = rope.rotate(q, meta.positions).to(pool_cache.dtype)
        weights = self.scorer.weights_proj(x).float() * (self.heads**-0.5 * self.width**-0.5)
        return dsa_indexer_topk(
            q, weights, pool_cache, paged.table, paged.lens, meta.sparse.query_start_loc,
            paged.last_visible, self.topk,
        )  # fmt: skip
