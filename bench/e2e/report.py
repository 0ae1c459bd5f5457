"""The printed tables and the issue's targets, computed from the result rows.

A row is a dict: ``backend``, ``phase`` ("prefill" | "decode"), ``batch``, ``length``
(prompt length or context), then ``median_ms``, ``first_ms``, ``tokens_per_s`` and the
roofline figures (``x_floor`` for decode, ``matmul_fraction`` for prefill), or ``error``.
"""

from __future__ import annotations

from typing import Any

Row = dict[str, Any]

LABELS = {
    "mlafx": "mlafx compiled",
    "mlafx_invariant": "mlafx batch-invariant",
    "mlafx_build": "mlafx load + compile",
    "mlafx_reference": "mlafx reference",
    "hf_eager": "transformers eager",
    "hf_compile": "transformers torch.compile",
}


def find(rows: list[Row], backend: str, phase: str, batch: int, length: int) -> Row | None:
    for row in rows:
        if (row["backend"], row["phase"], row["batch"], row["length"]) == (
            backend,
            phase,
            batch,
            length,
        ) and "error" not in row:
            return row
    return None


def print_phase(rows: list[Row], phase: str) -> None:
    """One table per phase: a line per (backend, batch, length), with the speed-up over
    transformers eager at the same point."""
    extra = "x floor" if phase == "decode" else "of matmul"
    length = "context" if phase == "decode" else "prompt"
    header = (
        f"{'backend':<27} {'batch':>5} {length:>7} {'ms':>10} {'tokens/s':>10} "
        f"{extra:>9} {'vs eager':>9}"
    )
    if phase == "decode":
        header += f" {'read GB/s':>10}"
    print(f"\n{phase}")
    if phase == "prefill":
        print("(of matmul: of the bf16 matmul rate measured just before and after each row)")
    else:
        print("(x floor: the step's weight bytes at the read bandwidth measured just before and")
        print(" after each row, in the last column; the JSON's run_x_floor uses the roofline's)")
    print(header)
    print("-" * len(header))
    for row in (r for r in rows if r["phase"] == phase):
        where = f"{LABELS[row['backend']]:<27} {row['batch']:>5} {row['length']:>7}"
        if "error" in row:
            print(f"{where}  failed: {row['error'][:80]}")
            continue
        roof = (
            f"{row['x_floor']:>8.2f}x" if phase == "decode" else f"{row['matmul_fraction']:>9.0%}"
        )
        eager = find(rows, "hf_eager", phase, row["batch"], row["length"])
        vs = f"{eager['median_ms'] / row['median_ms']:>8.1f}x" if eager else f"{'':>9}"
        read = f" {row['read_gbps_around']:>10.1f}" if "read_gbps_around" in row else ""
        print(f"{where} {row['median_ms']:>10.1f} {row['tokens_per_s']:>10.1f} {roof} {vs}{read}")


def print_invariant_cost(rows: list[Row]) -> None:
    """Batch-invariant mode against the default, at each point both measured."""
    costs = []
    for row in rows:
        if row["backend"] != "mlafx_invariant" or "error" in row:
            continue
        default = find(rows, "mlafx", row["phase"], row["batch"], row["length"])
        if default is not None and "error" not in default:
            ratio = row["median_ms"] / default["median_ms"]
            costs.append(f"{row['phase']} {row['batch']}x{row['length']} {ratio:.2f}x")
    if costs:
        print("\nbatch-invariant mode, time vs the default: " + ", ".join(costs))


def targets(
    rows: list[Row], serving: dict[str, Any], target: tuple[int, int], floor_goal: float = 1.5
) -> list[Row]:
    """The issue's targets at ``target`` (batch, prompt length): value, goal, met
    (``floor_goal``: the most decode may take as a multiple of its weight-read floor)."""
    batch, length = target
    ours = find(rows, "mlafx", "decode", batch, length)
    eager = find(rows, "hf_eager", "decode", batch, length)
    compiled = find(rows, "hf_compile", "decode", batch, length)
    prefill = find(rows, "mlafx", "prefill", batch, length)
    prefix = serving.get("mlafx", {}).get("prefix")

    def ratio(a: Row | None, b: Row | None) -> float | None:
        return None if a is None or b is None else b["median_ms"] / a["median_ms"]

    checks = [
        ("decode vs transformers eager", ratio(ours, eager), 10.0, "x", True),
        ("decode vs torch.compile", ratio(ours, compiled), 2.0, "x", True),
        ("decode / weight-read floor", ours and ours["x_floor"], floor_goal, "x", False),
        ("prefill / bf16 matmul rate", prefill and prefill["matmul_fraction"], 0.70, "", True),
        ("prefix-hit TTFT speed-up", prefix and prefix["speedup"], 3.0, "x", True),
    ]
    return [
        {
            "target": name,
            "value": value,
            "goal": (">= " if at_least else "<= ") + (f"{goal:.0%}" if not unit else f"{goal}x"),
            "met": None if value is None else (value >= goal if at_least else value <= goal),
        }
        for name, value, goal, unit, at_least in checks
    ]


def print_targets(checks: list[Row], target: tuple[int, int]) -> None:
    print(f"\ntargets (batch {target[0]}, prompts of {target[1]} tokens)")
    for c in checks:
        if c["value"] is None:
            shown, verdict = "not measured", ""
        else:
            shown = f"{c['value']:.0%}" if "%" in c["goal"] else f"{c['value']:.2f}x"
            verdict = "met" if c["met"] else "MISSED"
        print(f"  {c['target']:<30} {shown:>12}  (goal {c['goal']})  {verdict}")


def print_serving(serving: dict[str, Any]) -> None:
    print("\nserving (mlafx engine: scheduler, cache and sampler included)")
    for backend, figures in serving.items():
        mixed, prefix = figures["mixed"], figures["prefix"]
        print(
            f"  {LABELS[backend]:<17} mixed workload ({mixed['requests']} requests): TTFT "
            f"median {mixed['ttft_median_ms']:.1f} ms, p90 {mixed['ttft_p90_ms']:.1f} ms; TPOT "
            f"median {mixed['tpot_median_ms']:.1f} ms, p90 {mixed['tpot_p90_ms']:.1f} ms"
        )
        print(
            f"  {'':<17} {prefix['prompt_len']}-token prompt: cold TTFT "
            f"{prefix['cold_ttft_ms']:.1f} ms, prefix hit ({prefix['cached_tokens']} cached) "
            f"{prefix['hit_ttft_ms']:.1f} ms ({prefix['speedup']:.1f}x)"
        )
