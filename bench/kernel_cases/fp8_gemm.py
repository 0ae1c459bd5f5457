"""linear_fp8 and moe_experts_fp8 (DeepSeek's block FP8, e4m3 widened in registers) against
the bf16 ops at the same shapes.

Cases (DeepSeek-V2-Lite's widths, [128, 128] blocks):
- linear_fp8, x bf16, M = 1, 8, 32, 1024 for the projections (q 2048->3072, kv_a 2048->576,
  shared-expert gate_up 2048->5632 and down 2816->2048): bytes = the e4m3 weight and its
  scales; flops = 2 * M * K * N. Baseline: bf16 ``linear_packed`` (VDPBF16PS streaming or
  oneDNN) at the same shape, which reads twice the bytes.
- moe_experts_fp8 at 8 and 1024 tokens (D=2048, I=1408, 64 experts, top-6): bytes = the
  touched experts' weights and scales. Baseline: bf16 ``moe_experts``.
The roofline column is bytes over the measured read bandwidth or flops over the measured bf16
matmul rate, whichever is larger. Weights are cold: rotating copies whose total exceeds
512 MB (one copy with --quick).
"""

from __future__ import annotations

import itertools
import time

import torch

import mlafx.kernels as K
from bench.kernel_cases.row import Row, make_row
from bench.roofline import Roofline, median_seconds
from mlafx.kernels.fp8_format import quantize_fp8

COLD_BYTES = 512 << 20
BLOCK = (128, 128)
PROJECTIONS = [  # name, in_features, out_features, rows of x
    ("q_proj", 2048, 16 * 192, [1, 8, 32, 1024]),
    ("kv_a_proj", 2048, 512 + 64, [1, 8, 32, 1024]),
    ("shared gate_up", 2048, 2 * 2816, [1, 8, 32, 1024]),
    ("shared down", 2816, 2048, [1, 8, 32, 1024]),
]
D, INTER, EXPERTS, TOP_K = 2048, 1408, 64, 6


def _copies(nbytes: int, quick: bool) -> int:
    return 1 if quick else max(2, -(-COLD_BYTES // nbytes))


def _rotating(fn, sets):
    cycle = itertools.cycle(sets)
    return lambda: fn(*next(cycle))


def _linear_rows(roofline, quick, threads, name, in_f, out_f, batches, gen) -> list[Row]:
    weight = torch.randn(out_f, in_f, generator=gen) / in_f**0.5
    q, s = quantize_fp8(weight, BLOCK)
    nbytes = q.nbytes + s.nbytes
    sets = [(q.clone(), s.clone()) for _ in range(_copies(nbytes, quick))]
    bf16 = K.pack_linear_weight(weight.bfloat16())
    bf16_sets = [(bf16.clone(),) for _ in range(_copies(bf16.nbytes, quick))]
    rows = []
    for m in batches:
        x = torch.randn(m, in_f, generator=gen).bfloat16()
        repeats = 3 if m >= 1024 else 7
        for t in threads:
            torch.set_num_threads(t)
            ours = median_seconds(
                _rotating(lambda w, sc, x=x: K.linear_fp8(x, w, sc, BLOCK), sets), repeats=repeats
            )
            base = median_seconds(
                _rotating(lambda p, x=x: K.linear_packed(x, p, out_f), bf16_sets), repeats=repeats
            )
            rows.append(
                make_row(
                    roofline,
                    op="linear_fp8",
                    case=f"{name} {m}x{in_f}->{out_f}",
                    dtype=torch.bfloat16,
                    threads=t,
                    seconds=ours,
                    num_bytes=nbytes,
                    flops=2 * m * in_f * out_f,
                    baselines_s={"bf16 linear_packed": base},
                )
            )
    return rows


def _stack(weight: torch.Tensor, copies: int) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = quantize_fp8(weight, BLOCK)
    return q.expand(copies, -1, -1).contiguous(), s.expand(copies, -1, -1).contiguous()


def _moe_rows(roofline, threads, num_tokens, gen) -> list[Row]:
    w1 = torch.randn(INTER, D, generator=gen) / D**0.5
    w3 = torch.randn(INTER, D, generator=gen) / D**0.5
    w2 = torch.randn(D, INTER, generator=gen) / INTER**0.5
    (q1, s1), (q3, s3), (q2, s2) = (_stack(w, EXPERTS) for w in (w1, w3, w2))
    q13, s13 = torch.cat([q1, q3], dim=1), torch.cat([s1, s3], dim=1)
    b13 = torch.cat([w1, w3]).bfloat16().expand(EXPERTS, -1, -1).contiguous()
    b2 = w2.bfloat16().expand(EXPERTS, -1, -1).contiguous()
    x = torch.randn(num_tokens, D, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, TOP_K, generator=gen)
    touched = int(ids.unique().numel())
    expert_bytes = (q13.nbytes + s13.nbytes + q2.nbytes + s2.nbytes) // EXPERTS
    repeats = 3 if num_tokens > 64 else 7
    rows = []
    for t in threads:
        torch.set_num_threads(t)
        base = median_seconds(lambda: K.moe_experts(x, ids, weights, b13, b2), repeats=repeats)
        ours = median_seconds(
            lambda: K.moe_experts_fp8(x, ids, weights, q13, s13, q2, s2, BLOCK), repeats=repeats
        )
        rows.append(
            make_row(
                roofline,
                op="moe_experts_fp8",
                case=f"T={num_tokens} E={EXPERTS} top{TOP_K} ({touched} hit)",
                dtype=torch.bfloat16,
                threads=t,
                seconds=ours,
                num_bytes=touched * expert_bytes,
                flops=6 * D * INTER * num_tokens * TOP_K,
                baselines_s={"bf16 moe_experts": base},
            )
        )
    return rows


def run(roofline: Roofline, *, quick: bool, threads: list[int]) -> list[Row]:
    gen = torch.Generator().manual_seed(0)
    started = time.perf_counter()
    rows = []
    projections = PROJECTIONS[:2] if quick else PROJECTIONS
    for name, in_f, out_f, batches in projections:
        batches = [m for m in batches if m <= 32] if quick else batches
        rows += _linear_rows(roofline, quick, threads, name, in_f, out_f, batches, gen)
    rows += _moe_rows(roofline, threads, 8, gen)
    rows += _moe_rows(roofline, threads, 64 if quick else 1024, gen)
    print(f"fp8_gemm: {time.perf_counter() - started:.0f} s")
    return rows
