"""moe_experts_fp4 (DeepSeek-V4's FP4 experts: e2m1 nibbles widened to bf16 in registers, a
ue8m0 scale per 32) against the same experts in block FP8 (``moe_experts_fp8``) and in bf16
(``moe_experts``).

V4-Flash's expert widths (``DeepseekV4Config``'s defaults: D = 4096, I = 2048, top-6) over 64
experts (V4-Flash has 256; 64 keep the bf16 baseline's copy in memory), SwiGLU clamped at 10 as
V4's are. 1, 8 and 1024 tokens (64 with --quick): bytes = the touched experts' stored weights
and scales (4.25 bits a weight; FP8 8.03, bf16 16); flops = 6 * D * I * tokens * top-k. The
roofline column is bytes over the measured read bandwidth or flops over the bf16 matmul rate,
whichever is larger. Every expert is its own copy of one quantized expert, so the weights a
step touches are cold once per call unless they fit in the caches.
"""

from __future__ import annotations

import time

import torch

import mlafx.kernels as K
from bench.kernel_cases.row import Row, make_row
from bench.roofline import Roofline, median_seconds
from mlafx.config.deepseek_v4 import DeepseekV4Config
from mlafx.kernels.fp4_format import dequantize_fp4, quantize_fp4
from mlafx.kernels.fp8_format import quantize_fp8

EXPERTS, LIMIT, FP8_BLOCK = 64, 10.0, (128, 128)


def _stacks(gen: torch.Generator, d: int, inter: int):
    """(fp4 w13, s13, w2, s2), (fp8 w13, s13, w2, s2), (bf16 w13, w2): the same dequantized
    expert in every copy, as stored in each format."""
    w13 = torch.randn(2 * inter, d, generator=gen) / d**0.5
    w2 = torch.randn(d, inter, generator=gen) / inter**0.5
    (q13, s13), (q2, s2) = quantize_fp4(w13), quantize_fp4(w2)
    exact13, exact2 = dequantize_fp4(q13, s13), dequantize_fp4(q2, s2)

    def stack(t: torch.Tensor) -> torch.Tensor:
        return t.expand(EXPERTS, *t.shape).contiguous()

    fp4 = tuple(stack(t.view(torch.uint8)) for t in (q13, s13, q2, s2))
    (f13, g13), (f2, g2) = (quantize_fp8(w, FP8_BLOCK) for w in (exact13, exact2))
    fp8 = tuple(stack(t) for t in (f13, g13, f2, g2))
    bf16 = (stack(exact13.bfloat16()), stack(exact2.bfloat16()))
    return fp4, fp8, bf16


def run(roofline: Roofline, *, quick: bool, threads: list[int]) -> list[Row]:
    started = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    cfg = DeepseekV4Config.from_hf_dict({"model_type": "deepseek_v4"})  # V4-Flash's widths
    d, inter, top_k = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    fp4, fp8, bf16 = _stacks(gen, d, inter)
    expert_bytes = sum(t.nbytes for t in fp4) // EXPERTS
    rows = []
    for tokens in (1, 8, 64) if quick else (1, 8, 1024):
        x = torch.randn(tokens, d, generator=gen).bfloat16()
        ids = torch.stack([torch.randperm(EXPERTS, generator=gen)[:top_k] for _ in range(tokens)])
        weights = torch.rand(tokens, top_k, generator=gen)
        touched = int(ids.unique().numel())
        repeats = 3 if tokens > 64 else 7
        for t in threads:
            torch.set_num_threads(t)
            ours = median_seconds(
                lambda x=x, ids=ids, w=weights: K.moe_experts_fp4(x, ids, w, *fp4, LIMIT),
                repeats=repeats,
            )
            fp8_s = median_seconds(
                lambda x=x, ids=ids, w=weights: K.moe_experts_fp8(x, ids, w, *fp8, FP8_BLOCK),
                repeats=repeats,
            )
            bf16_s = median_seconds(
                lambda x=x, ids=ids, w=weights: K.moe_experts(x, ids, w, *bf16), repeats=repeats
            )
            rows.append(
                make_row(
                    roofline,
                    op="moe_experts_fp4",
                    case=f"T={tokens} D={d} I={inter} E={EXPERTS} ({touched} hit)",
                    dtype=torch.bfloat16,
                    threads=t,
                    seconds=ours,
                    num_bytes=touched * expert_bytes,
                    flops=6 * d * inter * tokens * top_k,
                    baselines_s={"fp8 moe_experts_fp8": fp8_s, "bf16 moe_experts": bf16_s},
                )
            )
    print(f"fp4_moe: {time.perf_counter() - started:.0f} s")
    return rows
