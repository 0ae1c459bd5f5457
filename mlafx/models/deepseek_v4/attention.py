"""V4 attention, written the naive way (the reference semantics).

Symbols: T new tokens, H heads, c = head_dim (the one K=V head), R = qk_rope_head_dim,
K window rows and E pool entries the step reads, g = o_groups.

    q_latent = q_a_norm(q_a_proj(x))                                    [T, Lq]
    q        = rope(rms(q_b_proj(q_latent).view(T, H, c)))             [T, H, c] (no weight)
    kv       = rope(kv_norm(kv_proj(x)))                               [T, c] -> window cache
    keys     = window rows p - W < pos <= p  (+ pool entries w < (p+1)/m; CSA: the indexer's
               top ``index_topk`` of those)
    o        = softmax([q.k / sqrt(c) | sink_h]) without the sink column @ keys   [T, H, c]
    out      = o_b_proj(o_a_proj per group(rope^-1(o)))                 [T, D]

The sink is a per-head logit in the softmax's denominator only. Keys are values too, so the
output's rope dims carry the keys' rotation: rotating them back by the query's position leaves
a function of relative distance. Sliding layers use the ``main`` rope, compressed ones the
``compress`` rope, for q, kv, the pool and the de-rotation alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mlafx.config.deepseek_v4 import CSA, SLIDING, DeepseekV4Config
from mlafx.kernels.v4_attention import v4_sparse_attention
from mlafx.models.deepseek_v4.compressor import FloatRMSNorm, Indexer, PoolCompressor
from mlafx.models.deepseek_v4.hyper_connection import unweighted_rms_norm
from mlafx.models.deepseek_v4.rope import V4RotaryEmbedding
from mlafx.models.deepseek_v4.step import V4StepMetadata


class Compressor(PoolCompressor):
    """transformers' ``self_attn.compressor`` (CSA: with its ``indexer``)."""

    def __init__(self, cfg: DeepseekV4Config, layer: int) -> None:
        csa = cfg.layer_types[layer] == CSA
        super().__init__(cfg, cfg.head_dim, cfg.compress_rate(layer), overlap=csa)
        self.indexer = Indexer(cfg) if csa else None


