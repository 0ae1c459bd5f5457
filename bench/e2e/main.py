"""End to end: prefill, decode and serving of mlafx against transformers, in one run.

    .venv/bin/mlafx bench e2e [--quick] [--threads 2] [--model embedded|full-width-1layer]
    .venv/bin/python bench/e2e/main.py --quick

Four engines on identical bf16 dummy weights (``bench/e2e/models.py``): mlafx's compiled
step, mlafx's reference path (``compile=False``), transformers' eager model, and
``torch.compile`` of it (its compile time is the first call at each shape, reported apart;
if it fails the error is reported). Prefill and decode are timed as forward steps (medians
over repeats), serving (TTFT/TPOT under a mixed workload, prefix-cache hits) through mlafx's
engine. Figures are read against this run's roofline (``bench/roofline.py``): decode as a
multiple of its weight-read floor at the read bandwidth measured just before and after its
timing, prefill as a fraction of the bf16 matmul rate measured the same way, with canonical
FLOPs (``bench/e2e/costs.py``). Prints tables and the issue's targets, writes JSON
(default bench/results/e2e.json) and PNG plots (bench/results/).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench import roofline as roofline_mod  # noqa: E402
from bench.e2e import costs, report  # noqa: E402
from bench.e2e.backends import MlafxStep, TransformersModel, blocks_needed  # noqa: E402
from bench.e2e.measure import (  # noqa: E402
    Timing,
    outside_peak_rss,
    peak_rss_bytes,
    reset_peak_rss,
    time_calls,
)
from bench.e2e.models import (  # noqa: E402
    MODELS,
    fp8_checkpoint,
    mlafx_fp8_llm,
    mlafx_llm,
    transformers_twin,
)
from bench.e2e.plan import DEFAULT, QUANTIZED, QUICK, Plan  # noqa: E402
from bench.e2e.serving import prefix_hit_ttft, run_mixed_workload  # noqa: E402
from mlafx.config import ModelConfig  # noqa: E402
from mlafx.models.deepseek import MLAForCausalLM  # noqa: E402
from mlafx.models.loader import build_model  # noqa: E402
from mlafx.runtime import LLM  # noqa: E402

RESULTS = ROOT / "bench" / "results"
BLOCK_SIZE = 16
_START = time.perf_counter()


def progress(message: str) -> None:
    print(f"[{time.perf_counter() - _START:6.0f} s] {message}", file=sys.stderr, flush=True)


def kv_blocks_for(plan: Plan, backend: str) -> int:
    """KV blocks an mlafx engine needs for ``backend``'s grid and the serving workload."""
    grid = plan.grids[backend]
    steps = max(blocks_needed(b, n + 1, BLOCK_SIZE) for b, n in [*grid.prefill, *grid.decode])
    return max(steps, plan.workload.blocks_needed(BLOCK_SIZE)) + 64


def bracketed(
    run: Callable[[], object], repeats: int, phase: str, plan: Plan
) -> tuple[Timing, dict[str, float]]:
    """``time_calls(run)`` between two probes of the rate that judges it: the read bandwidth
    for decode (its floor), the bf16 matmul rate for prefill (not on a quantized plan, which
    judges decode alone). Returns the timing and ``{"read_gbps_around" |
    "matmul_gflops_around": the probes' mean}``; the probes' buffers stay out of the peak RSS."""
    probe: Callable[[], float]
    if phase == "decode":
        megabytes = 64 if plan is QUICK else 512  # --quick: the quick roofline's size
        probe, key = (lambda: roofline_mod.read_gbps(megabytes)), "read_gbps_around"
    elif plan is not QUANTIZED:
        # --quick: the quick roofline's size (a 2048^3 bf16 product takes ~10 s on a CPU
        # without native bf16, and every prefill row is bracketed twice)
        size = 512 if plan is QUICK else 2048
        probe = lambda: roofline_mod.matmul_gflops(torch.bfloat16, size=size)  # noqa: E731
        key = "matmul_gflops_around"
    else:
        return time_calls(run, repeats=repeats), {}
    with outside_peak_rss():
        before = probe()
    timing = time_calls(run, repeats=repeats)
    with outside_peak_rss():
        after = probe()
    return timing, {key: (before + after) / 2}


