"""Built-in model presets, as Hugging Face ``config.json`` dicts.

``deepseek-v2-lite`` is the real DeepSeek-V2-Lite configuration (15.7B parameters, ~31 GB
in bf16: too big for this machine whole). ``EMBEDDED_DEFAULT_OVERRIDES`` shrinks it to the
demo model that ``mlafx run`` serves with dummy weights.
"""

from __future__ import annotations

from typing import Any

DEEPSEEK_V2_LITE: dict[str, Any] = {
    "model_type": "deepseek_v2",
    "architectures": ["DeepseekV2ForCausalLM"],
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "n_shared_experts": 2,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "topk_method": "greedy",
    "scoring_func": "softmax",
    "n_group": 1,
    "topk_group": 1,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "max_position_embeddings": 163840,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
    "attention_bias": False,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "tie_word_embeddings": False,
}

PRESETS: dict[str, dict[str, Any]] = {"deepseek-v2-lite": DEEPSEEK_V2_LITE}

# What `mlafx run` serves when given no model: DeepSeek-V2-Lite shrunk to fit anywhere.
EMBEDDED_DEFAULT_MODEL = "deepseek-v2-lite"
EMBEDDED_DEFAULT_OVERRIDES: dict[str, Any] = {
    "num_hidden_layers": 2,
    "n_routed_experts": 4,
    "first_k_dense_replace": 0,
    "num_experts_per_tok": 2,
}
