"""A GGUF file's model metadata as a Hugging Face config dict, for ``ModelConfig``'s validation.

llama.cpp writes DeepSeek-V2/V2-Lite/V3/R1, Kimi K2 and GLM-4.7-Flash under one architecture,
``deepseek2`` (``convert_hf_to_gguf.py``'s ``DeepseekV2Model``), with the keys of ``_KEYS``
(``{arch}.`` omitted). How they map:

- ``attention.key_length_mla`` / ``value_length_mla`` are P + R and V (the split ``attn_k_b``
  / ``attn_v_b`` layout, whose ``head_count_kv`` is 1 and ``key_length`` Lkv + R); files without
  them (the single ``attn_kv_b``) give P + R and V in ``key_length`` / ``value_length``.
- ``attention.q_lora_rank`` 0 or absent: no q LoRA.
- ``expert_gating_func`` 1 softmax, 2 sigmoid; absent: softmax (llama.cpp's default). The
  router's ``topk_method`` follows from the tensors: a correction bias (``exp_probs_b``) means
  ``noaux_tc``; else grouped (``expert_group_count`` > 1) or plain greedy.
- ``expert_weights_norm`` (written only when true) is ``norm_topk_prob``; ``expert_weights_scale``
  ``routed_scaling_factor``; ``leading_dense_block_count`` ``first_k_dense_replace``.
- YaRN: ``rope.scaling.yarn_log_multiplier`` is ``0.1 * mscale_all_dim``; llama.cpp leaves the
  cos/sin unscaled, i.e. ``mscale == mscale_all_dim`` (so ``mscale`` is set to it).
- RoPE is llama.cpp's NORM type (adjacent pairs): ``rope_interleave`` true, the weights as
  transformers holds them (the converter permutes nothing).
- The embedding is tied when the file has no ``output.weight``.
- eos: ``tokenizer.ggml.eos_token_id`` plus the end-of-turn ids (``eot``, ``eom``) llama.cpp
  also stops on.

Any other ``{arch}.`` key is a ``ConfigError`` naming it (it may change the math); other
namespaces (``general.``, ``tokenizer.``, ``split.``, ``quantize.``) carry no model maths.
"""

from __future__ import annotations

from typing import Any

from mlafx.config.gguf_file import GgufFile
from mlafx.config.model_config import ConfigError

ARCHITECTURES = ("deepseek2",)
_KEYS = {
    "block_count",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "vocab_size",
    "leading_dense_block_count",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.key_length",
    "attention.value_length",
    "attention.key_length_mla",
    "attention.value_length_mla",
    "attention.q_lora_rank",
    "attention.kv_lora_rank",
    "attention.layer_norm_rms_epsilon",
    "rope.dimension_count",
    "rope.freq_base",
    "rope.scaling.type",
    "rope.scaling.factor",
    "rope.scaling.original_context_length",
    "rope.scaling.yarn_log_multiplier",
    "rope.scaling.yarn_beta_fast",
    "rope.scaling.yarn_beta_slow",
    "rope.scaling.finetuned",
    "expert_count",
    "expert_used_count",
    "expert_shared_count",
    "expert_feed_forward_length",
    "expert_weights_scale",
    "expert_weights_norm",
    "expert_gating_func",
    "expert_group_count",
    "expert_group_used_count",
    "nextn_predict_layers",  # multi-token-prediction layers: never run
}
_GATING = {1: "softmax", 2: "sigmoid"}
_IGNORED_NAMESPACES = ("GGUF.", "general.", "tokenizer.", "split.", "quantize.")


def _get(meta: dict[str, Any], arch: str, key: str, default: Any = None) -> Any:
    return meta.get(f"{arch}.{key}", default)


def _need(meta: dict[str, Any], arch: str, key: str) -> Any:
    value = meta.get(f"{arch}.{key}")
    if value is None:
        raise ConfigError(f"GGUF metadata {arch}.{key!s} is missing")
    return value


def check_known_keys(gguf: GgufFile) -> None:
    arch = gguf.architecture
    for key in gguf.metadata:
        if key.startswith(_IGNORED_NAMESPACES):
            continue
        if not key.startswith(f"{arch}.") or key.removeprefix(f"{arch}.") not in _KEYS:
            raise ConfigError(f"GGUF metadata {key!r} is not supported by mlafx ({arch})")


def _rope(meta: dict[str, Any], arch: str) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_theta": float(_get(meta, arch, "rope.freq_base", 10000.0))}
    kind = _get(meta, arch, "rope.scaling.type", "none")
    if kind in ("none", None):
        return {**params, "rope_type": "default"}
    if kind != "yarn":
        raise ConfigError(
            f"GGUF metadata {arch}.rope.scaling.type={kind!r} is not supported (yarn)"
        )
    log_mul = _get(meta, arch, "rope.scaling.yarn_log_multiplier")
    mscale = None if log_mul is None else float(log_mul) / 0.1
    params.update(
        rope_type="yarn",
        factor=float(_need(meta, arch, "rope.scaling.factor")),
        original_max_position_embeddings=int(
            _need(meta, arch, "rope.scaling.original_context_length")
        ),
        mscale=mscale,
        mscale_all_dim=mscale,
    )
    for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        if _get(meta, arch, f"rope.scaling.{key}") is not None:
            params[name] = float(_get(meta, arch, f"rope.scaling.{key}"))
    return params


