"""Artifacts per format: size, export time, and load time and time to first token from a
cold process, next to building and compiling the same model from scratch.

    .venv/bin/python bench/export.py [--model tiny|embedded] [--threads N]
    .venv/bin/mlafx bench export --model embedded

Every serving figure comes from a fresh Python process (imports included), fed one prompt
and asked for one token, so "first token" is the whole cold start: start -> import mlafx ->
load (hash checks, weights, package / program / session) -> prefill -> token. "compile
from scratch" is ``LLM(..., compile=True)`` with empty mlafx and inductor caches; "compiled,
cached package" is the same with the package already on disk (what a second engine start
costs without an artifact). ``tiny`` is the tests' model; ``embedded`` the demo's
(DeepSeek-V2-Lite shrunk to 2 layers and 4 experts), both float32 so ONNX takes part.
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
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mlafx.config import EMBEDDED_DEFAULT_MODEL, EMBEDDED_DEFAULT_OVERRIDES  # noqa: E402
from tests.tiny_models import TINY_OVERRIDES  # noqa: E402

MODELS = {"tiny": TINY_OVERRIDES, "embedded": EMBEDDED_DEFAULT_OVERRIDES}
FORMATS = ("aoti", "pt2", "onnx")
PROMPT = [(17 * i + 3) % 200 for i in range(64)]

# Cold process: time from its first line to each milestone (seconds), printed as JSON.
CHILD = """
import time
start = time.perf_counter()
import json, sys, torch
torch.set_num_threads(int(sys.argv[3]))
import mlafx
imported = time.perf_counter()
source, kind = sys.argv[1], sys.argv[2]
prompt = json.loads(sys.argv[4])
if kind == "artifact":
    llm = mlafx.LLM.from_artifact(source, num_kv_blocks=64)
else:
    options = json.loads(source)
    llm = mlafx.LLM(options.pop("model"), num_kv_blocks=64, progress=False, **options)
loaded = time.perf_counter()
llm.generate([prompt], mlafx.SamplingParams(max_tokens=1, ignore_eos=True))
first = time.perf_counter()
print(json.dumps({"import_s": imported - start, "load_s": loaded - imported,
                  "prefill_s": first - loaded, "first_token_s": first - start}))
"""


def cold_run(source: str, kind: str, threads: int, env: dict[str, str]) -> dict[str, float]:
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", CHILD, source, kind, str(threads), json.dumps(PROMPT)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=1800,
    )
    if done.returncode != 0:
        raise RuntimeError(f"cold run failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - start
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "export.json")
    args = parser.parse_args(argv)
    import mlafx

    overrides = MODELS[args.model]
    model = {"model": EMBEDDED_DEFAULT_MODEL, "load_format": "dummy", "hf_overrides": overrides}
    model.update(dtype="float32", block_size=16)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        scratch_dir = Path(scratch)
        env = dict(os.environ)
        env["MLAFX_CACHE_DIR"] = str(scratch_dir / "mlafx-cache")
        env["TORCHINDUCTOR_CACHE_DIR"] = str(scratch_dir / "inductor-cache")
        # from scratch: empty caches, so this run compiles (and fills them for what follows)
        scratch_run = cold_run(json.dumps({**model, "compile": True}), "model", args.threads, env)
        rows.append({"how": "compile from scratch", **scratch_run})
        cached_run = cold_run(json.dumps({**model, "compile": True}), "model", args.threads, env)
        rows.append({"how": "compiled, cached package", **cached_run})
        os.environ.update(MLAFX_CACHE_DIR=env["MLAFX_CACHE_DIR"])
        os.environ.update(TORCHINDUCTOR_CACHE_DIR=env["TORCHINDUCTOR_CACHE_DIR"])
        for format in FORMATS:
            directory = scratch_dir / format
            start = time.perf_counter()
            manifest = mlafx.export(
                EMBEDDED_DEFAULT_MODEL,
                directory,
                format,
                **{k: v for k, v in model.items() if k != "model"},
                progress=False,
            )
            export_s = time.perf_counter() - start
            size = sum(entry["bytes"] for entry in manifest.files.values())
            step_file = manifest.step["file"]
            run = cold_run(str(directory), "artifact", args.threads, env)
            rows.append(
                {
                    "how": f"artifact {format}",
                    "export_s": export_s,
                    "artifact_mib": size / 2**20,
                    "step_file_mib": manifest.files[step_file]["bytes"] / 2**20,
                    **run,
                }
            )
    base = rows[0]["first_token_s"]
    print(f"model {args.model} (float32, block size 16), {args.threads} threads, cold processes:")
    print(
        f"{'':26} {'size MiB':>9} {'step MiB':>9} {'export s':>9} {'load s':>8} "
        f"{'1st token s':>12} {'vs scratch':>10}"
    )
    for row in rows:
        size = f"{row['artifact_mib']:9.2f}" if "artifact_mib" in row else f"{'':9}"
        step = f"{row['step_file_mib']:9.2f}" if "step_file_mib" in row else f"{'':9}"
        export = f"{row['export_s']:9.1f}" if "export_s" in row else f"{'':9}"
        print(
            f"{row['how']:26} {size} {step} {export} {row['load_s']:8.2f} "
            f"{row['first_token_s']:12.2f} {base / row['first_token_s']:9.1f}x"
        )
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"model": args.model, "threads": args.threads, "rows": rows}, indent=2)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
