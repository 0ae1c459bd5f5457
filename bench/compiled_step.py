"""Compiled step vs the reference path: one decode step of the embedded default.

    .venv/bin/python bench/compiled_step.py [--batch 8] [--context 1024] [--quick]

The reference path (like transformers) decompresses every cached latent row of every layer
each step; the compiled step (capture -> MLA passes -> AOTInductor) attends over the latent
cache with the absorbed kernel. Reports both medians, the speed-up, and the compile time
cold (empty package cache) and warm (package cached on disk).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.roofline import median_seconds  # noqa: E402
from mlafx.compile.compiled_step import compile_step  # noqa: E402
from mlafx.config import EMBEDDED_DEFAULT_MODEL, EMBEDDED_DEFAULT_OVERRIDES  # noqa: E402
from mlafx.models.step import SequenceSpan, StepFn, build_step_inputs  # noqa: E402
from mlafx.runtime import LLM  # noqa: E402


def decode_spans(batch: int, context: int, block_size: int, vocab: int):  # type: ignore[no-untyped-def]
    per_seq = -(-(context + 1) // block_size)
    spans = [
        SequenceSpan(
            [(b * 31 + 7) % vocab],
            context,
            context + 1,
            list(range(1 + b * per_seq, 1 + (b + 1) * per_seq)),
        )
        for b in range(batch)
    ]
    return spans, 1 + batch * per_seq


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--quick", action="store_true", help="batch 2, context 128")
    parser.add_argument(
        "--json", type=Path, default=ROOT / "bench" / "results" / "compiled_step.json"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.batch, args.context = 2, 128
    spans, num_blocks = decode_spans(args.batch, args.context, args.block_size, 102400)
    llm = LLM(
        EMBEDDED_DEFAULT_MODEL,
        load_format="dummy",
        hf_overrides=EMBEDDED_DEFAULT_OVERRIDES,
        block_size=args.block_size,
        num_kv_blocks=num_blocks,
        progress=False,
        compile=False,  # the reference model, compiled below
    )
    gen = torch.Generator().manual_seed(0)
    for cache in llm.kv_caches:  # random context rows
        cache.copy_(torch.randn(cache.shape, generator=gen).to(cache.dtype))

    def step_args(step: StepFn) -> tuple:
        """The step's arguments; the key rows only for a step that reads them."""
        inputs = build_step_inputs(spans, args.block_size, key_rows=step.reads_key_rows)
        meta = inputs.meta
        return (inputs.input_ids, inputs.positions, llm.kv_caches, meta, inputs.logits_indices)

    with tempfile.TemporaryDirectory() as cache_dir:
        start = time.perf_counter()
        compiled = compile_step(llm.model, args.block_size, cache_dir=Path(cache_dir))
        cold = time.perf_counter() - start
        start = time.perf_counter()
        compile_step(llm.model, args.block_size, cache_dir=Path(cache_dir))
        warm = time.perf_counter() - start
        reference_args, compiled_args = step_args(llm.model), step_args(compiled)
        with torch.inference_mode():
            reference_s = median_seconds(lambda: llm.model(*reference_args), repeats=5)
            compiled_s = median_seconds(lambda: compiled(*compiled_args), repeats=9)
    result = {
        "batch": args.batch,
        "context": args.context,
        "block_size": args.block_size,
        "threads": torch.get_num_threads(),
        "reference_ms": reference_s * 1e3,
        "compiled_ms": compiled_s * 1e3,
        "speedup": reference_s / compiled_s,
        "compile_cold_s": cold,
        "compile_warm_s": warm,
    }
    print(
        f"decode step, embedded default, batch {args.batch}, context {args.context}, "
        f"{result['threads']} threads: reference {result['reference_ms']:.1f} ms, compiled "
        f"{result['compiled_ms']:.1f} ms ({result['speedup']:.1f}x); compile cold "
        f"{cold:.1f} s, warm {warm:.1f} s"
    )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
