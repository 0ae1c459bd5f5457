"""Tensor parallelism: prefill and decode throughput of the embedded default at TP=1 vs TP=N.

    .venv/bin/python bench/tensor_parallel.py [--tp 2] [--prefill 512] [--batch 8]
        [--decode 32] [--repeats 3] [--no-compile]

Each engine serves through ``mlafx.LLM`` (TP=1: one process, all cores; TP=N: N worker
processes, cores split evenly, driven by this one). Prefill: one fresh prompt of
``--prefill`` tokens to its first token (prefix caching off), best of ``--repeats``.
Decode: ``--batch`` prompts of 16 tokens, then ``--decode`` more tokens each; decode tokens
per second = batch * (decode - 1) / (time(decode tokens) - time(1 token)), best of repeats.
Prints one JSON object with both engines' figures and the TP=N / TP=1 ratios.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mlafx.config import EMBEDDED_DEFAULT_MODEL, EMBEDDED_DEFAULT_OVERRIDES  # noqa: E402
from mlafx.runtime import LLM, SamplingParams  # noqa: E402


def best_seconds(llm: LLM, prompts: list[list[int]], max_tokens: int, repeats: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        llm.generate(prompts, params)
        times.append(time.perf_counter() - start)
    return min(times)


def measure(tp: int, args: argparse.Namespace) -> dict[str, float]:
    start = time.perf_counter()
    llm = LLM(
        EMBEDDED_DEFAULT_MODEL,
        load_format="dummy",
        hf_overrides=EMBEDDED_DEFAULT_OVERRIDES,
        dtype="bfloat16",
        num_kv_blocks=256,
        enable_prefix_caching=False,
        compile=args.compile,
        progress=False,
        tensor_parallel_size=tp,
    )
    start_s = time.perf_counter() - start
    try:
        prefill = [[(13 * i + 5) % 1000 for i in range(args.prefill)]]
        best_seconds(llm, prefill, 1, 1)  # warm-up
        prefill_s = best_seconds(llm, prefill, 1, args.repeats)
        batch = [[(7 * b + 3 * i + 1) % 1000 for i in range(16)] for b in range(args.batch)]
        one = best_seconds(llm, batch, 1, args.repeats)
        many = best_seconds(llm, batch, args.decode, args.repeats)
    finally:
        llm.close()
    return {
        "start_s": start_s,
        "prefill_tokens_per_s": args.prefill / prefill_s,
        "decode_tokens_per_s": args.batch * (args.decode - 1) / (many - one),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--prefill", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args()
    one, many = measure(1, args), measure(args.tp, args)
    report = {
        "tp1": one,
        f"tp{args.tp}": many,
        "prefill_ratio": many["prefill_tokens_per_s"] / one["prefill_tokens_per_s"],
        "decode_ratio": many["decode_tokens_per_s"] / one["decode_tokens_per_s"],
    }
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
