"""Up-front memory estimate: refuse a model that cannot fit before allocating anything."""

from __future__ import annotations

import os

from mlafx.config.model_config import ConfigError, ModelConfig

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


def parameter_counts(cfg: ModelConfig, quantization: str | None = None) -> tuple[int, int, int]:
    """(parameters stored in the model dtype, kept in fp32 (router weights/biases), stored
    quantized). With ``quantization`` every linear but ``kv_b_proj`` and the routed experts are
    quantized (``models/quantized.py``); the embedding, norms and ``kv_b_proj`` are not."""
    d, h = cfg.hidden_size, cfg.num_attention_heads
    if cfg.q_lora_rank is None:
        q = d * h * cfg.qk_head_dim
    else:
        q = d * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * h * cfg.qk_head_dim
    attn = (
        q
        + d * cfg.latent_width
        + cfg.kv_lora_rank
        + cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        + h * cfg.v_head_dim * d
    )
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    n_dense = cfg.num_hidden_layers - n_moe
    experts = 3 * d * cfg.moe_intermediate_size * (cfg.n_routed_experts + cfg.n_shared_experts)
    model_dtype = (
        cfg.num_hidden_layers * (attn + 2 * d)
        + n_dense * 3 * d * cfg.intermediate_size
        + n_moe * experts
        + cfg.vocab_size * d * (1 if cfg.tie_word_embeddings else 2)
        + d
    )
    fp32 = n_moe * (cfg.n_routed_experts * d + cfg.n_routed_experts)
    if quantization is None:
        return model_dtype, fp32, 0
    kv_b = cfg.kv_lora_rank * h * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    norms = cfg.num_hidden_layers * (2 * d + cfg.kv_lora_rank + (cfg.q_lora_rank or 0)) + d
    kept = cfg.num_hidden_layers * kv_b + norms + cfg.vocab_size * d  # + the embedding
    # a tied lm_head gets its own quantized copy
    quantized = model_dtype - kept + (cfg.vocab_size * d if cfg.tie_word_embeddings else 0)
    return kept, fp32, quantized


def weight_bytes(cfg: ModelConfig, dtype: str, quantization: str | None = None) -> int:
    model_dtype, fp32, quantized = parameter_counts(cfg, quantization)
    per_quantized = 0.0 if quantization is None else QUANTIZED_BYTES_PER_WEIGHT[quantization]
    return model_dtype * dtype_bytes(dtype) + fp32 * 4 + int(quantized * per_quantized)


def kv_bytes_per_token(cfg: ModelConfig, dtype: str) -> int:
    """One latent row (Lkv + R) per layer."""
    return cfg.num_hidden_layers * cfg.latent_width * dtype_bytes(dtype)


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


def check_fits_in_memory(
    cfg: ModelConfig, dtype: str, min_kv_tokens: int, quantization: str | None = None
) -> int:
    """Raise a ConfigError with an estimate if weights plus the smallest useful KV cache
    (``min_kv_tokens`` latent rows) exceed 90% of the memory available now. Returns the
    estimate in bytes."""
    weights = weight_bytes(cfg, dtype, quantization)
    need = weights + kv_bytes_per_token(cfg, dtype) * min_kv_tokens
    have = available_memory_bytes()
    if need > 0.9 * have:
        what = dtype if quantization is None else f"{quantization}-quantized"
        raise ConfigError(
            f"model needs about {need / 2**30:.1f} GiB ({weights / 2**30:.1f} GiB "
            f"of {what} weights for {cfg.num_hidden_layers} layers plus the KV cache for "
            f"{min_kv_tokens} tokens), but only {have / 2**30:.1f} GiB is available; use fewer "
            "layers/experts (hf_overrides), a smaller dtype or quantization='int8'/'int4'"
        )
    return need
