"""What the stored-format tests share: a tiny DeepSeek-V3 config (every feature on: q LoRA,
shared experts, grouped routing with a correction bias, a dense first layer) and one
generation run that exercises chunked prefill and prefix-cache hits."""

from __future__ import annotations

from pathlib import Path

import torch

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


def generate(directory: Path, compiled: bool) -> list[mlafx.RequestOutput]:
    llm = mlafx.LLM(
        str(directory),
        dtype="float32",
        block_size=4,
        num_kv_blocks=96,
        max_num_batched_tokens=16,  # the 41- and 32-token prompts arrive in chunks
        progress=False,
        compile=compiled,
    )
    params = mlafx.SamplingParams(max_tokens=NEW_TOKENS, logprobs=2, ignore_eos=True)
    # the last prompt shares 28 tokens (7 blocks) with the third: prefix-cache hits
    first = llm.generate(PROMPTS[:3], params)
    return first + llm.generate(PROMPTS[3:], params)


def logprobs_of(output: mlafx.RequestOutput) -> list[float]:
    got = output.outputs[0]
    return [top[t] for t, top in zip(got.token_ids, got.logprobs, strict=True)]


def top_rows(output: mlafx.RequestOutput, vocab: int) -> torch.Tensor:
    """The output's returned top log-probabilities as [N, vocab] rows (-inf elsewhere)."""
    rows = torch.full((NEW_TOKENS, vocab), float("-inf"))
    for i, top in enumerate(output.outputs[0].logprobs):
        rows[i, list(top)] = torch.tensor(list(top.values()))
    return rows