def measure_grid(
    backend: str, engine: MlafxStep | TransformersModel, plan: Plan
) -> list[report.Row]:
    """Every prefill and decode point of this backend's grid; a failure is recorded in the
    row and ends this backend's grid (a broken ``torch.compile`` fails at every shape)."""
    rows: list[report.Row] = []
    repeats = plan.repeats_for(backend)
    for phase in ("prefill", "decode"):
        for batch, length in plan.grids[backend].points(phase):
            row: report.Row = {"backend": backend, "phase": phase, "batch": batch, "length": length}
            rows.append(row)
            what = f"{report.LABELS[backend]} {phase} batch {batch} x {length}"
            progress(f"{what} ...")
            try:
                run = getattr(engine, phase)(batch, length)
                # the matmul rate and the read bandwidth move over seconds (this Xeon VM: 19
                # and 27 GB/s minutes apart): a prefill timing is bracketed by the first, a
                # decode timing by the second
                timing, around = bracketed(run, repeats, phase, plan)
                row.update(around)
            except Exception as e:  # noqa: BLE001 -- reported, not fatal
                row["error"] = f"{type(e).__name__}: {e}".splitlines()[0]
                progress(f"{what}: failed ({row['error'][:200]})")
                return rows
            tokens = batch * (length if phase == "prefill" else 1)
            row.update(
                median_ms=timing.median_s * 1e3,
                first_ms=timing.first_s * 1e3,
                tokens_per_s=tokens / timing.median_s,
            )
            progress(f"{what}: {row['median_ms']:.1f} ms (first call {row['first_ms']:.0f} ms)")
    return rows


def add_roofline_figures(
    rows: list[report.Row], cfg: ModelConfig, roof: roofline_mod.Roofline, weights: torch.nn.Module
) -> None:
    """``floor_ms``/``x_floor`` on decode rows (the floor at the read bandwidth measured just
    before and after that row's timing; ``run_x_floor`` at the run's roofline), and
    ``gflops``/``matmul_fraction`` on prefill: the fraction of the bf16 matmul rate measured
    just before and after that row's timing (the rate here moves between ~0.7 and ~2 TFLOP/s
    over seconds), ``run_matmul_fraction`` that of the run's roofline."""
    for row in rows:
        if "error" in row:
            continue
        seconds = row["median_ms"] / 1e3
        if row["phase"] == "decode":
            nbytes = costs.decode_weight_bytes(weights, cfg, row["batch"])
            floor = nbytes / (row.get("read_gbps_around", roof.read_gbps) * 1e9)
            row.update(
                floor_ms=floor * 1e3,
                x_floor=seconds / floor,
                run_x_floor=seconds / (nbytes / (roof.read_gbps * 1e9)),
            )
        else:
            flops = costs.prefill_flops(cfg, row["batch"], row["length"])
            row.update(gflops=flops / seconds / 1e9)
            around = row.get("matmul_gflops_around", roof.bf16_matmul_gflops)
            row.update(
                matmul_fraction=row["gflops"] / around,
                run_matmul_fraction=row["gflops"] / roof.bf16_matmul_gflops,
            )


def serving_figures(llm: LLM, plan: Plan) -> dict[str, Any]:
    mixed = run_mixed_workload(llm, plan.workload)
    prefix = prefix_hit_ttft(llm, plan.prefix_prompt_len, plan.prefix_repeats)
    return {"mixed": mixed, "prefix": prefix}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model and a tiny grid")
    parser.add_argument(
        "--model",
        choices=sorted(MODELS),
        default=None,
        help="embedded (default), full-width-1layer (64 experts, 1 layer), tiny (--quick's)",
    )
    parser.add_argument("--threads", type=int, default=None, help="default: all cores")
    parser.add_argument(
        "--no-torch-compile", action="store_true", help="skip the torch.compile baseline"
    )
    parser.add_argument(
        "--json", type=Path, default=RESULTS / "e2e.json", help="where to write the results"
    )
    parser.add_argument("--plots", type=Path, default=RESULTS, help="directory for the PNGs")
    parser.add_argument(
        "--quantization",
        choices=["int8", "int4", "fp8"],
        default=None,
        help="mlafx's compiled engine alone with quantized weights, on the full "
        "DeepSeek-V2-Lite preset unless --model (decode against the quantized floor); fp8 "
        "writes the dummy weights as a DeepSeek block-FP8 checkpoint (--checkpoint-dir) and "
        "serves it from its bytes",
    )
    parser.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=None,
        help="where --quantization fp8 writes (and reuses) its checkpoint; default "
        "results/fp8-<model>",
    )
    return parser.parse_args(argv)


