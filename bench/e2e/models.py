"""The benchmarked models: one set of dummy weights shared by every engine.

mlafx's compiled engine is built as ``mlafx run`` builds it (``load_format="dummy"``,
seeded); a transformers ``DeepseekV2ForCausalLM`` of the same config receives a copy of its
weights, and mlafx's reference engine is built from that transformers object with
``LLM.from_transformers`` (its tensors adopted, not copied), so all four engines compute
with identical weights (each router in its engine's own precision: mlafx scores in fp32).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from bench.e2e.fp8_checkpoint import write_in_subprocess
from mlafx.config import EMBEDDED_DEFAULT_MODEL, EMBEDDED_DEFAULT_OVERRIDES
from mlafx.config.presets import DEEPSEEK_V2_LITE
from mlafx.models.deepseek import MLAForCausalLM
from mlafx.runtime import LLM

# name -> hf_overrides over the deepseek-v2-lite preset
MODELS: dict[str, dict[str, Any]] = {
    # `mlafx run`'s demo: 2 layers, 4 experts, top-2, hidden 2048, vocab 102400
    "embedded": EMBEDDED_DEFAULT_OVERRIDES,
    # every width of DeepSeek-V2-Lite (64 experts, top-6, 2 shared), one MoE layer
    "full-width-1layer": {"num_hidden_layers": 1, "first_k_dense_replace": 0},
    # all of DeepSeek-V2-Lite (27 layers, 64 experts): with --quantization only (29 GiB in bf16)
    "full": {},
    # a tiny model for --quick (a few MB): tests/tiny_models.py's widths, every layer MoE
    "tiny": {
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
        "first_k_dense_replace": 0,
        "bos_token_id": 0,
        "eos_token_id": 1,
    },
}


def mlafx_llm(
    name: str,
    *,
    num_kv_blocks: int,
    block_size: int,
    dtype: str = "bfloat16",
    quantization: str | None = None,
) -> LLM:
    """mlafx's compiled engine on ``MODELS[name]`` with seeded dummy weights."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(MODELS)}")
    return LLM(
        EMBEDDED_DEFAULT_MODEL,
        load_format="dummy",
        hf_overrides=MODELS[name],
        dtype=dtype,
        quantization=quantization,
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        progress=False,
        compile=True,
    )


# where a bench writes (and reuses) a model's FP8 checkpoint unless told (--checkpoint-dir)
FP8_CHECKPOINTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def fp8_checkpoint(name: str, directory: Path | None = None) -> Path:
    """``MODELS[name]``'s dummy weights as a DeepSeek block-FP8 checkpoint in ``directory``
    (default ``bench/results/fp8-<name>``), written once by a child process and reused after;
    returns the directory."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; choose from {sorted(MODELS)}")
    directory = directory or FP8_CHECKPOINTS / f"fp8-{name}"
    return write_in_subprocess(EMBEDDED_DEFAULT_MODEL, MODELS[name], directory)


def mlafx_fp8_llm(directory: Path, *, num_kv_blocks: int, block_size: int) -> LLM:
    """mlafx's compiled engine on the FP8 checkpoint in ``directory``, served from its bytes
    with bf16 activations."""
    return LLM(str(directory), dtype="bfloat16", block_size=block_size,
               num_kv_blocks=num_kv_blocks, progress=False, compile=True)  # fmt: skip


def transformers_twin(model: MLAForCausalLM, name: str) -> torch.nn.Module:
    """transformers' ``DeepseekV2ForCausalLM`` of ``MODELS[name]`` (``model``'s config)
    holding a copy of ``model``'s weights, in the dtype of its lm_head."""
    import transformers

    raw = {**DEEPSEEK_V2_LITE, **MODELS[name]}
    hf_config = transformers.DeepseekV2Config.from_dict(raw)
    with torch.device("meta"):
        hf_model = transformers.DeepseekV2ForCausalLM(hf_config)
    hf_model = hf_model.to(model.lm_head.weight.dtype).to_empty(device="cpu")
    # to_empty leaves non-persistent buffers (RoPE's inv_freq) uninitialised: rebuild them
    hf_model.model.rotary_emb = type(hf_model.model.rotary_emb)(config=hf_config)
    missing, unexpected = hf_model.load_state_dict(model.state_dict(), strict=False)
    if missing or unexpected:
        raise RuntimeError(
            f"mlafx's weights do not fit transformers' {type(hf_model).__name__}: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    # Parameters keep requires_grad=True, as from_pretrained leaves them (timed calls run
    # under inference_mode): with it False, torch.matmul stops folding the lm_head's
    # non-contiguous last-position rows ([B, 1, h] of [B, L, h]) into one mm and instead
    # expands the weight to [B, h, vocab] for a bmm (a multi-GB copy per call).
    return hf_model.eval()
