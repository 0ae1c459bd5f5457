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
    quantized   linears and expert stacks (int8/int4, GGUF K-quants, block FP8) split the same
                way at their format's block boundaries (``quantized_shards``)

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
from mlafx.models.packed_int4_checkpoint import replace_module
from mlafx.parallel.quantized_shards import (
    AXIS_WORDS,
    COLS,
    QUANTIZED_MODULES,
    ROWS,
    shard_quantized,
)


def check_shardable(
    cfg: ModelConfig, world_size: int, blocks: tuple[int, int] | None = None
) -> None:
    """Raise ``ValueError`` naming every dimension that ``world_size`` ranks cannot split
    evenly (heads; the dense, shared-expert and routed-expert intermediate widths in use)
    and, for quantized weights in ``blocks`` (rows, columns; ``quantized_shards``), every
    per-rank width that is not a whole number of blocks."""
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
    if blocks is not None:
        _check_whole_blocks(cfg, world_size, blocks, widths)


def _check_whole_blocks(
    cfg: ModelConfig, world_size: int, blocks: tuple[int, int], widths: dict[str, int]
) -> None:
    heads = cfg.num_attention_heads // world_size
    per_rank: dict[str, tuple[int, tuple[int, ...]]] = {  # what: (width per rank, its axes)
        "query projection rows": (heads * cfg.qk_head_dim, (ROWS,)),
        "o_proj columns": (heads * cfg.v_head_dim, (COLS,)),
    }
    for name in ("intermediate_size", "moe_intermediate_size"):
        if name in widths:
            per_rank[name] = (widths[name] // world_size, (ROWS, COLS))
    if "moe_intermediate_size" in widths and cfg.n_shared_experts:
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts // world_size
        per_rank["shared experts' intermediate width"] = (shared, (ROWS, COLS))
    bad = [
        f"{what} {width} per rank (blocks of {blocks[axis]} {AXIS_WORDS[axis]})"
        for what, (width, axes) in per_rank.items()
        for axis in axes
        if width % blocks[axis]
    ]
    if bad:
        raise ValueError(
            f"tensor_parallel_size={world_size} would cut the quantized weights of "
            f"{cfg.model_type} inside their {blocks[0]}x{blocks[1]} blocks: {'; '.join(bad)}"
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
_SPLITS: tuple[tuple[re.Pattern[str], int], ...] = tuple(
    (re.compile(pattern), axis)
    for pattern, axis in (
        (r"\.self_attn(\.\d+)?\.(q_proj|q_b_proj|kv_b_proj)\.weight$", ROWS),
        (r"\.self_attn(\.\d+)?\.o_proj\.weight$", COLS),
        (r"\.(mlp|mlps\.\d+)\.(shared_experts\.)?(gate_proj|up_proj)\.weight$", ROWS),
        (r"\.(mlp|mlps\.\d+)\.(shared_experts\.)?down_proj\.weight$", COLS),
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
    axis = split_axis(name)
    return full if axis is None else full.chunk(world_size, dim=axis)[rank]


def split_axis(name: str) -> int | None:
    """The axis along which the full model's tensor ``name`` splits (None: replicated; the
    fused expert stacks have their own rules in ``shard_tensor``)."""
    for pattern, axis in _SPLITS:
        if pattern.search(name):
            return axis
    return None


def shard_model(full: MLAForCausalLM, rank: int, world_size: int) -> MLAForCausalLM:
    """Rank ``rank``'s shard of ``full`` (same dtypes; eval mode, no grad), its own tensors
    (a replicated quantized module is shared with ``full``, which the caller drops).
    Quantized linears and experts split at their blocks (``quantized_shards``).

    Collectives are not installed here (``collectives.install_all_reduce``)."""
    cfg = shard_config(full.config, world_size)
    with torch.device("meta"):
        shard = MLAForCausalLM(cfg)
    shard.to(full.dtype)
    shard.keep_float32()
    shard.to_empty(device="cpu")
    if cfg.tie_word_embeddings:
        shard.lm_head.weight = shard.model.embed_tokens.weight
    shard.reset_rope()
    quantized = {
        name: module
        for name, module in full.named_modules()
        if isinstance(module, QUANTIZED_MODULES)
    }
    for name, module in quantized.items():
        piece = shard_quantized(name, module, split_axis(f"{name}.weight"), rank, world_size)
        replace_module(shard, name, piece)
    sources = full.state_dict()
    with torch.no_grad():
        for name, target in shard.state_dict(keep_vars=True).items():
            if name.rpartition(".")[0] in quantized:
                continue
            part = shard_tensor(name, sources[name], rank, world_size)
            if part.shape != target.shape:
                raise AssertionError(f"{name}: shard {list(part.shape)} != {list(target.shape)}")
            target.data.copy_(part)
    return shard.eval().requires_grad_(False)
