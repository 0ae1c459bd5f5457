"""DeepSeek Sparse Attention (DSA: DeepSeek-V3.2, GLM-5), written the naive way (the reference
semantics, transformers' ``modeling_deepseek_v32.py`` / ``modeling_glm_moe_dsa.py``).

Symbols as in ``attention.py``; Hi = index_n_heads, Di = index_head_dim, k = index_topk.
A layer's lightning indexer scores every key its queries may see and keeps the k best:

    q_latent = q_a_layernorm(q_a_proj(x))               (the MLA's own q LoRA output)  [T, Lq]
    iq       = wq_b(q_latent), first R dims rotated     [T, Hi, Di]
    ik       = k_norm(wk(x)), first R dims rotated      [T, Di]   (LayerNorm with bias)
               (RoPE as NeoX halves in V3.2, interleaved pairs in GLM-5)
    index_cache[slot] = ik                              (one more paged row per token)
    w        = weights_proj(x) * Hi^-0.5                [T, Hi] float32 (weights_proj is fp32)
    score    = sum_h w[t, h] * relu(iq[t, h] . ik[j] * Di^-0.5)                      [T, K]
    selected = the visible positions with the k best scores, ascending, -1 padded   [T, k]

Ties go to the earlier position (a stable descending sort; transformers' ``topk`` leaves them
unspecified). The MLA attention then sees only its selected positions: its mask AND the
selection. When a query sees at most k keys the selection is all of them, so dense attention
falls out of the same code. A GLM-5 "shared" layer has no indexer: it attends to the
selection of the last "full" layer before it.

The compiled step lowers the indexer to ``mlafx::dsa_indexer_topk`` over the paged indexer
cache and the attention to ``mlafx::mla_attention_sparse``; this module stays the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mlafx.config import ModelConfig
from mlafx.models.attention import MLAttention
from mlafx.models.decoder_layer import DecoderLayer
from mlafx.models.rope import apply_rope
from mlafx.models.step import StepMetadata


class Indexer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        heads, dim = cfg.index_n_heads, cfg.index_head_dim
        assert cfg.q_lora_rank is not None  # ModelConfig refuses a DSA config without one
        self.wq_b = nn.Linear(cfg.q_lora_rank, heads * dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, dim, bias=False)
        self.k_norm = nn.LayerNorm(dim, eps=1e-6)
        # float32 in any model dtype (transformers keeps it so, like the router)
        self.weights_proj = nn.Linear(cfg.hidden_size, heads, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # [T, D]
        q_latent: torch.Tensor,  # [T, Lq]
        cos: torch.Tensor,  # [T, R/2] float32
        sin: torch.Tensor,
        cache: torch.Tensor,  # [NB, BS, Di], mutated
        key_slots: torch.Tensor,  # [K] int64
        mask: torch.Tensor,  # [T, K] bool, True = visible
        meta: StepMetadata,
        positions: torch.Tensor,  # [T] int64
    ) -> torch.Tensor:  # [T, k] int64 selected positions
        heads, dim = self.cfg.index_n_heads, self.cfg.index_head_dim
        q = self._rotated(self.wq_b(q_latent).view(x.shape[0], heads, dim), cos, sin)
        k = self._rotated(self.k_norm(self.wk(x)), cos, sin)
        return self.select(q, k, self.head_weights(x), cache, key_slots, mask, meta, positions)

    def select(
        self,
        q: torch.Tensor,  # [T, Hi, Di] rotated
        k: torch.Tensor,  # [T, Di] rotated: the new rows of the indexer cache
        weights: torch.Tensor,  # [T, Hi] float32 (``head_weights``)
        cache: torch.Tensor,
        key_slots: torch.Tensor,
        mask: torch.Tensor,
        meta: StepMetadata,
        positions: torch.Tensor,
    ) -> torch.Tensor:  # [T, k] int64
        """Write the new key rows, score the visible rows, keep the best. The capture records
        this as ``mlafx::write_latent_cache`` + ``mlafx::dsa_indexer_topk`` over the paged cache
        (``meta``'s block tables, ``positions``: what the reference's key rows restate)."""
        dim = self.cfg.index_head_dim
        rows = cache.view(-1, dim)
        rows.index_copy_(0, meta.slot_mapping, k.to(cache.dtype))
        keys = rows.index_select(0, key_slots).to(torch.float32)  # [K, Di]
        scores = torch.einsum("thd,kd->thk", q.to(torch.float32), keys) * dim**-0.5
        index_scores = torch.einsum("th,thk->tk", weights, scores.relu())
        return top_positions(index_scores, mask, meta.key_positions, self.cfg.index_topk)

    def head_weights(self, x: torch.Tensor) -> torch.Tensor:
        """``weights_proj(x) * Hi^-0.5`` [T, Hi] float32."""
        w = self.weights_proj.weight
        return F.linear(x.to(w.dtype), w).to(torch.float32) * self.cfg.index_n_heads**-0.5

    def _rotated(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``t`` [..., Di] with its first R dims rotated."""
        rope = self.cfg.qk_rope_head_dim
        rot, rest = t.split([rope, t.shape[-1] - rope], dim=-1)
        return torch.cat([apply_rope(rot, cos, sin, self.cfg.indexer_rope_interleave), rest], -1)