@dataclass
class Run:
    """What one run has gathered so far (the JSON is this, plus the plan and machine)."""

    plan: Plan
    roof: roofline_mod.Roofline
    rows: list[report.Row] = field(default_factory=list)
    serving: dict[str, Any] = field(default_factory=dict)
    startup_s: dict[str, float] = field(default_factory=dict)
    peak_rss_bytes: dict[str, int] = field(default_factory=dict)
    kv_bytes_per_token: dict[str, float | None] = field(default_factory=dict)
    checkpoint_bytes: int | None = None  # --quantization fp8: the files served
    kv_cache_bytes: int | None = None


def run_mlafx(run: Run) -> tuple[MLAForCausalLM, torch.nn.Module]:
    """mlafx compiled, then its reference path on transformers' copy of the same weights.
    Returns mlafx's model (the weights' shapes; the engines and their KV caches are dropped)
    and transformers' model."""
    plan = run.plan
    progress(f"building mlafx's engine on the {plan.model} model (dummy weights, bf16)")
    start = time.perf_counter()
    llm = mlafx_llm(plan.model, num_kv_blocks=kv_blocks_for(plan, "mlafx"), block_size=BLOCK_SIZE)
    run.startup_s["mlafx"] = time.perf_counter() - start
    run.kv_bytes_per_token["mlafx"] = costs.kv_bytes_per_token(llm.config, llm.dtype)
    # the compiled engine keeps only the layouts its step reads (a packed copy replaces each
    # linear weight): transformers' model gets the same seeded weights built anew
    progress("copying the same weights into transformers' model")
    hf_model = transformers_twin(build_model(llm.config, "bfloat16", "dummy"), plan.model)
    blocks = kv_blocks_for(plan, "mlafx_reference")
    reference = LLM.from_transformers(hf_model, num_kv_blocks=blocks, compile=False)
    for backend, engine in (("mlafx", llm), ("mlafx_reference", reference)):
        reset_peak_rss()
        step = MlafxStep(backend, engine.step_fn, engine.kv_caches, llm.config, BLOCK_SIZE)
        step.fill_caches()
        run.rows += measure_grid(backend, step, plan)
        if backend == "mlafx":  # the same compiled step in batch-invariant mode (its cost)
            invariant = dataclasses.replace(step, name="mlafx_invariant", batch_invariant=True)
            run.rows += measure_grid("mlafx_invariant", invariant, plan)
        progress(f"{report.LABELS[backend]}: mixed workload and prefix-cache TTFT")
        run.serving[backend] = serving_figures(engine, plan)
        run.peak_rss_bytes[backend] = peak_rss_bytes()
    return llm.model, hf_model


