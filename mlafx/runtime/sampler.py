"""Next-token choice per request: greedy, or temperature / top-k / top-p sampling with a
per-request seeded generator, after the request's logit processing (penalties, bias,
min_tokens; see ``SamplingParams``); optional top-k log-probabilities of the raw
distribution.

Defined for every parameter ``SamplingParams`` admits: a temperature under
``GREEDY_TEMPERATURE`` is greedy, top-p always keeps the most likely token, and a row the
model made non-finite (NaN or +inf logits) fails its own request only: ``sample`` returns a
``SamplingError`` in its place and the other rows are drawn as usual.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mlafx.runtime.request import Request


@dataclass(frozen=True)
class Sample:
    token_id: int
    logprob: float  # of the chosen token, raw distribution
    top_logprobs: dict[int, float] | None  # when the request asked for logprobs


class SamplingError(RuntimeError):
    """A request's row could not be sampled (the model produced non-finite logits)."""


def sample(
    logits: torch.Tensor, requests: list[Request], eos_token_ids: Sequence[int] = ()
) -> list[Sample | SamplingError]:
    """logits [S, vocab] (any float dtype) -> one Sample (or the row's error) per request,
    in order. ``eos_token_ids``: masked with the stop tokens while ``min_tokens`` is unmet."""
    logits = logits.to(torch.float32)
    logprobs = torch.log_softmax(logits, dim=-1)
    finite = torch.isfinite(logits).all(dim=-1).tolist()
    greedy = logprobs.argmax(dim=-1).tolist()
    samples: list[Sample | SamplingError] = []
    for row, request in enumerate(requests):
        params = request.params
        if not finite[row] and not _only_minus_inf(logits[row]):
            samples.append(SamplingError("the model produced NaN or infinite logits"))
            continue
        try:
            processed = logits[row]
            if params.processes_logits:
                processed = process_logits(processed, request, eos_token_ids)
            if params.greedy:
                token = int(processed.argmax()) if params.processes_logits else greedy[row]
            else:
                token = _sample_row(processed, request)
        except SamplingError as e:
            samples.append(e)
            continue
        top = None
        if params.logprobs is not None:
            top = top_logprobs(logprobs[row], params.logprobs)
            top[token] = logprobs[row, token].item()
        samples.append(Sample(token, logprobs[row, token].item(), top))
    return samples


def top_logprobs(logprobs: torch.Tensor, k: int) -> dict[int, float]:
    """The ``k`` most likely token ids of one row of log-probabilities, with theirs."""
    k = min(k, logprobs.shape[0])
    if k == 0:
        return {}
    values, ids = logprobs.topk(k)
    return dict(zip(ids.tolist(), values.tolist(), strict=True))


def process_logits(
    logits: torch.Tensor, request: Request, eos_token_ids: Sequence[int]
) -> torch.Tensor:
    """One float32 row after the request's penalties, bias and min_tokens mask (a copy)."""
    params = request.params
    logits = logits.clone()
    vocab = logits.shape[0]
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(
            sorted({t for t in request.prompt_token_ids + request.output_token_ids if t < vocab}),
            dtype=torch.int64,
        )
        values = logits[seen]
        # A penalty near 0 divides a positive logit past float32's range, and +inf leaves no
        # distribution to draw from (schemathesis sent repetition_penalty=5.5e-263): the
        # largest finite logit keeps the meaning, that token wins.
        logits[seen] = torch.where(
            values > 0, values / params.repetition_penalty, values * params.repetition_penalty
        ).clamp(max=torch.finfo(torch.float32).max)
    if (params.frequency_penalty or params.presence_penalty) and request.output_token_ids:
        counts = torch.bincount(
            torch.tensor(request.output_token_ids, dtype=torch.int64), minlength=vocab
        )[:vocab].to(torch.float32)
        logits -= counts * params.frequency_penalty + (counts > 0) * params.presence_penalty
    if params.logit_bias:
        ids = [t for t in params.logit_bias if 0 <= t < vocab]
        logits[ids] += torch.tensor([params.logit_bias[t] for t in ids])
    if len(request.output_token_ids) < params.min_tokens:
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        ids = [t for t in stops if 0 <= t < vocab]
        if len(ids) < vocab:  # never mask every token
            logits[ids] = float("-inf")
    return logits


def _only_minus_inf(row: torch.Tensor) -> bool:
    """Whether a row's only non-finite values are -inf (masked tokens) and some are finite."""
    return not bool(torch.isnan(row).any() or torch.isposinf(row).any()) and bool(
        torch.isfinite(row).any()
    )


def _sample_row(logits: torch.Tensor, request: Request) -> int:
    params = request.params
    # float64: a temperature just above GREEDY_TEMPERATURE cannot overflow the division
    scaled = logits.to(torch.float64) / params.temperature
    if params.top_k is not None and 0 < params.top_k < scaled.shape[0]:
        kth = scaled.topk(params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = scaled.softmax(-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p, and always the first token
        drop = sorted_probs.cumsum(0) - sorted_probs >= params.top_p
        drop[0] = False
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0:
        raise SamplingError("the sampling distribution is empty or not finite")
    return int(torch.multinomial(probs, 1, generator=request.generator).item())