def gguf_config_dict(gguf: GgufFile) -> dict[str, Any]:
    """The HF-style config dict of a GGUF model (``ModelConfig.from_hf_dict`` validates it)."""
    arch = gguf.architecture
    if arch not in ARCHITECTURES:
        raise ConfigError(
            f"GGUF metadata general.architecture={arch!r} is not an MLA architecture mlafx "
            f"serves (supported: {', '.join(ARCHITECTURES)})"
        )
    check_known_keys(gguf)
    meta = gguf.metadata
    heads = int(_need(meta, arch, "attention.head_count"))
    rope_dim = int(_need(meta, arch, "rope.dimension_count"))
    kv_lora = int(_need(meta, arch, "attention.kv_lora_rank"))
    if _get(meta, arch, "attention.key_length_mla") is not None:
        qk_head = int(_need(meta, arch, "attention.key_length_mla"))
        v_head = int(_need(meta, arch, "attention.value_length_mla"))
    else:
        qk_head = int(_need(meta, arch, "attention.key_length"))
        v_head = int(_need(meta, arch, "attention.value_length"))
    if qk_head <= rope_dim:
        raise ConfigError(
            f"GGUF metadata: the key length {qk_head} must exceed rope.dimension_count {rope_dim}"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = _get(meta, arch, "vocab_size")
    if vocab is None:
        vocab = len(tokens) if isinstance(tokens, list) else None
    if vocab is None and "token_embd.weight" in gguf.tensors:
        vocab = gguf.tensors["token_embd.weight"].shape[0]
    q_lora = _get(meta, arch, "attention.q_lora_rank") or None
    experts = int(_get(meta, arch, "expert_count", 0) or 0)
    gating = int(_get(meta, arch, "expert_gating_func", 1) or 1)
    if gating not in _GATING:
        raise ConfigError(f"GGUF metadata {arch}.expert_gating_func={gating} is not 1 or 2")
    groups = int(_get(meta, arch, "expert_group_count", 1) or 1)
    biased = any(n.endswith(".exp_probs_b.bias") for n in gguf.tensors)
    method = "noaux_tc" if biased else ("group_limited_greedy" if groups > 1 else "greedy")
    scoring = _GATING[gating]
    eos = list(
        dict.fromkeys(
            int(meta[f"tokenizer.ggml.{k}_token_id"])
            for k in ("eos", "eot", "eom")
            if meta.get(f"tokenizer.ggml.{k}_token_id") is not None
        )
    )
    return {
        "model_type": "deepseek_v3" if scoring == "sigmoid" else "deepseek_v2",
        "vocab_size": vocab,
        "hidden_size": _need(meta, arch, "embedding_length"),
        "intermediate_size": _need(meta, arch, "feed_forward_length"),
        "num_hidden_layers": _need(meta, arch, "block_count"),
        "num_attention_heads": heads,
        "q_lora_rank": int(q_lora) if q_lora else None,
        "kv_lora_rank": kv_lora,
        "qk_nope_head_dim": qk_head - rope_dim,
        "qk_rope_head_dim": rope_dim,
        "v_head_dim": v_head,
        "max_position_embeddings": _need(meta, arch, "context_length"),
        "rms_norm_eps": float(_get(meta, arch, "attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_parameters": _rope(meta, arch),
        "rope_interleave": True,
        "n_routed_experts": experts,
        "num_experts_per_tok": _get(meta, arch, "expert_used_count"),
        "n_shared_experts": _get(meta, arch, "expert_shared_count", 0),
        "moe_intermediate_size": _get(meta, arch, "expert_feed_forward_length"),
        "first_k_dense_replace": _get(meta, arch, "leading_dense_block_count", 0),
        "norm_topk_prob": bool(_get(meta, arch, "expert_weights_norm", False)),
        "routed_scaling_factor": float(_get(meta, arch, "expert_weights_scale", 1.0) or 1.0),
        "scoring_func": scoring,
        "topk_method": method,
        "n_group": groups,
        "topk_group": int(_get(meta, arch, "expert_group_used_count", groups) or groups),
        "tie_word_embeddings": "output.weight" not in gguf.tensors,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos or None,
    }


# GGUF types mlafx runs from their own bytes -> bytes per weight once repacked into their
# smallest format (kernels/ggml_repack.py, which config/ may not import; a test holds the two
# equal): int8 544 / int4 288 bytes per 16 x 32 weights, k4 2496 / k8 4544 per 16 x 256
REPACKED_BYTES_PER_WEIGHT = {
    "Q8_0": 544 / 512,
    "Q4_0": 288 / 512,
    "Q5_0": 544 / 512,
    "Q4_K": 2496 / 4096,
    "Q5_K": 4544 / 4096,
    "Q6_K": 4544 / 4096,
}
_FP32_TENSORS = (".ffn_gate_inp.weight", ".exp_probs_b.bias")  # the router stays float32
_MODEL_DTYPE_TENSORS = ("token_embd.", "_norm.", ".attn_kv_b.", ".attn_k_b.", ".attn_v_b.")


def gguf_resident_bytes(gguf: GgufFile, size_of: int) -> int:
    """The weights' bytes once a GGUF model is loaded in a dtype of ``size_of`` bytes: linears
    and experts of the types in ``REPACKED_BYTES_PER_WEIGHT`` repacked, the router in float32,
    every other tensor in the model dtype (``models/gguf_checkpoint.py``)."""
    total = 0.0
    for tensor in gguf.tensors.values():
        per: float = size_of
        if tensor.name.endswith(_FP32_TENSORS):
            per = 4
        elif not any(part in tensor.name for part in _MODEL_DTYPE_TENSORS):
            per = REPACKED_BYTES_PER_WEIGHT.get(tensor.type_name, size_of)
        total += tensor.numel * per
    return int(total)
