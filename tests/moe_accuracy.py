"""bf16 ``moe_experts`` accuracy against fp64, per case (not a test module; scored and
reported as ``tests/bf16_accuracy.py`` describes): ``python -m tests.moe_accuracy``. Cases
cover the streaming (decode) and blocked (prefill) expert groups, DeepSeek-V2-Lite's widths,
odd widths and a token picking one expert twice."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mlafx.kernels import moe_experts
from tests.bf16_accuracy import BF16, errors, report

# name -> (tokens, hidden, intermediate, experts, top_k); pairs per expert ~ T * k / E
CASES = {
    "decode_t1_v2lite": (1, 2048, 1408, 8, 6),
    "decode_t8": (8, 512, 256, 16, 4),
    "around_32_pairs": (32, 256, 192, 2, 2),
    "prefill_t256": (256, 512, 384, 4, 2),
    "prefill_v2lite_t96": (96, 2048, 1408, 2, 2),
    "odd_widths": (40, 77, 41, 3, 2),
    "repeated_expert": (64, 128, 96, 2, 2),
}


def moe_f64(x, ids, weights, w13, w2) -> torch.Tensor:
    """The op's definition in fp64, one expert at a time over the tokens that picked it."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    x64 = x.double()
    for e in ids.unique().tolist():
        t, j = (ids == e).nonzero(as_tuple=True)
        gate_up = x64[t] @ w13[e].double().T
        h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        y = h @ w2[e].double().T
        out.index_add_(0, t, weights[t, j].double()[:, None] * y)
    return out


def measure() -> dict[str, dict[str, float]]:
    results = {}
    for seed, (name, (T, D, inter, E, k)) in enumerate(CASES.items()):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(T, D, generator=gen).to(BF16)
        ids = torch.randint(0, E, (T, k), generator=gen)
        if name == "repeated_expert":
            ids[:, 1] = ids[:, 0]
        weights = torch.rand(T, k, generator=gen)
        w13 = (torch.randn(E, 2 * inter, D, generator=gen) / D**0.5).to(BF16)
        w2 = (torch.randn(E, D, inter, generator=gen) / inter**0.5).to(BF16)
        out = moe_experts(x, ids, weights, w13, w2)
        results[name] = errors(out, moe_f64(x, ids, weights, w13, w2))
    return results


if __name__ == "__main__":
    report(measure)
