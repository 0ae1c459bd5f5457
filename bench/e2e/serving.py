"""Serving figures through mlafx's engine (scheduler, cache, sampler included): time to
first token and time per output token under a mixed workload of concurrent requests, and
the time to first token of a prompt that hits the prefix cache against the same prompt cold.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from bench.e2e.backends import token_ids
from mlafx.runtime import LLM, SamplingParams


@dataclass(frozen=True)
class MixedWorkload:
    """``num_requests`` requests with prompt lengths cycling through ``prompt_lens``, each
    generating ``max_tokens`` tokens; one new request arrives every ``arrival_steps`` engine
    steps, so prompt chunks and decodes share steps."""

    num_requests: int
    prompt_lens: tuple[int, ...]
    max_tokens: int
    arrival_steps: int = 1

    def blocks_needed(self, block_size: int) -> int:
        longest = max(self.prompt_lens) + self.max_tokens
        return 1 + self.num_requests * -(-longest // block_size)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run_mixed_workload(llm: LLM, workload: MixedWorkload, salt: int = 1000) -> dict[str, float]:
    """Serve the workload to completion; TTFT/TPOT medians and p90s in milliseconds."""
    vocab = llm.config.vocab_size
    params = SamplingParams(max_tokens=workload.max_tokens, ignore_eos=True)
    prompts = [
        token_ids(1, workload.prompt_lens[i % len(workload.prompt_lens)], vocab, salt + i)[0]
        for i in range(workload.num_requests)
    ]
    finished = {}
    steps = 0
    while prompts or llm.has_unfinished_requests():
        if prompts and steps % workload.arrival_steps == 0:
            llm.add_request(prompts.pop(0), params)
        for out in llm.step():
            if out.finished:
                finished[out.request_id] = out
        steps += 1
    ttft = [o.metrics.time_to_first_token * 1e3 for o in finished.values()]
    tpot = [o.metrics.time_per_output_token * 1e3 for o in finished.values()]
    return {
        "requests": len(finished),
        "engine_steps": steps,
        "ttft_median_ms": statistics.median(ttft),
        "ttft_p90_ms": _percentile(ttft, 0.9),
        "tpot_median_ms": statistics.median(tpot),
        "tpot_p90_ms": _percentile(tpot, 0.9),
    }


def prefix_hit_ttft(
    llm: LLM, prompt_len: int = 300, repeats: int = 3, salt: int = 5000, warmup: int = 1
) -> dict[str, float | list[float]]:
    """Median TTFT of fresh ``prompt_len``-token prompts (cold), then of each sent again
    (all but its last token come from the prefix cache), in milliseconds, with every run's figure.

    ``warmup`` untimed cold/hit pairs go first: the first step at a new number of rows pays
    one-time costs (oneDNN creates its GEMM primitives per shape) that belong to neither
    figure, and would otherwise land in the first repeat of both. Each timed pair then runs
    in the same state: a cold prompt right after the previous pair, its hit right after it.
    """
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    vocab = llm.config.vocab_size
    for w in range(warmup):
        prompt = token_ids(1, prompt_len, vocab, salt - 1 - w)[0]
        llm.generate([prompt], params)
        llm.generate([prompt], params)
    cold, hit, cached = [], [], []
    for r in range(repeats):
        prompt = token_ids(1, prompt_len, vocab, salt + r)[0]
        (first,) = llm.generate([prompt], params)
        (again,) = llm.generate([prompt], params)
        cold.append(first.metrics.time_to_first_token * 1e3)
        hit.append(again.metrics.time_to_first_token * 1e3)
        cached.append(again.num_cached_tokens)
    return {
        "prompt_len": prompt_len,
        "cached_tokens": min(cached),
        "cold_ttft_ms": statistics.median(cold),
        "hit_ttft_ms": statistics.median(hit),
        "speedup": statistics.median(cold) / statistics.median(hit),
        "cold_ttft_runs_ms": cold,
        "hit_ttft_runs_ms": hit,
    }
