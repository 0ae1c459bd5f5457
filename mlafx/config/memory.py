"""Up-front memory estimate: refuse a model that cannot fit before allocating anything."""

from __future__ import annotations

import os

from mlafx.config.model_config import ConfigError, ModelConfig
from mlafx.config.served_config import ServedConfig

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_bytes(dtype: str) -> int:
    try:
        return _DTYPE_BYTES[dtype]
    except KeyError:
        raise ConfigError(
            f"dtype {dtype!r} is not supported; use {', '.join(_DTYPE_BYTES)}"
        ) from None


# Bytes per weight of the quantized formats (mlafx.kernels.quant_format: 32 weights and one
# fp16 scale per group), padding aside.
QUANTIZED_BYTES_PER_WEIGHT = {"int8": 34 / 32, "int4": 18 / 32}

# The linears of each kind, by a representative module name (a stored format's ``ignore``
# list is matched against it).
_KIND_MODULES = {
    "attention": "model.layers.0.self_attn.o_proj",
    "dense_mlp": "model.layers.0.mlp.down_proj",
    "shared_experts": "model.layers.0.mlp.shared_experts.down_proj",
    "routed_experts": "model.layers.0.mlp.experts.0.down_proj",
    "lm_head": "lm_head",
}


def parameter_kinds(cfg: ModelConfig) -> dict[str, int]:
    """Parameters by kind: the linears of ``_KIND_MODULES``, ``kv_b`` (kept in the model dtype
    by every quantization), ``kept`` (embedding and norms), ``fp32`` (router weights/biases).
    A tied lm_head counts 0 here (it is the embedding). DSA indexers count in ``attention``
    (wq_b, wk), ``kept`` (k_norm) and ``fp32`` (weights_proj)."""
    d, h = cfg.hidden_size, cfg.num_attention_heads
    if cfg.q_lora_rank is None:
        q = d * h * cfg.qk_head_dim
    else:
        q = d * cfg.q_lora_rank + cfg.q_lora_rank * h * cfg.qk_head_dim
    layers = cfg.num_hidden_layers
    blocks = cfg.num_mla_blocks  # LongCat-Flash: two per layer
    n_moe = sum(cfg.is_moe_layer(i) for i in range(layers))
    # dense MLPs: one per dense layer; LongCat-Flash: one per MLA block besides its MoE
    n_dense = blocks if cfg.shortcut_moe else layers - n_moe
    per_expert = 3 * d * cfg.moe_intermediate_size
    norms = blocks * (2 * d + cfg.kv_lora_rank + (cfg.q_lora_rank or 0)) + d
    choices = cfg.num_router_choices
    # DSA indexers: wq_b [Hi*Di, Lq] and wk [Di, D] (linears), k_norm (weight and bias), and
    # weights_proj [Hi, D] kept in float32
    indexers = sum(cfg.runs_indexer(i) for i in range(layers))
    hi, di = cfg.index_n_heads, cfg.index_head_dim
    indexer = indexers * ((cfg.q_lora_rank or 0) * hi * di + d * di)
    return {
        "attention": blocks * (q + d * cfg.latent_width + h * cfg.v_head_dim * d) + indexer,
        "kv_b": blocks * cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim),
        "dense_mlp": n_dense * 3 * d * cfg.intermediate_size,
        "shared_experts": n_moe * per_expert * cfg.n_shared_experts,
        "routed_experts": n_moe * per_expert * cfg.n_routed_experts,
        "lm_head": 0 if cfg.tie_word_embeddings else cfg.vocab_size * d,
        "kept": cfg.vocab_size * d + norms + indexers * 2 * di,
        "fp32": n_moe * (choices * d + choices) + indexers * hi * d,
    }


