"""Host cost of one step's inputs: ``build_step_inputs`` with and without the key rows.

    .venv/bin/python bench/host_step_inputs.py [--batch 32] [--context 8192] [--repeats 25]

The key rows (``key_seq_ids``/``key_positions``, one per cached token) are built only for
the reference model; a compiled step's inputs grow with the batch and the new tokens (plus
one block id per cached block). Two steps: ``--batch`` decodes over ``--context`` cached
tokens each, and the same with one sequence replaced by a 512-token chunk over half the
context. Reports median build time and the TP wire message (``step_to_wire`` pickled, what
the driver sends every rank) with and without key rows, their ratios, and /proc/loadavg.
One thread: the host side is Python and small tensor ops.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.roofline import median_seconds  # noqa: E402
from mlafx.models.step import SequenceSpan, build_step_inputs  # noqa: E402
from mlafx.parallel.wire import dumps, step_to_wire  # noqa: E402

BLOCK_SIZE = 16
THRESHOLD = 171.0  # the V2/V3 cost rule's at equal efficiencies (the path choice is O(batch))


def span(seq: int, context: int, new: int, blocks_per_seq: int) -> SequenceSpan:
    first = 1 + seq * blocks_per_seq
    blocks = list(range(first, first + -(-(context + new) // BLOCK_SIZE)))
    return SequenceSpan([(31 * seq + i) % 1000 for i in range(new)], context, context + new, blocks)


def steps(batch: int, context: int) -> dict[str, list[SequenceSpan]]:
    per_seq = -(-(context + 1) // BLOCK_SIZE)
    decodes = [span(b, context, 1, per_seq) for b in range(batch)]
    chunk = span(batch - 1, context // 2, 512, per_seq)
    return {
        f"decode {batch} x {context}": decodes,
        f"{batch - 1} decodes x {context} + 512 new over {context // 2}": decodes[:-1] + [chunk],
    }


def measure(spans: list[SequenceSpan], key_rows: bool, repeats: int) -> dict[str, float]:
    def build():  # type: ignore[no-untyped-def]
        return build_step_inputs(spans, BLOCK_SIZE, THRESHOLD, key_rows=key_rows)

    inputs = build()

    def wire() -> bytes:
        meta = inputs.meta
        return dumps(step_to_wire(inputs.input_ids, inputs.positions, meta, inputs.logits_indices))

    return {
        "key_rows": inputs.meta.key_seq_ids.numel(),
        "build_ms": median_seconds(build, repeats=repeats) * 1e3,
        "wire_ms": median_seconds(wire, repeats=repeats) * 1e3,
        "wire_mb": len(wire()) / 1e6,
    }


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=25)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    result: dict[str, object] = {"loadavg_before": loadavg()}
    for name, spans in steps(args.batch, args.context).items():
        full = measure(spans, True, args.repeats)
        lean = measure(spans, False, args.repeats)
        result[name] = {"with_key_rows": full, "without": lean}
        print(
            f"{name}: build {full['build_ms']:.2f} -> {lean['build_ms']:.2f} ms "
            f"({full['build_ms'] / lean['build_ms']:.1f}x), wire {full['wire_mb']:.2f} -> "
            f"{lean['wire_mb']:.2f} MB, {full['wire_ms']:.2f} -> {lean['wire_ms']:.2f} ms "
            f"({full['wire_ms'] / lean['wire_ms']:.1f}x); K = {full['key_rows']} -> 0"
        )
    result["loadavg_after"] = loadavg()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
