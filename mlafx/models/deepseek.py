"""The DeepSeek-V2/V3-family causal LM (also Kimi K2, GLM-4.7-Flash, MiniCPM3) as one step
function.

``forward(input_ids [T], positions [T], caches, meta, logits_indices [S]) -> logits [S, vocab]``
(DESIGN.md "The step ABI"). Module and parameter names are transformers' in-memory names,
so checkpoints load directly (see ``mlafx.models.weights``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mlafx.config import ModelConfig
from mlafx.models.attention import MLAttention
from mlafx.models.layers import RMSNorm, SwiGLU, scale_embedding, scale_logits_input
from mlafx.models.longcat import LongcatDecoderLayer
from mlafx.models.moe import MoE
from mlafx.models.rope import rope_cos_sin, rope_inv_freq, rope_scale
from mlafx.models.step import StepMetadata, check_key_rows, key_slots_and_mask


class DecoderLayer(nn.Module):
    """Pre-norm residual layer: ``x + attn(norm(x))``, then ``x + mlp(norm(x))`` (each branch
    times ``residual_scale`` first when the config scales them: MiniCPM3).

    ``all_reduce`` is None (no op in the graph) unless ``mlafx.parallel`` made this layer a
    tensor-parallel shard: then the attention and MLP outputs are per-rank partial sums
    (row-parallel ``o_proj`` / ``down_proj``) and ``all_reduce`` sums them over the ranks.
    """

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.all_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.residual_scale = cfg.residual_scale
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module = (
            MoE(cfg) if cfg.is_moe_layer(layer) else SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        caches: list[torch.Tensor],  # [cache [NB, BS, Lkv+R]], mutated
        slot_mapping: torch.Tensor,
        key_slots: torch.Tensor,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        (cache,) = caches
        attn = self.self_attn(
            self.input_layernorm(x), cos, sin, cache, slot_mapping, key_slots, mask
        )
        if self.all_reduce is not None:
            attn = self.all_reduce(attn)
        x = x + self._scaled(attn)
        mlp = self.mlp(self.post_attention_layernorm(x))
        if self.all_reduce is not None:
            mlp = self.all_reduce(mlp)
        return x + self._scaled(mlp)

    def _scaled(self, branch: torch.Tensor) -> torch.Tensor:
        return branch if self.residual_scale == 1.0 else branch * self.residual_scale


class Backbone(nn.Module):
    """transformers' ``model.*``: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        layer_type = LongcatDecoderLayer if cfg.shortcut_moe else DecoderLayer
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layer_type(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class MLAForCausalLM(nn.Module):
    # StepFn: the reference attention derives its key slots and mask from the flat key rows
    reads_key_rows = True

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
        for layer, own in zip(self.model.layers, caches_by_layer(cfg, caches), strict=True):
            x = layer(x, cos, sin, own, meta.slot_mapping, key_slots, mask)
        h = self.model.norm(x.index_select(0, logits_indices))
        return self.lm_head(scale_logits_input(h, cfg.logits_divisor))


def caches_by_layer(cfg: ModelConfig, caches: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """The step's caches (one per MLA block, in model order) grouped by decoder layer:
    ``cfg.attention_blocks`` each."""
    if len(caches) != cfg.num_cache_layers:
        raise ValueError(f"{len(caches)} caches for {cfg.num_cache_layers} MLA blocks")
    blocks = cfg.attention_blocks
    return [caches[i : i + blocks] for i in range(0, len(caches), blocks)]