def _stored_bytes_per_weight(stored: object, kind: str) -> float | None:
    """Bytes per weight of a linear kind as a stored format keeps it (None: not stored
    quantized). FP8 (DeepSeek's): every linear but lm_head, one byte plus a float32 scale
    per block; int4 (compressed-tensors): what its ``ignore`` list does not name, repacked."""
    from mlafx.config.stored_quantization import BlockFp8, PackedInt4

    if isinstance(stored, BlockFp8):
        bn, bk = stored.block
        return None if kind == "lm_head" else 1 + 4 / (bn * bk)
    if isinstance(stored, PackedInt4):
        return None if stored.ignores(_KIND_MODULES[kind]) else QUANTIZED_BYTES_PER_WEIGHT["int4"]
    return None


def weight_bytes(
    cfg: ModelConfig, dtype: str, quantization: str | None = None, stored: object = None
) -> int:
    """The weights' bytes once loaded: a checkpoint's ``stored`` quantized format
    (``config/stored_quantization.py``) as stored, ``quantization`` ("int8" / "int4", every
    other linear but ``kv_b_proj``; a tied lm_head gets its own copy), the rest in ``dtype``.
    A GGUF file (``GgufFile``): its tensors as ``gguf_resident_bytes`` counts them."""
    from mlafx.config.gguf_file import GgufFile

    if isinstance(stored, GgufFile):
        from mlafx.config.gguf_config import gguf_resident_bytes

        return gguf_resident_bytes(stored, size_of=dtype_bytes(dtype))
    kinds = parameter_kinds(cfg)
    size = dtype_bytes(dtype)
    total = (kinds["kept"] + kinds["kv_b"]) * size + kinds["fp32"] * 4.0
    for kind in _KIND_MODULES:
        count = kinds[kind]
        if kind == "lm_head" and quantization is not None and cfg.tie_word_embeddings:
            count = cfg.vocab_size * cfg.hidden_size
        per = _stored_bytes_per_weight(stored, kind)
        if per is None:
            per = size if quantization is None else QUANTIZED_BYTES_PER_WEIGHT[quantization]
        total += count * per
    return int(total)


def kv_bytes_per_token(cfg: ModelConfig, dtype: str) -> int:
    """One row of every cache (``ModelConfig.cache_widths``): a latent row (Lkv + R) per MLA
    block (LongCat-Flash: two per layer), and a DSA indexer's key row."""
    return sum(cfg.cache_widths) * dtype_bytes(dtype)


def kv_bytes_per_block(cfg: ServedConfig, dtype: str, block_size: int) -> int:
    """One block of every cache (``cache_block_shapes``): ``block_size`` times
    ``kv_bytes_per_token`` for an MLA model; DeepSeek-V4's pool caches hold fewer rows."""
    rows = sum(r * w for r, w in cfg.cache_block_shapes(block_size))
    return rows * dtype_bytes(dtype)


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (falls back to total physical memory)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_need_fits(need: int, needs: str, hint: str = "") -> None:
    """Raise ``ConfigError("<needs>, but only X GiB is available<hint>")`` if ``need`` bytes
    exceed 90% of the memory available now."""
    have = available_memory_bytes()
    if need > 0.9 * have:
        raise ConfigError(f"{needs}, but only {have / 2**30:.1f} GiB is available{hint}")


def check_fits_in_memory(
    cfg: ModelConfig,
    dtype: str,
    min_kv_tokens: int,
    quantization: str | None = None,
    stored: object = None,
) -> int:
    """Raise a ConfigError with an estimate if weights plus the smallest useful KV cache
    (``min_kv_tokens`` latent rows) exceed 90% of the memory available now (``weight_bytes``).
    Returns the estimate in bytes."""
    weights = weight_bytes(cfg, dtype, quantization, stored)
    need = weights + kv_bytes_per_token(cfg, dtype) * min_kv_tokens
    what = dtype if quantization is None else f"{quantization}-quantized"
    if stored is not None:
        what = f"{type(stored).__name__} ({what} elsewhere)"
    check_need_fits(
        need,
        f"model needs about {need / 2**30:.1f} GiB ({weights / 2**30:.1f} GiB "
        f"of {what} weights for {cfg.num_hidden_layers} layers plus the KV cache for "
        f"{min_kv_tokens} tokens)",
        "; use fewer layers/experts (hf_overrides), a smaller dtype or quantization='int8'/'int4'",
    )
    return need
