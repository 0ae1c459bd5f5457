"""Kernel benchmarks: measure this machine's roofline, then every op family's cases, in one run.

    .venv/bin/python bench/kernels.py [--quick] [--threads 1,2] [--only NAME] [--json FILE]

Prints a table (median time, GB/s, GFLOP/s, fraction of the roofline, speed-up over naive
PyTorch baselines) and writes JSON (default bench/results/kernels.json).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import roofline as roofline_mod  # noqa: E402
from bench.kernel_cases.row import Row  # noqa: E402

# The op families, in the order they run. Add a module here when you add one.
CASE_MODULES: list[str] = [
    "bench.kernel_cases.latent_cache",
    "bench.kernel_cases.moe_gemm",
    "bench.kernel_cases.quant_gemm",
    "bench.kernel_cases.kquant_gemm",
    "bench.kernel_cases.fp8_gemm",
    "bench.kernel_cases.fp4_moe",
    "bench.kernel_cases.attention",
    "bench.kernel_cases.absorbed_products",
    "bench.kernel_cases.dsa",
    "bench.kernel_cases.v4_attention",
    "bench.kernel_cases.v4_compressor",
]


def print_table(rows: list[Row]) -> None:
    header = (
        f"{'op':<22} {'case':<34} {'dtype':<8} {'thr':>3} {'ms':>9} {'GB/s':>7} "
        f"{'GFLOP/s':>8} {'roof':>5}  speed-ups"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        ups = ", ".join(f"{k} {r.baselines_ms[k] / r.median_ms:.1f}x" for k in r.baselines_ms)
        print(
            f"{r.op:<22} {r.case:<34} {r.dtype:<8} {r.threads:>3} {r.median_ms:>9.3f} "
            f"{r.gbps:>7.1f} {r.gflops:>8.1f} {r.roofline_fraction:>5.0%}  {ups}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small shapes, few repeats")
    parser.add_argument(
        "--threads", default=None, help="comma-separated thread counts (default: 1 and all)"
    )
    parser.add_argument("--only", action="append", help="run only case modules containing this")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "kernels.json")
    args = parser.parse_args(argv)
    all_threads = torch.get_num_threads()
    threads = (
        [int(t) for t in args.threads.split(",")] if args.threads else sorted({1, all_threads})
    )
    torch.set_num_threads(all_threads)
    roof = roofline_mod.measure(quick=args.quick)
    print(
        f"roofline ({roof.threads} threads): read {roof.read_gbps:.1f} GB/s, copy "
        f"{roof.copy_gbps:.1f} GB/s, bf16 matmul {roof.bf16_matmul_gflops:.0f} GFLOP/s, fp32 "
        f"matmul {roof.fp32_matmul_gflops:.0f} GFLOP/s"
    )
    rows: list[Row] = []
    for name in CASE_MODULES:
        if args.only and not any(o in name for o in args.only):
            continue
        rows += importlib.import_module(name).run(roof, quick=args.quick, threads=threads)
    torch.set_num_threads(all_threads)
    print_table(rows)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"roofline": roof.as_dict(), "rows": [r.as_dict() for r in rows]}, indent=2)
    )
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
