"""Check a rewritten step graph against the original, numerically.

Pattern → replacement: none (a check). Structure cannot prove what a mask does, so both
graphs run on the same sample step from identical caches whose context rows hold random
latents. The lowered graph has two attention paths, chosen per row by the host, so the
sample must send prefill rows with several new tokens and context down each of them
(decode-only inputs never exercise the causal mask, and a path no row takes is not
checked at all); ``path_coverage`` counts what it exercises. Ensures: the sample covers
both paths, and the outputs (logits, or a layer's hidden states) and every cache agree
within the dtype's tolerance, else ``VerificationError`` names what is missing or differs
(the caller keeps the original).
Expert routing is held fixed (the rewritten graph replays the original's choices,
``routing_replay.py``): one bf16 rounding may flip a near-tie expert choice, which is no error.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from mlafx.models.step import StepMetadata
from mlafx.passes.routing_replay import with_fixed_routing

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
    max_abs_output_diff: float  # logits (whole step) or hidden states (a layer)
    max_abs_cache_diff: float
    coverage: dict[str, int]  # what the sample step exercised (``path_coverage``)


def path_coverage(meta: StepMetadata) -> dict[str, int]:
    """Sequences of each kind the step sends down each attention path."""
    absorbed_new = meta.absorbed_query_start_loc.diff()
    absorbed_context = meta.absorbed_kv_lens - absorbed_new
    split_new = meta.split_cu_seqlens.diff()
    context_new = meta.context_query_start_loc.diff()
    return {
        "absorbed_decodes": int(((absorbed_new == 1) & (absorbed_context > 0)).sum()),
        "absorbed_prefills_with_context": int(((absorbed_new > 1) & (absorbed_context > 0)).sum()),
        "absorbed_fresh_prefills": int((absorbed_context == 0).sum()),
        "split_prefills_with_context": int((context_new > 1).sum()),
        "split_fresh_prefills": len(split_new) - len(context_new),
    }


def check_coverage(coverage: dict[str, int]) -> None:
    for kind in ("absorbed_prefills_with_context", "split_prefills_with_context"):
        if coverage[kind] == 0:
            raise VerificationError(
                f"the sample step has no {kind.replace('_', ' ')}: that path would go unchecked"
            )


def random_caches(template: list[torch.Tensor], seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.randn(c.shape, generator=generator, dtype=torch.float32).to(c.dtype) for c in template
    ]


class Sample(Protocol):
    """What a graph is verified on: the whole step's inputs (``StepInputs``) or one layer's
    (``graph.capture.LayerSample``)."""

    @property
    def meta(self) -> StepMetadata: ...

    def args(self, caches: list[torch.Tensor]) -> tuple: ...


def verify_rewrite(
    original: Callable[..., torch.Tensor],
    rewritten: Callable[..., torch.Tensor],
    sample: Sample,
    caches: list[torch.Tensor],
) -> VerifyReport:
    """Run both graphs as ``fn(*sample.args(own_caches))`` from copies of ``caches``: the
    whole step (output: the logits) or one layer (output: its hidden states)."""
    coverage = path_coverage(sample.meta)
    check_coverage(coverage)
    dtype = caches[0].dtype
    atol, rtol = TOLERANCES[dtype]
    results: list[tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]] = []
    for fn in with_fixed_routing(original, rewritten):  # the original runs first
        own = [c.clone() for c in caches]
        with torch.no_grad():
            output = fn(*sample.args(own))
        # a DSA layer that runs its indexer returns (x, selected): both graphs select with
        # the same op, so the selections must be equal
        outputs = list(output) if isinstance(output, tuple | list) else [output]
        results.append((outputs[0].float(), [c.float() for c in own], outputs[1:]))
    (want, want_caches, want_selected), (got, got_caches, got_selected) = results
    for a, b in zip(want_selected, got_selected, strict=True):
        if not torch.equal(a, b):
            raise VerificationError("the rewritten graph's DSA selection differs")
    output_diff = (got - want).abs()
    if not torch.all(output_diff <= atol + rtol * want.abs()):
        raise VerificationError(
            f"rewritten graph's output differs from the original's by up to "
            f"{output_diff.max():.3g} (tolerance {atol} + {rtol}·|x|, {dtype})"
        )
    cache_diff = 0.0
    for layer, (a, b) in enumerate(zip(want_caches, got_caches, strict=True)):
        diff = (a - b).abs()
        # relative too: one bf16 rounding of a cached value of magnitude 8 is 0.0625
        if not torch.all(diff <= atol + rtol * a.abs()):
            raise VerificationError(
                f"cache {layer}: caches differ by up to {diff.max():.3g} after the step "
                f"(tolerance {atol} + {rtol}·|x|, {dtype})"
            )
        cache_diff = max(cache_diff, diff.max().item())
    return VerifyReport(output_diff.max().item(), cache_diff, coverage)
