"""This machine's roofline, measured in the same run as the figures it judges.

- read bandwidth: summing a large fp32 tensor (each byte read once, nothing written back);
- copy bandwidth: ``dst.copy_(src)`` counted as bytes read + bytes written;
- bf16 / fp32 matmul rates: square ``torch.mm`` at a size where oneDNN is at its best.
Each is the median of three rounds (each a median of repeats) spread over the measurement: on
one host the 2-thread bf16 (AMX) rate moved between about 0.7 and 2 TFLOP/s over seconds
(a 12 s loop on 30 Nov 2026), and on another one read round in a few gave 72 GB/s against
37-44 GB/s in the rest (2 Dec 2026), so one round can catch either level.
Timings are noisy here: every figure is a median over repeats.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch


def median_seconds(fn: Callable[[], object], *, repeats: int = 7, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@dataclass(frozen=True)
class Roofline:
    threads: int
    read_gbps: float
    copy_gbps: float
    bf16_matmul_gflops: float
    fp32_matmul_gflops: float

    def time_floor(self, num_bytes: float, flops: float, dtype: torch.dtype) -> float:
        """Seconds a kernel needs at best: the larger of its memory and compute times."""
        peak = (
            self.bf16_matmul_gflops
            if dtype in (torch.bfloat16, torch.float16)
            else self.fp32_matmul_gflops
        )
        return max(num_bytes / (self.read_gbps * 1e9), flops / (peak * 1e9))

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def matmul_gflops(
    dtype: torch.dtype, *, size: int = 2048, repeats: int = 3, warmup: int = 1
) -> float:
    """The square ``torch.mm`` rate right now (a median of a few calls, ~0.1 s in bf16): to
    judge a measurement against the rate of the same moment."""
    a, b = torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)
    seconds = median_seconds(lambda: torch.mm(a, b), repeats=repeats, warmup=warmup)
    return 2 * size**3 / seconds / 1e9


def read_gbps(megabytes: int = 512, *, repeats: int = 5, warmup: int = 1) -> float:
    """The read bandwidth right now (a median of a few sums of a ``megabytes`` fp32 tensor,
    ~0.2 s at 512 MB): to judge a decode step against the memory of the same moment. 512 MB
    is past the last-level cache (this Xeon VM reports 480 MB; sums of 16-64 MB read at
    about twice the rate of 256 MB-4 GB ones)."""
    x = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    return summed_gbps(x, repeats=repeats, warmup=warmup)


def summed_gbps(x: torch.Tensor, *, repeats: int = 7, warmup: int = 2) -> float:
    """GB/s of ``x.sum()`` (each byte read once, nothing written back), a median of repeats."""
    return (
        x.numel() * x.element_size() / median_seconds(x.sum, repeats=repeats, warmup=warmup) / 1e9
    )


_MATMUL_DTYPES = (torch.bfloat16, torch.float32)


def matmul_size_within(dtype: torch.dtype, size: int, seconds: float = 2.0) -> int:
    """``size``, halved until one square matmul takes about ``seconds`` at most at this CPU's
    rate: without AVX-512 BF16, torch's bf16 matmul runs a slow fallback (~1 GFLOP/s on a
    2-core Zen 2), where a 2048 matmul takes 17 s and a full roofline half an hour."""
    probe = matmul_gflops(dtype, size=512, repeats=1, warmup=1)
    while size > 512 and 2 * size**3 / (probe * 1e9) > seconds:
        size //= 2
    return size


def measure(*, megabytes: int = 512, matmul_size: int = 2048, quick: bool = False) -> Roofline:
    if quick:
        megabytes, matmul_size = 64, 512
    x = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    y = torch.empty_like(x)
    rounds: dict[str, list[float]] = {"bf16": [], "fp32": [], "read": [], "copy": []}
    sizes = {dtype: matmul_size_within(dtype, matmul_size) for dtype in _MATMUL_DTYPES}

    def one_round() -> None:
        bf16, fp32 = sizes[torch.bfloat16], sizes[torch.float32]
        rounds["bf16"].append(matmul_gflops(torch.bfloat16, size=bf16, repeats=5, warmup=2))
        rounds["read"].append(summed_gbps(x))
        rounds["fp32"].append(matmul_gflops(torch.float32, size=fp32, repeats=5, warmup=2))
        rounds["copy"].append(2 * x.numel() * 4 / median_seconds(lambda: y.copy_(x)) / 1e9)

    for _ in range(3):
        one_round()
    rates = {name: statistics.median(values) for name, values in rounds.items()}
    return Roofline(
        threads=torch.get_num_threads(),
        read_gbps=rates["read"],
        copy_gbps=rates["copy"],
        bf16_matmul_gflops=rates["bf16"],
        fp32_matmul_gflops=rates["fp32"],
    )


if __name__ == "__main__":
    print(measure())
