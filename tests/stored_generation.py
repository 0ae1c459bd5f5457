"""What the stored-format tests share: a tiny DeepSeek-V3 config (every feature on: q LoRA,
shared experts, grouped routing with a correction bias, a dense first layer), the writing of
a checkpoint in a stored format beside its dequantized twin, and one generation run that
exercises chunked prefill and prefix-cache hits."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import load_file, save_file

import mlafx

TINY_V3 = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    q_lora_rank=24,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=3,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    first_k_dense_replace=1,
    max_position_embeddings=256,
    initializer_range=0.2,
    bos_token_id=None,
    eos_token_id=None,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], list(range(20, 61)), list(range(20, 50)) + [9, 9]]
NEW_TOKENS = 12


def generate(directory: Path, compiled: bool, **options: Any) -> list[mlafx.RequestOutput]:
    """``PROMPTS`` served by the checkpoint in ``directory`` (``options``: more ``LLM``
    options, e.g. ``tensor_parallel_size``)."""
    llm = mlafx.LLM(
        str(directory),
        dtype="float32",
        block_size=4,
        num_kv_blocks=96,
        max_num_batched_tokens=16,  # the 41- and 32-token prompts arrive in chunks
        progress=False,
        compile=compiled,
        **options,
    )
    params = mlafx.SamplingParams(max_tokens=NEW_TOKENS, logprobs=2, ignore_eos=True)
    try:
        # the last prompt shares 28 tokens (7 blocks) with the third: prefix-cache hits
        first = llm.generate(PROMPTS[:3], params)
        return first + llm.generate(PROMPTS[3:], params)
    finally:
        llm.close()


def logprobs_of(output: mlafx.RequestOutput) -> list[float]:
    got = output.outputs[0]
    return [top[t] for t, top in zip(got.token_ids, got.logprobs, strict=True)]


def top_rows(output: mlafx.RequestOutput, vocab: int) -> torch.Tensor:
    """The output's returned top log-probabilities as [N, vocab] rows (-inf elsewhere)."""
    rows = torch.full((NEW_TOKENS, vocab), float("-inf"))
    for i, top in enumerate(output.outputs[0].logprobs):
        rows[i, list(top)] = torch.tensor(list(top.values()))
    return rows


Tensors = dict[str, torch.Tensor]


def write_stored_checkpoint(
    directory: Path,
    overrides: dict[str, Any],
    seed: int,
    quantize: Callable[[Tensors, Tensors], None],
    quantization_config: dict[str, Any],
    reference_dtype: torch.dtype | None = None,
) -> torch.nn.Module:
    """transformers' tiny DeepSeek-V3 (``TINY_V3`` with ``overrides``, seeded, a random
    correction bias) saved twice: in ``directory`` with ``quantize(tensors, dequantized)``
    rewriting its tensors into the stored format (and ``dequantized`` into what they mean) and
    ``quantization_config`` in its config, and in ``directory / "dequantized"``. Returns
    transformers' model over the dequantized weights."""
    torch.manual_seed(seed)
    model = transformers.DeepseekV3ForCausalLM(
        transformers.DeepseekV3Config(**{**TINY_V3, **overrides})
    ).eval()
    with torch.no_grad():
        for module_name, buffer in model.named_buffers():
            if module_name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.3, 0.3)
    dequantized_dir = directory / "dequantized"
    model.save_pretrained(directory)
    model.save_pretrained(dequantized_dir)
    tensors = load_file(directory / "model.safetensors")
    dequantized = load_file(dequantized_dir / "model.safetensors")
    quantize(tensors, dequantized)
    for where, contents in ((directory, tensors), (dequantized_dir, dequantized)):
        (where / "model.safetensors").unlink()  # a new inode: the loaded tensors may map the old
        save_file(contents, str(where / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (directory / "config.json").write_text(json.dumps(config))
    kwargs = {} if reference_dtype is None else {"dtype": reference_dtype}
    return transformers.DeepseekV3ForCausalLM.from_pretrained(dequantized_dir, **kwargs).eval()
