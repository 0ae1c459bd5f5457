"""Multi-head latent attention, written the naive way (the reference semantics).

Symbols: T new tokens, K key rows, H heads, D hidden, Lkv = kv_lora_rank, R = qk_rope_head_dim,
P = qk_nope_head_dim, V = v_head_dim, Lq = q_lora_rank. ``W_kvb = kv_b_proj.weight``
[H*(P+V), Lkv] holds ``W_UK`` [H, P, Lkv] and ``W_UV`` [H, V, Lkv] interleaved per head.

    q            = q_proj(x)  or  q_b_proj(q_a_layernorm(q_a_proj(x)))      [T, H, P+R]
    kv_c | k_pe  = kv_a_proj_with_mqa(x)                                   [T, Lkv | R]
    kv_c         = kv_a_layernorm(kv_c);  q_pe, k_pe = rope(q_pe), rope(k_pe)
                   (LongCat-Flash: q * sqrt(D/Lq) and kv_c * sqrt(D/Lkv) before that)
    cache[slot]  = [kv_c | k_pe]           (index_copy_ into the paged cache, one row per token)
    rows         = cache[key slots]        (every row any query of the step may see)  [K, Lkv+R]
    k_nope | v   = kv_b_proj(rows[:, :Lkv])                                [K, H, P | V]
    k            = [k_nope | rows[:, Lkv:] broadcast to all heads]         [K, H, P+R]
    out          = o_proj(SDPA(q, k, v, mask, scale))                      [T, D]

This decompresses every key row every step (like transformers). The compiler rewrites it
into the absorbed/paged kernels; this module stays the clear reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mlafx.config import ModelConfig
from mlafx.models.layers import RMSNorm
from mlafx.models.rope import apply_rope


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, h = cfg.hidden_size, cfg.num_attention_heads
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(d, h * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=cfg.attention_bias)
            # transformers and the original code use eps 1e-6 for the latent norms, not rms_norm_eps
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, cfg.latent_width, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(
            cfg.kv_lora_rank, h * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(h * cfg.v_head_dim, d, bias=cfg.attention_bias)

    def forward(
        self,
        x: torch.Tensor,  # [T, D]
        cos: torch.Tensor,  # [T, R/2] float32
        sin: torch.Tensor,  # [T, R/2] float32
        cache: torch.Tensor,  # [NB, BS, Lkv+R], mutated
        slot_mapping: torch.Tensor,  # [T] int64
        key_slots: torch.Tensor,  # [K] int64
        mask: torch.Tensor,  # [T, K] bool, True = may attend
    ) -> torch.Tensor:
        return self.attend(x, self.q_latent(x), cos, sin, cache, slot_mapping, key_slots, mask)

    def q_latent(self, x: torch.Tensor) -> torch.Tensor | None:
        """``q_a_layernorm(q_a_proj(x))`` [T, Lq] (None without a q LoRA): q_b_proj's input,
        which a DSA indexer reads too."""
        if self.cfg.q_lora_rank is None:
            return None
        return self.q_a_layernorm(self.q_a_proj(x))

    def attend(
        self,
        x: torch.Tensor,  # [T, D]
        q_latent: torch.Tensor | None,  # [T, Lq] (``q_latent(x)``)
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        key_slots: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        """The attention of ``forward`` given the q LoRA's output."""
        cfg = self.cfg
        num_tokens, h = x.shape[0], cfg.num_attention_heads
        lkv, r, p, v_dim = (
            cfg.kv_lora_rank,
            cfg.qk_rope_head_dim,
            cfg.qk_nope_head_dim,
            cfg.v_head_dim,
        )

        q = self.q_proj(x) if q_latent is None else self.q_b_proj(q_latent)
        q_nope, q_pe = q.view(num_tokens, h, p + r).split([p, r], dim=-1)
        kv_c, k_pe = self.kv_a_proj_with_mqa(x).split([lkv, r], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c)
        if cfg.mla_q_scale != 1.0:
            q_nope, q_pe = q_nope * cfg.mla_q_scale, q_pe * cfg.mla_q_scale
        if cfg.mla_latent_scale != 1.0:
            kv_c = kv_c * cfg.mla_latent_scale
        q_pe = apply_rope(q_pe, cos, sin, cfg.rope_interleave)
        k_pe = apply_rope(k_pe, cos, sin, cfg.rope_interleave)

        rows = cache.view(-1, cfg.latent_width)
        rows.index_copy_(0, slot_mapping, torch.cat([kv_c, k_pe], dim=-1).to(cache.dtype))
        keys = rows.index_select(0, key_slots).to(x.dtype)  # [K, Lkv+R]
        num_keys = keys.shape[0]
        key_c, key_pe = keys.split([lkv, r], dim=-1)
        k_nope, value = self.kv_b_proj(key_c).view(num_keys, h, p + v_dim).split([p, v_dim], dim=-1)
        key = torch.cat([k_nope, key_pe[:, None, :].expand(num_keys, h, r)], dim=-1)
        query = torch.cat([q_nope, q_pe], dim=-1)

        # Head-major copies laid out so that every matmul inside SDPA reads a contiguous
        # operand (the key as K^T): views of strided operands would make export specialise
        # on "T != 1" / "K != 1", and decode steps have T = 1.
        key_t = key.permute(1, 2, 0).clone(memory_format=torch.contiguous_format)  # [H, P+R, K]
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1).clone(memory_format=torch.contiguous_format),  # [H, T, P+R]
            key_t.transpose(1, 2),  # [H, K, P+R]
            value.transpose(0, 1).clone(memory_format=torch.contiguous_format),  # [H, K, V]
            attn_mask=mask,
            scale=cfg.softmax_scale,
        )
        out = out.transpose(0, 1).clone(memory_format=torch.contiguous_format)
        out = out.view(num_tokens, h * v_dim)
        return self.o_proj(out)