def run_quantized(run: Run, quantization: str, checkpoint_dir: Path | None) -> MLAForCausalLM:
    """mlafx's compiled engine with ``quantization`` alone; returns its model (the weights the
    step reads, for the floors). fp8: from a dummy checkpoint in DeepSeek's FP8 layout."""
    plan = run.plan
    blocks = kv_blocks_for(plan, "mlafx")
    if quantization == "fp8":
        progress(f"writing (or reusing) the {plan.model} model as an FP8 checkpoint")
        directory = fp8_checkpoint(plan.model, checkpoint_dir)
        run.checkpoint_bytes = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
        progress(f"building mlafx's engine on {directory} (its FP8 bytes)")
        reset_peak_rss()
        start = time.perf_counter()
        llm = mlafx_fp8_llm(directory, num_kv_blocks=blocks, block_size=BLOCK_SIZE)
    else:
        progress(
            f"building mlafx's {quantization} engine on the {plan.model} model (dummy weights)"
        )
        reset_peak_rss()
        start = time.perf_counter()
        llm = mlafx_llm(plan.model, num_kv_blocks=blocks, block_size=BLOCK_SIZE,
                        quantization=quantization)  # fmt: skip
    run.startup_s["mlafx"] = time.perf_counter() - start
    run.kv_cache_bytes = sum(c.numel() * c.element_size() for c in llm.kv_caches)
    run.peak_rss_bytes["mlafx_build"] = peak_rss_bytes()
    run.kv_bytes_per_token["mlafx"] = costs.kv_bytes_per_token(llm.config, llm.dtype)
    reset_peak_rss()
    step = MlafxStep("mlafx", llm.step_fn, llm.kv_caches, llm.config, BLOCK_SIZE)
    step.fill_caches()
    run.rows += measure_grid("mlafx", step, plan)
    run.serving["mlafx"] = serving_figures(llm, plan)
    run.peak_rss_bytes["mlafx"] = peak_rss_bytes()
    return llm.model


def run_transformers(
    run: Run, hf_model: torch.nn.Module, cfg: ModelConfig, with_compile: bool
) -> None:
    """transformers eager, then ``torch.compile`` of the same model object."""
    backends: list[tuple[str, Any]] = [("hf_eager", hf_model)]
    if with_compile:
        backends.append(("hf_compile", torch.compile(hf_model, dynamic=True)))
    for backend, model in backends:
        reset_peak_rss()
        dtype = hf_model.lm_head.weight.dtype
        engine = TransformersModel(backend, model, hf_model.config, cfg, dtype)
        if backend == "hf_eager":
            run.kv_bytes_per_token["transformers"] = engine.kv_bytes_per_token()
        run.rows += measure_grid(backend, engine, run.plan)
        run.peak_rss_bytes[backend] = peak_rss_bytes()
        if backend == "hf_compile":  # the first call at each shape compiles
            run.startup_s[backend] = sum(
                max(0.0, r["first_ms"] - r["median_ms"]) / 1e3
                for r in run.rows
                if r["backend"] == backend and "error" not in r
            )


def print_summary(
    run: Run, cfg: ModelConfig, floors: dict[int, float], weights: str
) -> list[report.Row]:
    """Everything measured, then the targets (returned)."""
    roof = run.roof
    print(
        f"\nmodel: {run.plan.model} ({cfg.num_hidden_layers} layers, {cfg.n_routed_experts} "
        f"experts, top-{cfg.num_experts_per_tok}, hidden {cfg.hidden_size}, vocab "
        f"{cfg.vocab_size}), {weights}, {roof.threads} threads, block size {BLOCK_SIZE}"
    )
    for b, nbytes in floors.items():
        print(
            f"decode weight-read floor, batch {b}: {nbytes / 1e6:.0f} MB of weights / "
            f"{roof.read_gbps:.1f} GB/s = {nbytes / (roof.read_gbps * 1e9) * 1e3:.1f} ms at "
            "the roofline's bandwidth (each decode row below: at the bandwidth around it)"
        )
    kv = run.kv_bytes_per_token
    print("KV cache per token: " + ", ".join(f"{k} {v:.0f} B" for k, v in kv.items()))
    report.print_phase(run.rows, "prefill")
    report.print_phase(run.rows, "decode")
    report.print_invariant_cost(run.rows)
    report.print_serving(run.serving)
    startup = run.startup_s
    print("\nstart-up: " + ", ".join(f"{report.LABELS[k]} {v:.1f} s" for k, v in startup.items()))
    print(
        "peak RSS per phase: "
        + ", ".join(
            f"{report.LABELS[k]} {v / 2**30:.2f} GiB" for k, v in run.peak_rss_bytes.items()
        )
    )
    if run.checkpoint_bytes is not None:
        # served from its own bytes (issue 25): peak RSS <= 1.15 x the files + KV cache + 1 GB
        limit = 1.15 * run.checkpoint_bytes + (run.kv_cache_bytes or 0) + 2**30
        peak = max(run.peak_rss_bytes.values())
        verdict = "met" if peak <= limit else "NOT met"
        print(
            f"peak RSS {peak / 2**30:.2f} GiB vs 1.15 x {run.checkpoint_bytes / 2**30:.2f} GiB of "
            f"checkpoint + {(run.kv_cache_bytes or 0) / 2**30:.2f} GiB KV cache + 1 GiB = "
            f"{limit / 2**30:.2f} GiB: {verdict}"
        )
    # quantized: within 1.3x of the quantized floor (issue 18); bf16 1.5x
    floor_goal = 1.5 if weights == "bf16" else 1.3
    checks = report.targets(run.rows, run.serving, run.plan.target, floor_goal)
    report.print_targets(checks, run.plan.target)
    return checks


