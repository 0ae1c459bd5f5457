"""The DeepSeek-V2/V3-family causal LM (also Kimi K2, GLM-4.7-Flash, MiniCPM3, LongCat-Flash,
and with DSA sparse attention DeepSeek-V3.2 and GLM-5) as one step function.

``forward(input_ids [T], positions [T], caches, meta, logits_indices [S]) -> logits [S, vocab]``
(DESIGN.md "The step ABI"). Module and parameter names are transformers' in-memory names,
so checkpoints load directly (see ``mlafx.models.weights``).
"""

from __future__ import annotations

import torch
from torch import nn

from mlafx.config import ModelConfig
from mlafx.models.decoder_layer import DecoderLayer
from mlafx.models.dsa import DsaDecoderLayer, Indexer
from mlafx.models.layers import RMSNorm, scale_embedding, scale_logits_input
from mlafx.models.longcat import LongcatDecoderLayer
from mlafx.models.moe import Router
from mlafx.models.rope import rope_cos_sin, rope_inv_freq, rope_scale
from mlafx.models.step import StepMetadata, check_key_rows, key_slots_and_mask


class Backbone(nn.Module):
    """transformers' ``model.*``: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        layer_type: type[nn.Module] = DecoderLayer
        if cfg.shortcut_moe:
            layer_type = LongcatDecoderLayer
        elif cfg.sparse_attention:
            layer_type = DsaDecoderLayer
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer_type(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MLAForCausalLM(nn.Module):
    # StepFn: the reference attention derives its key slots and mask from the flat key rows
    reads_key_rows = True
    rope_inv_freq: torch.Tensor  # a buffer

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.register_buffer("rope_inv_freq", rope_inv_freq(cfg), persistent=False)
        self.rope_scale = rope_scale(cfg)

    @property
    def dtype(self) -> torch.dtype:
        """The model dtype: the embedding's (never quantized; the router stays fp32)."""
        return self.model.embed_tokens.weight.dtype

    def keep_float32(self) -> None:
        """Make the parts transformers keeps in float32 in any model dtype float32 (the
        routers, the DSA indexers' head weights): decisions (which expert, which keys) are
        discontinuous in them."""
        for module in self.modules():
            if isinstance(module, Router):
                module.float()
            elif isinstance(module, Indexer):
                module.weights_proj.float()

    def reset_rope(self) -> None:
        """Recompute the (non-persistent) RoPE frequencies, e.g. after ``to_empty``."""
        self.rope_inv_freq = rope_inv_freq(self.config)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        caches: list[torch.Tensor],  # per MLA block [NB, BS, Lkv+R], written in place
        meta: StepMetadata,
        logits_indices: torch.Tensor,  # [S] int64: the tokens whose next token is sampled
    ) -> torch.Tensor:  # [S, vocab]
        if not torch.compiler.is_compiling():  # export traces a sample that has them
            check_key_rows(meta)  # inputs built without them would attend to no keys
        key_slots, mask = key_slots_and_mask(meta, positions, caches[0].shape[1])
        cos, sin = rope_cos_sin(positions, self.rope_inv_freq, self.rope_scale)

        cfg = self.config
        x = scale_embedding(self.model.embed_tokens(input_ids), cfg.embedding_scale)
        selected = None  # DSA: the selection of the last layer that ran its indexer
        for layer, own in zip(self.model.layers, caches_by_layer(cfg, caches), strict=True):
            if cfg.sparse_attention:
                x, selected = layer(
                    x, cos, sin, own, meta.slot_mapping, key_slots, mask, meta, positions, selected
                )
            else:
                x = layer(x, cos, sin, own, meta.slot_mapping, key_slots, mask)
        h = self.model.norm(x.index_select(0, logits_indices))
        return self.lm_head(scale_logits_input(h, cfg.logits_divisor))


def caches_by_layer(cfg: ModelConfig, caches: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The step's caches (``cfg.cache_widths``, in model order) grouped by decoder layer:
    ``cfg.layer_cache_widths(i)`` for layer i."""
    if len(caches) != cfg.num_caches:
        raise ValueError(f"{len(caches)} caches for the model's {cfg.num_caches}")
    out, start = [], 0
    for layer in range(cfg.num_hidden_layers):
        count = len(cfg.layer_cache_widths(layer))
        out.append(caches[start : start + count])
        start += count
    return out
