"""The cost of batch-invariant mode: the demo model's compiled step in the default mode and in
batch-invariant mode, over the same engine and KV cache, steps interleaved.

    mlafx bench invariant-cost [--rounds 5] [--threads 2] [--model embedded]
                               [--quantization int8|int4|fp8] [--only decode]

``--quantization fp8`` serves the model's dummy weights written as a DeepSeek block-FP8
checkpoint (``--checkpoint-dir``, as ``mlafx bench e2e --quantization fp8``).

Each round times every case once in each mode, one right after the other, so that a drift
of the machine (a VM's memory or a neighbour) hits both alike; the figures are medians over
the rounds and the ratio is invariant / default. Prefill cases are whole prompts from an
empty cache, decode cases one token per sequence over that many cached rows (as in
``mlafx bench e2e``, whose grid measures the same two modes apart). Peak RSS is the process's.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script (mlafx bench): the checkout on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.busy_machine import load_average
from bench.e2e.backends import MlafxStep, Run, blocks_needed
from bench.e2e.measure import peak_rss_bytes
from bench.e2e.models import MODELS, fp8_checkpoint, mlafx_fp8_llm, mlafx_llm

BLOCK_SIZE = 16
# (name, kind, batch, tokens): prefill tokens = prompt length, decode tokens = cached rows
CASES = (
    ("prefill 1x1024", "prefill", 1, 1024),
    ("prefill 8x1024", "prefill", 8, 1024),
    ("decode b1 ctx 1024", "decode", 1, 1024),
    ("decode b8 ctx 1024", "decode", 8, 1024),
    ("decode b32 ctx 1024", "decode", 32, 1024),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (medians)")
    parser.add_argument("--threads", type=int, default=None, help="default: all cores")
    parser.add_argument("--model", choices=sorted(MODELS), default="embedded")
    parser.add_argument("--quantization", choices=["int8", "int4", "fp8"], default=None)
    parser.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=None,
        help="where --quantization fp8 writes (and reuses) its checkpoint; default "
        "bench/results/fp8-<model>",
    )
    parser.add_argument("--only", default="", help="only the cases whose name contains this")
    return parser.parse_args(argv)


def case_run(step: MlafxStep, kind: str, batch: int, tokens: int) -> Run:
    return step.prefill(batch, tokens) if kind == "prefill" else step.decode(batch, tokens)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cases = [c for c in CASES if args.only in c[0]]
    if not cases:
        raise SystemExit(f"no case matches --only {args.only!r}")
    blocks = max(blocks_needed(b, n + 1, BLOCK_SIZE) for _, _, b, n in cases)
    print(f"load average at start: {load_average()}", flush=True)
    if args.quantization == "fp8":
        directory = fp8_checkpoint(args.model, args.checkpoint_dir)
        llm = mlafx_fp8_llm(directory, num_kv_blocks=blocks, block_size=BLOCK_SIZE)
    else:
        llm = mlafx_llm(
            args.model, num_kv_blocks=blocks, block_size=BLOCK_SIZE, quantization=args.quantization
        )
    default = MlafxStep("default", llm.step_fn, llm.kv_caches, llm.config, BLOCK_SIZE)
    default.fill_caches()
    invariant = dataclasses.replace(default, name="invariant", batch_invariant=True)
    runs = {name: (case_run(default, *case), case_run(invariant, *case)) for name, *case in cases}
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in runs}
    with torch.inference_mode():
        for pair in runs.values():  # warm-up: each shape once in each mode
            for run in pair:
                run()
        for r in range(args.rounds):
            for name, pair in runs.items():
                for mode, run in enumerate(pair):
                    start = time.perf_counter()
                    run()
                    times[name][mode].append(time.perf_counter() - start)
            print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    weights = args.quantization or "bf16"
    print(f"model {args.model}, compiled, {weights} weights, {torch.get_num_threads()} threads, "
          f"medians of {args.rounds} interleaved rounds")  # fmt: skip
    print(f"{'case':<22}{'default':>12}{'invariant':>12}{'ratio':>8}")
    for name, (base, inv) in times.items():
        b, i = statistics.median(base), statistics.median(inv)
        print(f"{name:<22}{b * 1e3:>9.2f} ms{i * 1e3:>9.2f} ms{i / b:>7.2f}x")
    print(f"peak RSS {peak_rss_bytes() / 2**30:.2f} GiB; load average at end: {load_average()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
