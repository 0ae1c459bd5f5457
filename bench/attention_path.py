"""Does the host's attention-path rule pick the faster path? Timed on the compiled step.

    .venv/bin/python bench/attention_path.py [--repeats 5] [--cases 0:256,2048:128,...]

For each case (C cached rows, q new tokens, one sequence) the embedded default's compiled
step runs with the path forced to absorbed and to split (best of ``--repeats`` alternating
runs each), beside the path the rule (``mlafx.models.attention_path``) picks from this
host's measured kernel costs (``mlafx.runtime.attention_costs``). The default cases are the
design map's break-even list plus two either side of the rule's threshold. A case whose two
times are within 5% is a tie: either choice is right. Writes bench/results/attention_path.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mlafx.compile.compiled_step import compile_step  # noqa: E402
from mlafx.config import EMBEDDED_DEFAULT_MODEL, EMBEDDED_DEFAULT_OVERRIDES  # noqa: E402
from mlafx.kernels import cpu_isa  # noqa: E402
from mlafx.models.attention_path import AttentionPath, choose_path, split_threshold  # noqa: E402
from mlafx.models.step import SequenceSpan, build_step_inputs  # noqa: E402
from mlafx.runtime import LLM  # noqa: E402
from mlafx.runtime.attention_costs import attention_path_costs  # noqa: E402

DESIGN_CASES = [(0, 256), (0, 1024), (1024, 512), (2048, 128), (2048, 32)]
TIE = 0.05
BLOCK_SIZE = 16


def _cases(text: str | None, threshold: float) -> list[tuple[int, int]]:
    if text:
        return [(int(c), int(q)) for c, q in (pair.split(":") for pair in text.split(","))]
    around = (
        [] if threshold > 4096 else [(1024, max(2, int(threshold / 2))), (1024, int(threshold * 2))]
    )
    return DESIGN_CASES + around


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--cases", help="C:q pairs, comma-separated")
    parser.add_argument(
        "--json", type=Path, default=ROOT / "bench" / "results" / "attention_path.json"
    )
    args = parser.parse_args(argv)
    llm = LLM(
        EMBEDDED_DEFAULT_MODEL,
        load_format="dummy",
        hf_overrides=EMBEDDED_DEFAULT_OVERRIDES,
        block_size=BLOCK_SIZE,
        num_kv_blocks=8,
        progress=False,
        compile=False,  # the reference model, compiled below
    )
    cfg, dtype = llm.model.config, llm.kv_caches[0].dtype
    costs = attention_path_costs(cfg, dtype)
    threshold = split_threshold(cfg, costs)
    compiled = compile_step(llm.model, BLOCK_SIZE)  # cached under default_cache_dir()
    cases = _cases(args.cases, threshold)
    num_blocks = 1 + max(-(-(c + q) // BLOCK_SIZE) for c, q in cases)
    gen = torch.Generator().manual_seed(0)
    caches = [
        torch.randn(num_blocks, BLOCK_SIZE, width, generator=gen).to(dtype)
        for width in cfg.cache_widths
    ]
    results = []
    print(
        f"embedded default, {dtype}, {torch.get_num_threads()} threads, kernels "
        f"{cpu_isa()}: split above {threshold:.0f} new tokens (costs per MAC: absorbed "
        f"{costs.absorbed * 1e12:.1f} ps, decompressed {costs.decompressed * 1e12:.1f} ps, "
        f"gemm {costs.gemm * 1e12:.1f} ps)"
    )
    for context, new in cases:
        times = {path: float("inf") for path in AttentionPath}
        ids = [(7 * i + 3) % cfg.vocab_size for i in range(new)]
        blocks = list(range(1, 1 + -(-(context + new) // BLOCK_SIZE)))
        for _ in range(args.repeats):
            for path in AttentionPath:
                span = SequenceSpan(ids, context, context + new, blocks, path=path)
                inputs = build_step_inputs([span], BLOCK_SIZE, key_rows=False)
                step_args = (inputs.input_ids, inputs.positions, caches, inputs.meta)
                with torch.inference_mode():
                    start = time.perf_counter()
                    compiled(*step_args, inputs.logits_indices)
                    times[path] = min(times[path], time.perf_counter() - start)
        chosen = choose_path(context, new, threshold)
        absorbed, split = times[AttentionPath.ABSORBED], times[AttentionPath.SPLIT]
        faster = AttentionPath.ABSORBED if absorbed <= split else AttentionPath.SPLIT
        tie = abs(absorbed - split) <= TIE * min(absorbed, split)
        verdict = "tie" if tie else ("right" if chosen is faster else "WRONG")
        results.append(
            {
                "context": context,
                "new_tokens": new,
                "absorbed_ms": absorbed * 1e3,
                "split_ms": split * 1e3,
                "chosen": chosen.value,
                "faster": faster.value,
                "verdict": verdict,
            }
        )
        print(
            f"  C={context:5d} q={new:5d}: absorbed {absorbed * 1e3:8.1f} ms, split "
            f"{split * 1e3:8.1f} ms -> rule picks {chosen.value:8s} ({verdict})"
        )
    record = {
        "cpu_isa": cpu_isa(),
        "threads": torch.get_num_threads(),
        "dtype": str(dtype),
        "split_threshold": threshold,
        "costs_per_mac_s": vars(costs),
        "cases": results,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(record, indent=2))
    return 1 if any(r["verdict"] == "WRONG" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
