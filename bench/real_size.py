"""Real-size models: engine memory against the weights, compile time against the layer count.

    .venv/bin/mlafx bench real-size [--memory-layers 2 4] [--compile-layers 2 8 27] [--quick]
                                    [--quantization int8|int4]

memory   DeepSeek-V2-Lite at its real widths (64 experts, 6 active; bf16, dummy weights),
         truncated to N layers, each N in a fresh process with a fresh compile cache shared
         by the N's of one run: peak RSS while building and compiling the engine against the
         weights' bytes (target: at most weights + 2 GB), and the serving engine's RSS after
         a short generation against ``1.15 x (weights + KV cache) + 1 GB``.
compile  cold compile of the compiled step (fresh cache) at small widths for each N, and the
         ratio of the largest N to the smallest (target: at most 1.5); then a warm start of
         the embedded demo (packages cached: target at most 2 s besides loading weights).
Each child prints one JSON line; the parent prints a table and writes ``--json``.
``--quick``: memory at 2 and 4 layers, compile at 2 and 8 layers. ``--compile-layers`` with no
value skips the compile rows (the test runs the memory rows so).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30
# Small widths for the compile-time rows (the DeepSeek-V2-Lite shape, scaled down).
SMALL = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
}
NUM_KV_BLOCKS = 256


def _status(field: str) -> int:
    """A /proc/self/status memory field in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def child_memory(layers: int, cache_dir: str, quantization: str | None) -> dict[str, object]:
    import mlafx
    import mlafx.compile.compiled_step as compiled_step
    from mlafx.config import ModelConfig
    from mlafx.config.memory import kv_bytes_per_token, weight_bytes

    overrides = {"num_hidden_layers": layers}
    cfg = ModelConfig.from_model("deepseek-v2-lite", overrides)
    loaded: dict[str, float] = {}
    compile_step = compiled_step.compile_step

    def timed_compile_step(*args, **kwargs):  # type: ignore[no-untyped-def]
        # the weights are loaded (and quantized) when the engine starts compiling
        loaded.update(peak=_status("VmHWM"), seconds=time.perf_counter() - start)
        return compile_step(*args, **kwargs)

    compiled_step.compile_step = timed_compile_step
    start = time.perf_counter()
    llm = mlafx.LLM(
        "deepseek-v2-lite",
        load_format="dummy",
        hf_overrides=overrides,
        dtype="bfloat16",
        quantization=quantization,
        num_kv_blocks=NUM_KV_BLOCKS,
        compile_cache_dir=cache_dir,
        progress=False,
    )
    build_s = time.perf_counter() - start
    peak = _status("VmHWM")
    outs = llm.generate([[1, 2, 3, 4, 5, 6, 7, 8]], mlafx.SamplingParams(max_tokens=4))
    weights = weight_bytes(cfg, "bfloat16", quantization)
    kv = kv_bytes_per_token(cfg, "bfloat16") * NUM_KV_BLOCKS * llm.block_size
    rss = _status("VmRSS")
    return {
        "layers": layers,
        "quantization": quantization,
        "load_s": loaded["seconds"],
        "load_peak_rss_gib": loaded["peak"] / GIB,
        "weights_gib": weights / GIB,
        "kv_gib": kv / GIB,
        "build_and_compile_s": build_s,
        "compile_s": llm.compiled.compile_seconds,
        "peak_rss_gib": peak / GIB,
        "peak_limit_gib": (weights + 2 * GIB) / GIB,
        "engine_rss_gib": rss / GIB,
        "engine_limit_gib": (1.15 * (weights + kv) + GIB) / GIB,
        "tokens": outs[0].outputs[0].token_ids,
    }


def child_compile(layers: int, cache_dir: str) -> dict[str, object]:
    from mlafx.compile.compiled_step import compile_step
    from mlafx.config import ModelConfig
    from mlafx.models.loader import build_model

    cfg = ModelConfig.from_model("deepseek-v2-lite", {**SMALL, "num_hidden_layers": layers})
    model = build_model(cfg, "bfloat16", "dummy", progress=False)
    start = time.perf_counter()
    step = compile_step(model, 16, cache_dir=Path(cache_dir))
    return {
        "layers": layers,
        "kinds": [p.kind.name for p in step.packages],
        "cold_compile_s": time.perf_counter() - start,
    }


