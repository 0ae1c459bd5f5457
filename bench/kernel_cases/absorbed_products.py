"""batched_matmul at decode's row counts: the absorbed attention's per-head products against
ATen's bmm at the same shapes.

Cases (DeepSeek-V2-Lite's 16 heads): ``q_nope W_UK`` [16, M, 128] x [16, 128, 512] and
``out W_UV^T`` [16, M, 512] x [16, 512, 128], bf16, M = 1, 4, 8 and 16 rows per head (the
batch's tokens): the streaming kernel up to 4 rows, the AMX tiles (5-16) or, without AMX, the
pairs kernel (5-8), ATen's bmm beyond. Bytes = w + x + out; flops = 2 * 16 * M * K * N.
Baseline: ``torch.bmm``. Weights are cold: rotating copies whose total exceeds 512 MB (one copy
with --quick).
"""

from __future__ import annotations

import time

import torch

import mlafx.kernels as K
from bench.kernel_cases.quant_gemm import _copies, _rotating
from bench.kernel_cases.row import Row, make_row
from bench.roofline import Roofline, median_seconds

HEADS = 16
PRODUCTS = [("q_nope W_UK", 128, 512), ("out W_UV^T", 512, 128)]  # name, K, N
ROWS = [1, 4, 8, 16]


def run(roofline: Roofline, *, quick: bool, threads: list[int]) -> list[Row]:
    gen = torch.Generator().manual_seed(0)
    started = time.perf_counter()
    rows = []
    for name, k, n in PRODUCTS:
        w = (torch.randn(HEADS, k, n, generator=gen) / k**0.5).bfloat16()
        weights = [(w.clone(),) for _ in range(_copies(w.nbytes, quick))]
        for m in ROWS:
            x = torch.randn(HEADS, m, k, generator=gen).bfloat16()
            for t in threads:
                torch.set_num_threads(t)
                ours = median_seconds(_rotating(lambda w, x=x: K.batched_matmul(x, w), weights))
                base = median_seconds(_rotating(lambda w, x=x: torch.bmm(x, w), weights))
                rows.append(
                    make_row(
                        roofline,
                        op="batched_matmul",
                        case=f"{name} {m} rows/head",
                        dtype=torch.bfloat16,
                        threads=t,
                        seconds=ours,
                        num_bytes=w.nbytes + x.nbytes + HEADS * m * n * 2,
                        flops=2 * HEADS * m * k * n,
                        baselines_s={"ATen bmm": base},
                    )
                )
    print(f"absorbed_products: {time.perf_counter() - started:.0f} s")
    return rows
