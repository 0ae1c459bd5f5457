"""Tiny model settings shared by the engine tests (dummy weights, or a checkpoint of them)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

import mlafx
from mlafx.config import PRESETS, ModelConfig
from mlafx.models.loader import build_model

# The DeepSeek-V2-Lite preset shrunk to a few MB; eos 1 is inside the small vocabulary.
TINY_OVERRIDES = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def tiny_llm(**kwargs) -> mlafx.LLM:
    """The tiny engine; the reference path unless a test asks for ``compile=True`` (runtime
    logic is path-independent, and each compiled configuration costs ~20 s cold)."""
    options = dict(
        compile=False,
        load_format="dummy",
        hf_overrides=TINY_OVERRIDES,
        dtype="float32",
        num_kv_blocks=128,
        block_size=4,
        progress=False,
    )
    options.update(kwargs)
    return mlafx.LLM("deepseek-v2-lite", **options)


# One word per token id of the tiny vocabulary: ids 0/1 are bos/eos, "w<i>" is id i + 2.
WORDS = ["<bos>", "<eos>"] + [f"w{i}" for i in range(254)]


def write_tiny_checkpoint_with_tokenizer(directory: Path) -> Path:
    """A tiny transformers DeepSeek-V2 checkpoint (``save_pretrained``, seeded) plus a
    word-level ``tokenizer.json`` over :data:`WORDS`, for text-prompt tests."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    torch.manual_seed(0)
    config = transformers.DeepseekV2Config(
        **{k: v for k, v in TINY_OVERRIDES.items() if k != "first_k_dense_replace"},
        q_lora_rank=None,
        first_k_dense_replace=1,
        max_position_embeddings=128,
    )
    transformers.DeepseekV2ForCausalLM(config).save_pretrained(directory)
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<bos>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


def write_tiny_checkpoint(
    directory: Path, dtype: str, *, seed: int = 0, **overrides: object
) -> ModelConfig:
    """The tiny preset's dummy weights (``seed``) as a fused checkpoint with its config.json."""
    hf = {**PRESETS["deepseek-v2-lite"], **TINY_OVERRIDES, **overrides}
    cfg = ModelConfig.from_hf_dict(hf)
    model = build_model(cfg, dtype, "dummy", seed=seed)
    directory.mkdir(exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    stored: set[int] = set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in stored:  # a tied lm_head is stored once
            stored.add(tensor.data_ptr())
            tensors[name] = tensor
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(hf))
    return cfg


# A DeepSeek-V2-Chat-shaped template over words of the tiny vocabulary: "w10"/"w11"/"w12"
# mark user/assistant/system turns.
CHAT_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}"
    "{% endif %}{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ 'w10 ' + message['content'] + ' ' }}"
    "{% elif message['role'] == 'assistant' %}{{ 'w11 ' + message['content'] + eos_token + ' ' }}"
    "{% elif message['role'] == 'system' %}{{ 'w12 ' + message['content'] + ' ' }}"
    "{% else %}{{ raise_exception('unknown role: ' + message['role']) }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'w11' }}{% endif %}"
)


def write_tiny_chat_checkpoint(directory: Path) -> Path:
    """``write_tiny_checkpoint_with_tokenizer`` plus a ``tokenizer_config.json`` holding
    :data:`CHAT_TEMPLATE` and the special tokens (bos/eos special in the tokenizer too)."""
    from tokenizers import Tokenizer

    write_tiny_checkpoint_with_tokenizer(directory)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.add_special_tokens(["<bos>", "<eos>"])
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": {"__type": "AddedToken", "content": "<bos>", "special": True},
                "eos_token": "<eos>",
                "chat_template": CHAT_TEMPLATE,
            }
        )
    )
    return directory
