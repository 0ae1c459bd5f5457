"""linear_quantized and moe_experts_quantized on the K formats (k4: GGUF's Q4_K, k8: Q5_K /
Q6_K, ``mlafx/kernels/kquant_format.py``) against the int4 format at the same shapes: what
running a Q4_K_M file from its own bytes costs next to a Q4_0 one.

Cases (``--only kquant``):
- linear_quantized, k4 and k8, x bf16, at M = 1, 8, 32 for lm_head 2048 -> 102400 and the q
  projection 2048 -> 3072: bytes = the packed weight; flops = 2 * M * K * N.
  Baselines: int4 linear_quantized (Q4_0's bytes) and bf16 linear_packed at the same shape.
- moe_experts_quantized at 8 tokens (D=2048, I=1408 rounded up to 1536 = 6 super-blocks, 64
  experts, top-6) with a Q4_K_M-like stack (gate/up k4, down k8) against int4 experts.
The roofline is the same run's read bandwidth over the bytes (or the bf16 matmul rate, as in
quant_gemm.py). Weights are random valid K-format parts (the kernels' speed does not depend on
the values), cold as in quant_gemm.py: rotating copies whose total exceeds 512 MB.
"""

from __future__ import annotations

import time

import torch

import mlafx.kernels as K
from bench.kernel_cases.quant_gemm import _copies, _rotating
from bench.kernel_cases.row import Row, make_row
from bench.roofline import Roofline, median_seconds
from mlafx.kernels.kquant_format import pack_kquant
from mlafx.kernels.quant_ops import quantize_experts

SHAPES = [("lm_head", 2048, 102400), ("q_proj", 2048, 16 * 192)]
BATCHES = [1, 8, 32]
D, INTER, EXPERTS, TOP_K = 2048, 1536, 64, 6


def random_kquant(n: int, k: int, bits: int, gen: torch.Generator) -> torch.Tensor:
    """A packed k{bits} weight [n, k] of random parts in the formats' ranges."""
    groups = k // 256
    low, high = (0, 16) if bits == 4 else (-32, 32)
    v = torch.randint(low, high, (n, groups, 8, 32), generator=gen, dtype=torch.int16)
    a = torch.randint(1, 64, (n, groups, 8, 2), generator=gen, dtype=torch.int16)
    m = torch.randint(0, 64, (n, groups, 8), generator=gen, dtype=torch.int16)
    d = (torch.rand(n, groups, generator=gen) * 1e-3).half()
    return pack_kquant((v, a, m, d, d.clone()), bits)


def _linear_rows(roofline, quick, threads, name, in_f, out_f, gen) -> list[Row]:
    weight = (torch.randn(out_f, in_f, generator=gen) / in_f**0.5).bfloat16()
    baselines = {
        "int4 linear_quantized": (K.linear_quantized, K.quantize_linear_weight(weight, 4)),
        "bf16 linear_packed": (K.linear_packed, K.pack_linear_weight(weight)),
    }
    del weight
    rows = []
    for bits in (4, 8):
        packed = random_kquant(out_f, in_f, bits, gen)
        sets = [(packed.clone(),) for _ in range(_copies(packed.nbytes, quick))]
        base_sets = {
            label: (fn, [(w.clone(),) for _ in range(_copies(w.nbytes, quick))])
            for label, (fn, w) in baselines.items()
        }
        for m in BATCHES:
            x = torch.randn(m, in_f, generator=gen).bfloat16()
            for t in threads:
                torch.set_num_threads(t)
                ours = median_seconds(
                    _rotating(lambda p, x=x: K.linear_quantized(x, p, out_f), sets), repeats=7
                )
                base = {
                    label: median_seconds(
                        _rotating(lambda p, fn=fn, x=x: fn(x, p, out_f), wsets), repeats=7
                    )
                    for label, (fn, wsets) in base_sets.items()
                }
                rows.append(
                    make_row(
                        roofline,
                        op="linear_quantized",
                        case=f"k{bits} {name} {m}x{in_f}->{out_f}",
                        dtype=torch.bfloat16,
                        threads=t,
                        seconds=ours,
                        num_bytes=packed.nbytes,
                        flops=2 * m * in_f * out_f,
                        baselines_s=base,
                    )
                )
        del sets, base_sets
    return rows


def _moe_rows(roofline, threads, gen) -> list[Row]:
    num_tokens = 8
    # 64 distinct copies (> L3) of one expert: cold weights
    k13 = random_kquant(2 * INTER, D, 4, gen)[None].expand(EXPERTS, -1, -1, -1).contiguous()
    k2 = random_kquant(D, INTER, 8, gen)[None].expand(EXPERTS, -1, -1, -1).contiguous()
    one_w13 = (torch.randn(2 * INTER, D, generator=gen) / D**0.5).bfloat16()
    one_w2 = (torch.randn(D, INTER, generator=gen) / INTER**0.5).bfloat16()
    q13 = quantize_experts(one_w13[None], 4).expand(EXPERTS, -1, -1, -1).contiguous()
    q2 = quantize_experts(one_w2[None], 4).expand(EXPERTS, -1, -1, -1).contiguous()
    x = torch.randn(num_tokens, D, generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:TOP_K] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, TOP_K, generator=gen)
    touched = int(ids.unique().numel())
    rows = []
    for t in threads:
        torch.set_num_threads(t)
        ours = median_seconds(
            lambda: K.moe_experts_quantized(x, ids, weights, k13, k2, INTER), repeats=7
        )
        base = median_seconds(
            lambda: K.moe_experts_quantized(x, ids, weights, q13, q2, INTER), repeats=7
        )
        rows.append(
            make_row(
                roofline,
                op="moe_experts_quantized",
                case=f"k4+k8 T={num_tokens} E={EXPERTS} top{TOP_K} ({touched} hit)",
                dtype=torch.bfloat16,
                threads=t,
                seconds=ours,
                num_bytes=touched * (k13.nbytes + k2.nbytes) // EXPERTS,
                flops=6 * D * INTER * num_tokens * TOP_K,
                baselines_s={"int4 moe_experts_quantized": base},
            )
        )
    return rows


def run(roofline: Roofline, *, quick: bool, threads: list[int]) -> list[Row]:
    gen = torch.Generator().manual_seed(0)
    started = time.perf_counter()
    rows = []
    for name, in_f, out_f in SHAPES[1:] if quick else SHAPES:
        rows += _linear_rows(roofline, quick, threads, name, in_f, out_f, gen)
    rows += _moe_rows(roofline, threads, gen)
    print(f"kquant_gemm: {time.perf_counter() - started:.0f} s")
    return rows