class GroupedLinear(nn.Module):
    """``o_a_proj``: heads in ``groups`` consecutive groups, each projected on its own.
    weight [groups * out, in] (group-major)."""

    def __init__(self, in_per_group: int, out_total: int, groups: int) -> None:
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.zeros(out_total, in_per_group))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, groups, in] -> [T, groups * out]."""
        return grouped_linear(x, self.weight, self.groups)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, groups: int) -> torch.Tensor:
    """x [T, groups, in] by weight [groups * out, in] (group-major) -> [T, groups * out]."""
    out = weight.shape[0] // groups
    return torch.cat(
        [F.linear(x[:, g], weight[g * out : (g + 1) * out]) for g in range(groups)], dim=1
    )


class V4Attention(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, layer: int) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        d, h, c = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        self.kind = cfg.layer_types[layer]
        self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=False)
        self.q_a_norm = FloatRMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * c, bias=False)
        self.kv_proj = nn.Linear(d, c, bias=False)
        self.kv_norm = FloatRMSNorm(c, cfg.rms_norm_eps)
        self.o_a_proj = GroupedLinear(
            h * c // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, cfg.o_groups
        )
        self.o_b_proj = nn.Linear(cfg.o_groups * cfg.o_lora_rank, d, bias=False)
        self.sinks = nn.Parameter(torch.zeros(h))
        self.compressor = Compressor(cfg, layer) if self.kind != SLIDING else None
        self.rotary = V4RotaryEmbedding(cfg.rope(layer), cfg.qk_rope_head_dim)

    def forward(
        self,
        x: torch.Tensor,  # [T, D]
        caches: list[torch.Tensor],  # ``cfg.layer_cache_widths(layer)`` order, written in place
        meta: V4StepMetadata,
    ) -> torch.Tensor:  # [T, D]
        cfg, rope = self.cfg, self.rotary
        num_tokens, h, c = x.shape[0], cfg.num_attention_heads, cfg.head_dim
        q_latent = self.q_a_norm(self.q_a_proj(x))
        q = unweighted_rms_norm(self.q_b_proj(q_latent).view(num_tokens, h, c), cfg.rms_norm_eps)
        q = rope.rotate(q, meta.positions)
        kv = rope.rotate(self.kv_norm(self.kv_proj(x)), meta.positions)
        window = caches[0]
        window.view(-1, c).index_copy_(0, meta.slot_mapping, kv.to(window.dtype))
        pool_cache = self.close_pools(x, caches, meta)
        if meta.sparse is None:
            out = self.dense_attention(x, q, q_latent, caches, pool_cache, meta)
        else:
            out = self.sparse_attention(x, q, q_latent, caches, pool_cache, meta)
        out = rope.rotate(out, meta.positions, inverse=True)  # [T, H, c]
        return self.o_b_proj(self.o_a_proj(out.reshape(num_tokens, cfg.o_groups, -1)))

    def close_pools(
        self, x: torch.Tensor, caches: list[torch.Tensor], meta: V4StepMetadata
    ) -> torch.Tensor | None:
        """Write the step's compressor inputs and close the windows that end in the step
        (CSA: the indexer's too); the layer's pool cache, or None on a sliding layer."""
        comp = self.compressor
        if comp is None:
            return None
        pool = meta.pool(comp.rate)
        pool_cache = caches[3] if comp.indexer else caches[2]
        comp.write_inputs(x, caches[1], meta.slot_mapping)
        comp.close(caches[1], pool_cache, pool, self.rotary)
        if comp.indexer is not None:
            comp.indexer.write_inputs(x, caches[2], meta.slot_mapping)
            comp.indexer.close(caches[2], caches[4], pool, self.rotary)
        return pool_cache

    def dense_attention(
        self,
        x: torch.Tensor,
        q: torch.Tensor,  # [T, H, c] rotated
        q_latent: torch.Tensor,
        caches: list[torch.Tensor],
        pool_cache: torch.Tensor | None,
        meta: V4StepMetadata,
    ) -> torch.Tensor:  # [T, H, c]
        """The reference: every key row of the step, a [T, K] mask of who reads what."""
        c = self.cfg.head_dim
        keys = caches[0].view(-1, c).index_select(0, meta.key_slots).to(x.dtype)  # [K, c]
        pos = meta.positions[:, None]
        mask = (meta.query_seq_ids[:, None] == meta.key_seq_ids[None, :]) & (
            (meta.key_positions[None, :] <= pos)
            & (meta.key_positions[None, :] > pos - self.cfg.sliding_window)
        )
        comp = self.compressor
        if comp is not None and pool_cache is not None:
            pool = meta.pool(comp.rate)
            visible = (meta.query_seq_ids[:, None] == pool.entry_seq_ids[None, :]) & (
                pool.entry_index[None, :] < (meta.positions[:, None] + 1) // comp.rate
            )
            entries = pool_cache.view(-1, c).index_select(0, pool.entry_slots).to(x.dtype)
            if comp.indexer is not None:
                visible = comp.indexer.select(x, q_latent, caches[4], meta, visible, self.rotary)
            keys = torch.cat([keys, entries], dim=0)
            mask = torch.cat([mask, visible], dim=1)
        return attend_with_sinks(q, keys, mask, self.sinks, c**-0.5)

    def sparse_attention(
        self,
        x: torch.Tensor,
        q: torch.Tensor,  # [T, H, c] rotated
        q_latent: torch.Tensor,
        caches: list[torch.Tensor],
        pool_cache: torch.Tensor | None,
        meta: V4StepMetadata,
    ) -> torch.Tensor:  # [T, H, c]
        """The same on mlafx's ops over the paged caches: ``v4_sparse_attention`` (one pass of
        ``v4_attention`` over the window rows and pool entries, the sink) and on CSA layers the
        indexer's ``dsa_indexer_topk``."""
        sparse = meta.sparse
        assert sparse is not None
        pool = None
        comp = self.compressor
        if comp is not None and pool_cache is not None:
            paged = sparse.pools[comp.rate]
            if comp.indexer is not None:  # CSA: the indexer's top-k
                selected = comp.indexer.select_paged(x, q_latent, caches[4], meta, self.rotary)
            else:  # HCA: every visible entry
                selected = paged.visible
            pool = (pool_cache, paged.table, paged.lens, selected)
        window = caches[0]
        return v4_sparse_attention(
            q.to(window.dtype), sparse.query_start_loc, window, sparse.block_table,
            sparse.kv_lens, sparse.window, self.sinks, self.cfg.head_dim**-0.5, pool,
        ).to(x.dtype)  # fmt: skip


def attend_with_sinks(
    q: torch.Tensor,  # [T, H, c]
    keys: torch.Tensor,  # [K, c], the values too
    mask: torch.Tensor,  # [T, K] bool, True = may attend
    sinks: torch.Tensor,  # [H] float32 logits in the denominator only
    scale: float,
) -> torch.Tensor:  # [T, H, c]
    logits = torch.einsum("thc,kc->htk", q, keys) * scale
    logits = logits.masked_fill(~mask, float("-inf"))
    sink = sinks.to(logits.dtype).view(-1, 1, 1).expand(-1, q.shape[0], 1)
    combined = torch.cat([logits, sink], dim=-1)
    combined = combined - combined.amax(dim=-1, keepdim=True)
    probs = combined.softmax(dim=-1)[..., :-1].to(keys.dtype)
    return torch.einsum("htk,kc->thc", probs, keys)
