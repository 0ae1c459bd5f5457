"""The DeepSeek-V4 causal LM as one step function (the reference semantics).

``forward(input_ids [T], caches, meta, logits_indices [S]) -> logits [S, vocab]``: T new tokens
of a flat batch (``V4StepMetadata``), each layer's caches (``cache_shapes``) written in place.
Module and parameter names are transformers' in-memory names, so its state dict loads as is.

    x      = embed(input_ids) copied onto hc_mult streams                     [T, N, D]
    layer  : post, comb, h = attn_hc(x);  x = post * attn(input_layernorm(h)) + comb^T x
             post, comb, h = ffn_hc(x);   x = post * moe(post_attention_layernorm(h)) + comb^T x
    logits = lm_head(norm(hc_head(x)))
"""

from __future__ import annotations

import torch
from torch import nn

from mlafx.config.deepseek_v4 import DeepseekV4Config
from mlafx.models.deepseek_v4.attention import V4Attention
from mlafx.models.deepseek_v4.compressor import FloatRMSNorm
from mlafx.models.deepseek_v4.hyper_connection import HyperConnection, HyperHead, expand_streams
from mlafx.models.deepseek_v4.moe import V4MoE
from mlafx.models.deepseek_v4.step import V4StepMetadata


class V4DecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, layer: int) -> None:
        super().__init__()
        self.self_attn = V4Attention(cfg, layer)
        self.mlp = V4MoE(cfg, layer)
        self.input_layernorm = FloatRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = FloatRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(cfg)
        self.ffn_hc = HyperConnection(cfg)

    def forward(
        self,
        x: torch.Tensor,  # [T, N, D]
        input_ids: torch.Tensor,
        caches: list[torch.Tensor],
        meta: V4StepMetadata,
    ) -> torch.Tensor:
        post, comb, h = self.attn_hc(x)
        x = expand_streams(x, self.self_attn(self.input_layernorm(h), caches, meta), post, comb)
        post, comb, h = self.ffn_hc(x)
        return expand_streams(x, self.mlp(self.post_attention_layernorm(h), input_ids), post, comb)


class V4Backbone(nn.Module):
    """transformers' ``model.*``."""

    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(V4DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.hc_head = HyperHead(cfg)
        self.norm = FloatRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DeepseekV4ForCausalLM(nn.Module):
    def __init__(self, cfg: DeepseekV4Config) -> None:
        super().__init__()
        self.config = cfg
        self.model = V4Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        caches: list[torch.Tensor],  # ``cache_shapes`` order, written in place
        meta: V4StepMetadata,
        logits_indices: torch.Tensor,  # [S] int64: the tokens whose next token is sampled
    ) -> torch.Tensor:  # [S, vocab]
        cfg = self.config
        x = self.model.embed_tokens(input_ids)
        x = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        for layer, own in zip(self.model.layers, caches_by_layer(cfg, caches), strict=True):
            x = layer(x, input_ids, own, meta)
        h = self.model.norm(self.model.hc_head(x.index_select(0, logits_indices)))
        return self.lm_head(h)


def cache_shapes(
    cfg: DeepseekV4Config, num_blocks: int, block_size: int
) -> list[tuple[int, int, int]]:
    """Every cache of the step, layer by layer: token caches [NB, BS, width], then pool caches
    [NB, entries per block, width] (``DeepseekV4Config.cache_block_shapes``)."""
    return [(num_blocks, rows, width) for rows, width in cfg.cache_block_shapes(block_size)]


def caches_by_layer(cfg: DeepseekV4Config, caches: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    counts = [sum(map(len, cfg.layer_cache_widths(i))) for i in range(cfg.num_hidden_layers)]
    if len(caches) != sum(counts):
        raise ValueError(f"{len(caches)} caches for the model's {sum(counts)}")
    out, start = [], 0
    for count in counts:
        out.append(caches[start : start + count])
        start += count
    return out