def top_positions(
    scores: torch.Tensor,  # [T, K] float32
    mask: torch.Tensor,  # [T, K] bool
    key_positions: torch.Tensor,  # [K] int64
    topk: int,
) -> torch.Tensor:  # [T, topk] int64
    """The positions of the ``topk`` best-scoring visible key rows of each query, ascending,
    padded with -1; among equal scores the earlier row (position) wins."""
    num_tokens = scores.shape[0]
    # topk padding columns (never visible) so that every query has topk candidates
    never = scores.new_full((num_tokens, topk), float("-inf"))
    scores = torch.cat([scores.masked_fill(~mask, float("-inf")), never], 1)
    visible = torch.cat([mask, mask.new_zeros((num_tokens, topk))], 1)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :topk]
    positions = torch.cat([key_positions, key_positions.new_full((topk,), -1)])[order]
    chosen = torch.where(visible.gather(1, order), positions, -1)
    last = torch.iinfo(torch.int64).max  # -1 sorts after every position
    ascending = torch.sort(torch.where(chosen < 0, last, chosen), dim=1).values
    return torch.where(ascending == last, -1, ascending)


def selection_mask(
    selected: torch.Tensor,  # [T, k] int64 positions, -1 = none
    meta: StepMetadata,
    num_keys: int,
) -> torch.Tensor:  # [T, K] bool
    """Which flat key rows each query selected: the key rows of sequence b are its positions
    ``0 .. kv_lens[b] - 1`` in order (``StepMetadata``)."""
    lens = meta.kv_lens.to(torch.int64)
    first_row = (torch.cumsum(lens, 0) - lens)[meta.query_seq_ids]  # [T]
    rows = torch.where(selected >= 0, first_row[:, None] + selected, num_keys)
    chosen = torch.zeros(selected.shape[0], num_keys + 1, dtype=torch.bool)
    return chosen.scatter(1, rows, True)[:, :num_keys]


class SparseMLAttention(MLAttention):
    """MLA whose queries see only the positions an indexer selected: this layer's own
    (``indexer``) or, for a GLM-5 "shared" layer (no indexer), the previous full layer's."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__(cfg)
        self.indexer = Indexer(cfg) if cfg.runs_indexer(layer) else None

    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        caches: list[torch.Tensor],  # [latent cache] (+ [indexer cache] with an indexer)
        slot_mapping: torch.Tensor,
        key_slots: torch.Tensor,
        mask: torch.Tensor,
        meta: StepMetadata,
        positions: torch.Tensor,  # [T] int64
        selected: torch.Tensor | None,  # [T, k] the previous full layer's (shared layers)
    ) -> tuple[torch.Tensor, torch.Tensor]:  # out [T, D], selected [T, k]
        q_latent = self.q_latent(x)
        assert q_latent is not None
        if self.indexer is not None:
            cache, index_cache = caches
            selected = self.indexer(
                x, q_latent, cos, sin, index_cache, key_slots, mask, meta, positions
            )
        else:
            (cache,) = caches
            if selected is None:
                raise ValueError("a shared DSA layer needs the selection of a full layer")
        mask = mask & selection_mask(selected, meta, mask.shape[1])
        out = self.attend(x, q_latent, cos, sin, cache, slot_mapping, key_slots, mask)
        return out, selected


class DsaDecoderLayer(DecoderLayer):
    """A decoder layer whose attention is ``SparseMLAttention``: takes and returns the
    selection (a full layer ignores the one it gets)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__(cfg, layer)
        self.self_attn = SparseMLAttention(cfg, layer)

    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        caches: list[torch.Tensor],
        slot_mapping: torch.Tensor,
        key_slots: torch.Tensor,
        mask: torch.Tensor,
        meta: StepMetadata,
        positions: torch.Tensor,
        selected: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attn, selected = self.self_attn(
            self.input_layernorm(x), cos, sin, caches, slot_mapping, key_slots, mask, meta,
            positions, selected,
        )  # fmt: skip
        return self.mlp_block(self.add_branch(x, attn)), selected
