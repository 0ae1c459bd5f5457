"""One measured configuration of one kernel, judged against the same run's roofline."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from bench.roofline import Roofline


@dataclass(frozen=True)
class Row:
    op: str  # e.g. "mla_attention_paged"
    case: str  # shape summary, e.g. "decode B=8 ctx=4096 bs=16"
    dtype: str
    threads: int
    median_ms: float
    num_bytes: float  # bytes the kernel must move at least
    flops: float  # useful flops, counted canonically (see each case module)
    roofline_fraction: float  # time_floor / median time (1.0 = at the roofline)
    baselines_ms: dict[str, float] = field(default_factory=dict)  # naive PyTorch paths

    @property
    def gbps(self) -> float:
        return self.num_bytes / (self.median_ms * 1e-3) / 1e9

    @property
    def gflops(self) -> float:
        return self.flops / (self.median_ms * 1e-3) / 1e9

    def as_dict(self) -> dict:
        return {
            **asdict(self),
            "gbps": self.gbps,
            "gflops": self.gflops,
            "speedups": {name: ms / self.median_ms for name, ms in self.baselines_ms.items()},
        }


def make_row(
    roofline: Roofline,
    *,
    op: str,
    case: str,
    dtype: torch.dtype,
    threads: int,
    seconds: float,
    num_bytes: float,
    flops: float,
    baselines_s: dict[str, float] | None = None,
) -> Row:
    floor = roofline.time_floor(num_bytes, flops, dtype)
    return Row(
        op=op,
        case=case,
        dtype=str(dtype).removeprefix("torch."),
        threads=threads,
        median_ms=seconds * 1e3,
        num_bytes=num_bytes,
        flops=flops,
        roofline_fraction=floor / seconds,
        baselines_ms={k: v * 1e3 for k, v in (baselines_s or {}).items()},
    )
