"""linear_quantized and moe_experts_quantized (int8 / int4 W8A8) against the bf16 ops at the
same shapes, and quantize_linear_weight's speed.

Cases:
- quantize_linear_weight, a 2048 x 2048 bf16 weight: G weights/s (the loader quantizes
  15.7 B weights of DeepSeek-V2-Lite).
- linear_quantized, int8 and int4, x bf16, at M = 1, 8, 32 for lm_head 2048 -> 102400 and
  M = 1, 8, 32, 1024 for the projections (q 2048->3072, kv_a 2048->576, shared-expert down
  2816->2048... as listed in PROJECTIONS): bytes = the packed weight; flops = 2 * M * K * N
  (a "GFLOP/s-equivalent": each int8 product counted as a bf16 multiply-add would be).
  Baseline: bf16 ``linear_packed`` (VDPBF16PS streaming or oneDNN) at the same shape.
- moe_experts_quantized at 8 and 1024 tokens (D=2048, I=1408, 64 experts, top-6): bytes = the
  touched experts' packed weights; flops = 6 * D * I per (token, choice). Baseline: bf16
  ``moe_experts`` over the same 64 experts.
The roofline column is the same run's floor: bytes over the measured read bandwidth, or
flops over the measured bf16 matmul rate (no int8 MAC rate is measured: on CPUs without
VNNI there is none to speak of), whichever is larger. Weights are cold as in moe_gemm.py:
rotating copies whose total exceeds 512 MB (one copy with --quick). Copies are clones of one
quantized weight (the kernels' speed does not depend on the values).
"""

from __future__ import annotations

import itertools
import time

import torch

import mlafx.kernels as K
from bench.kernel_cases.row import Row, make_row
from bench.roofline import Roofline, median_seconds
from mlafx.kernels.quant_ops import quantize_experts

COLD_BYTES = 512 << 20
BITS = (8, 4)
LM_HEAD = ("lm_head", 2048, 102400, [1, 8, 32])
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


def _quantize_rows(roofline, threads, gen) -> list[Row]:
    weight = (torch.randn(2048, 2048, generator=gen) / 45).bfloat16()
    rows = []
    for bits in BITS:
        for t in threads:
            torch.set_num_threads(t)
            seconds = median_seconds(lambda b=bits: K.quantize_linear_weight(weight, b), repeats=3)
            rows.append(
                make_row(
                    roofline,
                    op="quantize_linear_weight",
                    case=f"int{bits} 2048x2048 ({weight.numel() / seconds / 1e9:.2f} Gw/s)",
                    dtype=weight.dtype,
                    threads=t,
                    seconds=seconds,
                    num_bytes=weight.numel() * 2,
                    flops=0,
                )
            )
    return rows


def _linear_rows(roofline, quick, threads, name, in_f, out_f, batches, gen) -> list[Row]:
    weight = (torch.randn(out_f, in_f, generator=gen) / in_f**0.5).bfloat16()
    bf16 = K.pack_linear_weight(weight)
    bf16_sets = [(bf16.clone(),) for _ in range(_copies(bf16.nbytes, quick))]
    rows = []
    for bits in BITS:
        packed = K.quantize_linear_weight(weight, bits)
        sets = [(packed.clone(),) for _ in range(_copies(packed.nbytes, quick))]
        for m in batches:
            x = torch.randn(m, in_f, generator=gen).bfloat16()
            repeats = 3 if m >= 1024 else 7
            for t in threads:
                torch.set_num_threads(t)
                ours = median_seconds(
                    _rotating(lambda p, x=x: K.linear_quantized(x, p, out_f), sets),
                    repeats=repeats,
                )
                base = median_seconds(
                    _rotating(lambda p, x=x: K.linear_packed(x, p, out_f), bf16_sets),
                    repeats=repeats,
                )
                rows.append(
                    make_row(
                        roofline,
                        op="linear_quantized",
                        case=f"int{bits} {name} {m}x{in_f}->{out_f}",
                        dtype=torch.bfloat16,
                        threads=t,
                        seconds=ours,
                        num_bytes=packed.nbytes,
                        flops=2 * m * in_f * out_f,
                        baselines_s={"bf16 linear_packed": base},
                    )
                )
        del sets
    return rows


def _moe_rows(roofline, threads, num_tokens, gen) -> list[Row]:
    one_w13 = (torch.randn(2 * INTER, D, generator=gen) / D**0.5).bfloat16()
    one_w2 = (torch.randn(D, INTER, generator=gen) / INTER**0.5).bfloat16()
    # 64 distinct copies (> L3) of one expert: cold weights without 64 quantizations.
    w13 = one_w13.expand(EXPERTS, -1, -1).contiguous()
    w2 = one_w2.expand(EXPERTS, -1, -1).contiguous()
    x = torch.randn(num_tokens, D, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, TOP_K, generator=gen)
    touched = int(ids.unique().numel())
    repeats = 3 if num_tokens > 64 else 7
    base = {}
    for t in threads:
        torch.set_num_threads(t)
        base[t] = median_seconds(lambda: K.moe_experts(x, ids, weights, w13, w2), repeats=repeats)
    rows = []
    for bits in BITS:
        q13 = quantize_experts(one_w13[None], bits).expand(EXPERTS, -1, -1, -1).contiguous()
        q2 = quantize_experts(one_w2[None], bits).expand(EXPERTS, -1, -1, -1).contiguous()
        expert_bytes = (q13.nbytes + q2.nbytes) // EXPERTS
        for t in threads:
            torch.set_num_threads(t)
            ours = median_seconds(
                lambda a=q13, b=q2: K.moe_experts_quantized(x, ids, weights, a, b, INTER),
                repeats=repeats,
            )
            rows.append(
                make_row(
                    roofline,
                    op="moe_experts_quantized",
                    case=f"int{bits} T={num_tokens} E={EXPERTS} top{TOP_K} ({touched} hit)",
                    dtype=torch.bfloat16,
                    threads=t,
                    seconds=ours,
                    num_bytes=touched * expert_bytes,
                    flops=6 * D * INTER * num_tokens * TOP_K,
                    baselines_s={"bf16 moe_experts": base[t]},
                )
            )
    return rows


def run(roofline: Roofline, *, quick: bool, threads: list[int]) -> list[Row]:
    gen = torch.Generator().manual_seed(0)
    started = time.perf_counter()
    rows = _quantize_rows(roofline, threads, gen)
    projections = PROJECTIONS[:2] if quick else PROJECTIONS
    for name, in_f, out_f, batches in [LM_HEAD, *projections]:
        batches = [m for m in batches if m <= 32] if quick else batches
        rows += _linear_rows(roofline, quick, threads, name, in_f, out_f, batches, gen)
    rows += _moe_rows(roofline, threads, 8, gen)
    rows += _moe_rows(roofline, threads, 64 if quick else 1024, gen)
    print(f"quant_gemm: {time.perf_counter() - started:.0f} s")
    return rows