def warn_if_busy(load: float, threads: int) -> None:
    """Other jobs on the cores this run's threads need make every figure slower (threads
    wait for a core at each parallel region): say so up front, next to the figures."""
    cores = os.cpu_count() or 1
    if load > 0.5 and threads + load > cores:
        print(
            f"warning: the machine is busy (load average {load:.2f} on {cores} cores, "
            f"{threads} threads wanted): figures will be inflated; rerun when it is quiet",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", module=r"torch\._(dynamo|inductor)")
    plan = QUICK if args.quick else QUANTIZED if args.quantization else DEFAULT
    if args.model:
        plan = dataclasses.replace(plan, model=args.model)
    if args.threads:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    progress(f"measuring the roofline (load average {load_before[0]:.2f})")
    warn_if_busy(load_before[0], torch.get_num_threads())
    # quantized runs compare decode with their floor, not prefill with the bf16 matmul rate
    # (which is ~1 GFLOP/s per core on a CPU without native bf16: a 2048^3 product takes 10 s)
    roof = roofline_mod.measure(quick=args.quick, matmul_size=512 if args.quantization else 2048)
    print(
        f"roofline ({roof.threads} threads): read {roof.read_gbps:.1f} GB/s, bf16 matmul "
        f"{roof.bf16_matmul_gflops:.0f} GFLOP/s, fp32 matmul {roof.fp32_matmul_gflops:.0f} GFLOP/s"
    )
    run = Run(plan, roof)
    if args.quantization:
        weights = run_quantized(run, args.quantization, args.checkpoint_dir)
        cfg = weights.config
    else:
        weights, hf_model = run_mlafx(run)
        cfg = weights.config
        run_transformers(run, hf_model, cfg, with_compile=not args.no_torch_compile)

    add_roofline_figures(run.rows, cfg, roof, weights)
    batches = sorted({r["batch"] for r in run.rows if r["phase"] == "decode"})
    floors = {b: costs.decode_weight_bytes(weights, cfg, b) for b in batches}
    checks = print_summary(run, cfg, floors, args.quantization or "bf16")
    result = {
        "plan": dataclasses.asdict(plan),
        "machine": {
            "threads": roof.threads,
            "cpu": platform.processor() or platform.machine(),
            "load_average_start": load_before,
            "load_average_end": os.getloadavg(),
            "torch": torch.__version__,
        },
        "roofline": roof.as_dict(),
        "decode_weight_bytes": floors,
        **{k: v for k, v in dataclasses.asdict(run).items() if k not in ("plan", "roof")},
        "targets": checks,
        "wall_s": time.perf_counter() - _START,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    from bench.e2e.plots import draw_plots

    title = f"{plan.model}, {args.quantization or 'bf16'}, {roof.threads} threads"
    pngs = draw_plots(run.rows, args.plots, plan.target, title)
    print(f"\nwrote {args.json}, " + ", ".join(str(p) for p in pngs))
    print(
        f"total {result['wall_s']:.0f} s; load average (1 min) {load_before[0]:.2f} at the "
        f"start, {os.getloadavg()[0]:.2f} at the end"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