def child_warm_demo(cache_dir: str) -> dict[str, object]:
    import mlafx
    from mlafx.config import EMBEDDED_DEFAULT_MODEL, EMBEDDED_DEFAULT_OVERRIDES

    def build() -> mlafx.LLM:
        return mlafx.LLM(
            EMBEDDED_DEFAULT_MODEL,
            load_format="dummy",
            hf_overrides=EMBEDDED_DEFAULT_OVERRIDES,
            compile_cache_dir=cache_dir,
            num_kv_blocks=64,
            progress=False,
        )

    cold = build().compiled.compile_seconds
    start = time.perf_counter()
    warm = build()
    return {
        "cold_compile_s": cold,
        "warm_compile_s": warm.compiled.compile_seconds,  # package loads, weights handed over
        "warm_engine_s": time.perf_counter() - start,  # besides: dummy weights, the cache
    }


def _run_child(args: list[str]) -> dict[str, object]:
    cmd = [sys.executable, __file__, "--child", *args]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--memory-layers", type=int, nargs="*", default=[2, 4])
    parser.add_argument("--compile-layers", type=int, nargs="*", default=[2, 8, 27])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--quantization",
        choices=["int8", "int4"],
        default=None,
        help="the memory rows with quantized weights (e.g. --memory-layers 27: the full preset)",
    )
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "real_size.json")
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        kind, *rest = args.child
        if kind == "memory":
            result = child_memory(int(rest[0]), rest[1], rest[2] if len(rest) > 2 else None)
        elif kind == "compile":
            result = child_compile(int(rest[0]), rest[1])
        else:
            result = child_warm_demo(rest[0])
        print(json.dumps(result))
        return 0
    if args.quick:
        args.memory_layers, args.compile_layers = [2, 4], [2, 8]

    print(f"load average: {Path('/proc/loadavg').read_text().split()[:3]}")
    memory, compile_rows = [], []
    with tempfile.TemporaryDirectory() as shared:
        for layers in args.memory_layers:
            quantized = [args.quantization] if args.quantization else []
            row = _run_child(["memory", str(layers), shared, *quantized])
            memory.append(row)
            print(
                f"V2-Lite widths, {layers} layers, {args.quantization or 'bf16'}: weights "
                f"{row['weights_gib']:.2f} GiB, loaded in {row['load_s']:.1f} s (peak RSS "
                f"{row['load_peak_rss_gib']:.2f} GiB), "
                f"peak RSS {row['peak_rss_gib']:.2f} GiB (limit {row['peak_limit_gib']:.2f}), "
                f"engine RSS {row['engine_rss_gib']:.2f} GiB "
                f"(limit {row['engine_limit_gib']:.2f}), "
                f"engine built in {row['build_and_compile_s']:.1f} s "
                f"(compile step {row['compile_s']:.1f} s)"
            )
    ratio, warm = None, None
    if args.compile_layers:
        for layers in args.compile_layers:
            with tempfile.TemporaryDirectory() as fresh:
                row = _run_child(["compile", str(layers), fresh])
            compile_rows.append(row)
            print(
                f"small widths, {layers} layers: cold compile {row['cold_compile_s']:.1f} s "
                f"(layer kinds {row['kinds']})"
            )
        ratio = compile_rows[-1]["cold_compile_s"] / compile_rows[0]["cold_compile_s"]
        print(
            f"cold compile {compile_rows[-1]['layers']} / {compile_rows[0]['layers']} layers: "
            f"{ratio:.2f}x (target <= 1.5)"
        )
        with tempfile.TemporaryDirectory() as fresh:
            warm = _run_child(["warm", fresh])
        print(
            f"embedded demo: cold compile {warm['cold_compile_s']:.1f} s, warm start "
            f"{warm['warm_compile_s']:.2f} s of package loading ({warm['warm_engine_s']:.1f} s "
            "for the whole engine with its dummy weights)"
        )
    result = {"memory": memory, "compile": compile_rows, "compile_ratio": ratio, "warm": warm}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    os.environ.setdefault("OMP_NUM_THREADS", str(os.cpu_count() or 1))
    sys.exit(main())
