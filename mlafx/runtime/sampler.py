"""Next-token choice per request: greedy, or temperature / top-k / top-p sampling with a
per-request seeded generator; optional top-k log-probabilities of the raw distribution."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mlafx.runtime.request import Request


@dataclass(frozen=True)
class Sample:
    token_id: int
    logprob: float  # of the chosen token, raw distribution
    top_logprobs: dict[int, float] | None  # when the request asked for logprobs


def sample(logits: torch.Tensor, requests: list[Request]) -> list[Sample]:
    """logits [S, vocab] (any float dtype) -> one Sample per request, in order."""
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    greedy = logprobs.argmax(dim=-1).tolist()
    samples = []
    for row, request in enumerate(requests):
        params = request.params
        token = greedy[row] if params.temperature == 0 else _sample_row(logits[row], request)
        top = None
        if params.logprobs is not None:
            k = min(params.logprobs, logprobs.shape[1])
            values, ids = (
                logprobs[row].topk(k) if k else (logprobs[row][:0], logprobs[row][:0].long())
            )
            top = dict(zip(ids.tolist(), values.tolist(), strict=True))
            top[token] = logprobs[row, token].item()
        samples.append(Sample(token, logprobs[row, token].item(), top))
    return samples


def _sample_row(logits: torch.Tensor, request: Request) -> int:
    params = request.params
    scaled = logits.to(torch.float32) / params.temperature
    if params.top_k is not None and 0 < params.top_k < scaled.shape[0]:
        kth = scaled.topk(params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = scaled.softmax(-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = sorted_probs.cumsum(0) - sorted_probs >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=request.generator).item())
