"""Check a rewritten step graph against the original, numerically.

Pattern → replacement: none (a check). Structure cannot prove what a mask does, so both
graphs run on the same sample step — a prefill row with context, a fresh prefill and a
decode (decode-only inputs never exercise the causal mask) — from identical caches whose
context rows hold random latents. Ensures: logits and every cache agree within the dtype's
tolerance, else ``VerificationError`` names what differs (the caller keeps the original).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mlafx.models.step import StepInputs

# |a - b| <= atol + rtol * |b|, per dtype of the caches/model
TOLERANCES = {
    torch.float32: (1e-4, 1e-4),
    torch.bfloat16: (5e-2, 5e-2),
    torch.float16: (1e-2, 1e-2),
}


class VerificationError(RuntimeError):
    pass


@dataclass(frozen=True)
class VerifyReport:
    max_abs_logit_diff: float
    max_abs_cache_diff: float


def random_caches(template: list[torch.Tensor], seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(c.shape, generator=generator, dtype=torch.float32).to(c.dtype) for c in template
    ]


def verify_rewrite(
    original: Callable[..., torch.Tensor],
    rewritten: Callable[..., torch.Tensor],
    sample: StepInputs,
    caches: list[torch.Tensor],
) -> VerifyReport:
    dtype = caches[0].dtype
    atol, rtol = TOLERANCES[dtype]
    reports = []
    results = []
    for fn in (original, rewritten):
        own = [c.clone() for c in caches]
        with torch.no_grad():
            logits = fn(sample.input_ids, sample.positions, own, sample.meta, sample.logits_indices)
        results.append((logits.float(), [c.float() for c in own]))
    (want, want_caches), (got, got_caches) = results
    logit_diff = (got - want).abs()
    if not torch.all(logit_diff <= atol + rtol * want.abs()):
        raise VerificationError(
            f"rewritten step's logits differ from the original's by up to {logit_diff.max():.3g} "
            f"(tolerance {atol} + {rtol}·|x|, {dtype})"
        )
    cache_diff = 0.0
    for layer, (a, b) in enumerate(zip(want_caches, got_caches, strict=True)):
        diff = (a - b).abs().max().item()
        if diff > atol:
            raise VerificationError(f"layer {layer}: caches differ by {diff:.3g} after the step")
        cache_diff = max(cache_diff, diff)
    reports.append(VerifyReport(logit_diff.max().item(), cache_diff))
    return reports[0]
