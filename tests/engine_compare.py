"""Greedy generations of the same prompts under two serving set-ups, compared tie-aware.

The reference serves each prompt alone, unchunked and without prefix caching, and keeps
the full log-softmax of every step; ``assert_same_greedy`` then checks another run's
tokens against it with ``compare_greedy`` (a divergence is allowed only at a near-tie).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

import mlafx
from tests.greedy_compare import compare_greedy
from tests.tiny_models import tiny_llm


@dataclass(frozen=True)
class Reference:
    tokens: list[int]
    logprobs: torch.Tensor  # [N, vocab] float32


def random_prompts(count: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(2, 256) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)
    ]


def greedy_params(max_tokens: int, logprobs: int = 1) -> mlafx.SamplingParams:
    return mlafx.SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)


def reference_alone(
    prompts: list[list[int]], max_tokens: int, block_size: int = 16, **llm_options: object
) -> list[Reference]:
    """Each prompt served alone (whole prompt in one step, no prefix cache), fp32, by the
    reference model (``llm_options``: more ``tiny_llm`` options, e.g. a quantization)."""
    llm = tiny_llm(
        block_size=block_size,
        num_kv_blocks=(max(map(len, prompts)) + max_tokens) // block_size + 2,
        enable_prefix_caching=False,
        enable_chunked_prefill=False,
        **llm_options,
    )
    vocab = llm.config.vocab_size
    refs = []
    for prompt in prompts:
        (out,) = llm.generate([prompt], greedy_params(max_tokens, logprobs=vocab))
        rows = torch.full((max_tokens, vocab), float("-inf"))
        for i, top in enumerate(out.outputs[0].logprobs):
            rows[i, list(top)] = torch.tensor(list(top.values()))
        refs.append(Reference(out.outputs[0].token_ids, rows))
    return refs


def assert_same_greedy(
    refs: list[Reference], outputs: list[mlafx.RequestOutput], label: str, tol: float = 1e-4
) -> int:
    """Every output matches its reference up to a near-tie (log-probabilities and ties
    within ``tol``); returns positions compared."""
    assert len(refs) == len(outputs)
    compared = 0
    for i, (ref, out) in enumerate(zip(refs, outputs, strict=True)):
        got = out.outputs[0]
        assert got.finish_reason == "length", f"{label} #{i}: {got.finish_reason}"
        got_logprobs = [top[t] for t, top in zip(got.token_ids, got.logprobs, strict=True)]
        compared += compare_greedy(
            ref.tokens, ref.logprobs, got.token_ids, got_logprobs,
            logprob_tol=tol, tie_tol=tol, label=f"{label} #{i}",
        ).compared  # fmt: skip
    # near-ties may cut comparisons short, but most positions must have been compared
    assert compared >= sum(len(r.tokens) for r in refs) * 3 // 4, f"{label}: only {compared}"
    return compared
