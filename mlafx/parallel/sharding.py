"""How the model splits across N tensor-parallel ranks, and the shard model of one rank.

Rank r of N holds (every split is a contiguous 1/N slice, rank r's being the r-th):

    attention   q_proj / q_b_proj.weight   [H*(P+R), *]   rows: heads r*H/N .. (r+1)*H/N - 1
                kv_b_proj.weight           [H*(P+V), Lkv] rows: the same heads   (column-parallel)
                o_proj.weight              [D, H*V]       columns: the same heads (row-parallel)
                o_proj.bias                [D]            rank 0 only (zeros elsewhere: summed once)
                q_a_proj, q_a_layernorm, kv_a_proj_with_mqa, kv_a_layernorm: replicated, so the
                latent cache row (no head axis) is computed, and held, identically by every rank
    dense MLP   gate_proj, up_proj.weight  [I, D]         rows     (column-parallel)
    and shared  down_proj.weight           [D, I]         columns  (row-parallel)
    experts
    routed      experts.gate_up_proj       [E, 2I, D]     gate rows and up rows, each sliced
    experts     experts.down_proj          [E, D, I]      the intermediate axis
                gate.weight (router)       [E, D]         replicated: every rank routes alike
    LongCat-Flash: the same per MLA block (``self_attn.{0,1}``) and dense MLP (``mlps.{0,1}``);
                its zero experts' identity term is added after the sum (every rank has it)
    replicated  embed_tokens, lm_head (not split by vocabulary), the norms

Every expert is split across the ranks by its intermediate width (each rank computes 1/N of
every routed expert for the tokens routed to it), not whole experts per rank: the
``moe_experts`` kernel then runs unchanged on every rank with exactly 1/N of the work for
any routing, where whole experts per rank would need a data-dependent compaction of the
token-expert pairs (or compute masked pairs on a dummy expert) and would load the ranks as
unevenly as the router does.

The shard model is an ordinary ``MLAForCausalLM`` of the shard config (H/N heads, I/N
intermediate widths; every other dimension unchanged) whose decoder layers sum their
attention and MLP outputs over the ranks (``collectives.install_all_reduce``).
"""

from __future__ import annotations

import re
from dataclasses import replace

import torch

from mlafx.config import ModelConfig
from mlafx.models.deepseek import MLAForCausalLM


def check_shardable(cfg: ModelConfig, world_size: int) -> None:
    """Raise ``ValueError`` naming every dimension that ``world_size`` ranks cannot split
    evenly (heads; the dense, shared-expert and routed-expert intermediate widths in use)."""
    if world_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {world_size}")
    has_moe = any(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    has_dense = cfg.shortcut_moe or not all(
        cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)
    )
    widths = {"num_attention_heads": cfg.num_attention_heads}
    if has_dense:
        widths["intermediate_size"] = cfg.intermediate_size
    if has_moe:
        widths["moe_intermediate_size"] = cfg.moe_intermediate_size
    bad = [f"{name}={value}" for name, value in widths.items() if value % world_size]
    if bad:
        raise ValueError(
            f"tensor_parallel_size={world_size} must divide the attention heads and the MLP "
            f"intermediate widths of {cfg.model_type}; it does not divide {', '.join(bad)}"
        )


def shard_config(cfg: ModelConfig, world_size: int) -> ModelConfig:
    """The config of one rank's shard: H/N heads and I/N intermediate widths."""
    check_shardable(cfg, world_size)
    return replace(
        cfg,
        num_attention_heads=cfg.num_attention_heads // world_size,
        intermediate_size=cfg.intermediate_size // world_size,
        moe_intermediate_size=cfg.moe_intermediate_size // world_size,
    )


# (pattern on the state_dict name, axis split into N contiguous slices)
_ROWS, _COLS = 0, 1
_SPLITS: tuple[tuple[re.Pattern[str], int], ...] = tuple(
    (re.compile(pattern), axis)
    for pattern, axis in (
        (r"\.self_attn(\.\d+)?\.(q_proj|q_b_proj|kv_b_proj)\.weight$", _ROWS),
        (r"\.self_attn(\.\d+)?\.o_proj\.weight$", _COLS),
        (r"\.(mlp|mlps\.\d+)\.(shared_experts\.)?(gate_proj|up_proj)\.weight$", _ROWS),
        (r"\.(mlp|mlps\.\d+)\.(shared_experts\.)?down_proj\.weight$", _COLS),
        (r"\.mlp\.experts\.down_proj$", 2),
    )
)
_GATE_UP = re.compile(r"\.mlp\.experts\.gate_up_proj$")
_ROW_PARALLEL_BIAS = re.compile(r"\.self_attn(\.\d+)?\.o_proj\.bias$")


def shard_tensor(name: str, full: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s part of the full model's tensor ``name`` (a view when it is a slice)."""
    if _GATE_UP.search(name):  # [E, 2I, D]: the gate rows' slice, then the up rows' slice
        gate, up = full.chunk(2, dim=1)
        return torch.cat([part.chunk(world_size, dim=1)[rank] for part in (gate, up)], dim=1)
    if _ROW_PARALLEL_BIAS.search(name):
        return full if rank == 0 else torch.zeros_like(full)
    for pattern, axis in _SPLITS:
        if pattern.search(name):
            return full.chunk(world_size, dim=axis)[rank]
    return full


def shard_model(full: MLAForCausalLM, rank: int, world_size: int) -> MLAForCausalLM:
    """Rank ``rank``'s shard of ``full`` (same dtypes; eval mode, no grad), its own tensors.

    Collectives are not installed here (``collectives.install_all_reduce``)."""
    cfg = shard_config(full.config, world_size)
    with torch.device("meta"):
        shard = MLAForCausalLM(cfg)
    shard.to(full.lm_head.weight.dtype)
    shard.keep_float32()
    shard.to_empty(device="cpu")
    if cfg.tie_word_embeddings:
        shard.lm_head.weight = shard.model.embed_tokens.weight
    shard.reset_rope()
    sources = full.state_dict()
    with torch.no_grad():
        for name, target in shard.state_dict(keep_vars=True).items():
            part = shard_tensor(name, sources[name], rank, world_size)
            if part.shape != target.shape:
                raise AssertionError(f"{name}: shard {list(part.shape)} != {list(target.shape)}")
            target.data.copy_(part)
    return shard.eval().requires_grad_(False)
