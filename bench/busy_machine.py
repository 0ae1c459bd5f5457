"""Speed on a busy machine: the demo model's decode (batch 1 and 8) and prefill, quiet and
with another process spinning on one core, and the fraction of the quiet speed kept.

    mlafx bench busy-machine [--rounds 3] [--busy-core 0] [--policy engine --policy spin ...]

Each ``--policy`` runs in its own child process (the OpenMP runtime reads its waiting policy
once, when torch loads it): ``engine`` is mlafx as shipped (its own waiting policy, see
``mlafx/openmp_waiting.py``); ``spin`` is libgomp's default (threads spin ~300k iterations at
every barrier before sleeping); ``passive`` is ``OMP_WAIT_POLICY=PASSIVE`` (sleep at once);
``spincount=N`` is ``GOMP_SPINCOUNT=N``. The child builds the compiled engine (dummy weights,
bf16, all cores) and then, for ``--rounds`` rounds, times every case quietly and with the
busy process running (started and stopped here, pinned to ``--busy-core``), so that drifts
hit both alike; medians over all rounds. Peak RSS is the child's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

POLICIES = {
    "engine": {},
    "spin": {"GOMP_SPINCOUNT": "300000"},  # libgomp's own default
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
}
# (name, kind, batch, tokens): decode tokens = cached context, prefill tokens = prompt length
CASES = (
    ("decode batch 1", "decode", 1, 256),
    ("decode batch 8", "decode", 8, 256),
    ("prefill 1x512", "prefill", 1, 512),
)


def policy_env(policy: str) -> dict[str, str]:
    if policy.startswith("spincount="):
        return {"GOMP_SPINCOUNT": policy.split("=", 1)[1]}
    if policy not in POLICIES:
        raise SystemExit(f"unknown --policy {policy!r}: engine, spin, passive or spincount=N")
    return POLICIES[policy]


def load_average() -> str:
    path = Path("/proc/loadavg")
    return " ".join(path.read_text().split()[:3]) if path.exists() else "unknown"


def start_busy_process(core: int) -> subprocess.Popen[bytes]:
    """A process spinning on ``core`` until killed (what a second service or a build does)."""
    return subprocess.Popen(
        [sys.executable, "-c", "while True: pass"],
        preexec_fn=lambda: os.sched_setaffinity(0, {core}),
    )


def run_child(args: argparse.Namespace) -> None:
    import mlafx  # noqa: F401  (first: the engine's waiting policy applies before torch loads)

    sys.path.insert(0, str(ROOT))
    import torch

    from bench.e2e.backends import MlafxStep
    from bench.e2e.measure import peak_rss_bytes
    from bench.e2e.models import mlafx_llm

    longest = max(batch * (tokens + 1) for _, _, batch, tokens in CASES)
    llm = mlafx_llm("embedded", num_kv_blocks=2 + longest // 16 + 16, block_size=16)
    step = MlafxStep("mlafx", llm.step_fn, llm.kv_caches, llm.config, 16)
    step.fill_caches()
    runs = {
        name: (step.decode if kind == "decode" else step.prefill)(batch, tokens)
        for name, kind, batch, tokens in CASES
    }
    times: dict[str, dict[str, list[float]]] = {n: {"quiet": [], "busy": []} for n in runs}

    def timed(name: str, phase: str, repeats: int) -> None:
        for _ in range(repeats):
            start = time.perf_counter()
            runs[name]()
            times[name][phase].append(time.perf_counter() - start)

    with torch.inference_mode():
        for run in runs.values():  # warm-up
            run()
            run()
        for _ in range(args.rounds):
            for name in runs:
                repeats = 3 if "prefill" in name else 10
                timed(name, "quiet", repeats)
                busy = start_busy_process(args.busy_core)
                time.sleep(0.3)  # let it take its core
                try:
                    timed(name, "busy", repeats)
                finally:
                    busy.kill()
                    busy.wait()
    result = {
        name: {phase: statistics.median(ts) for phase, ts in phases.items()}
        for name, phases in times.items()
    }
    print(json.dumps({"cases": result, "peak_rss_bytes": peak_rss_bytes()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--busy-core", type=int, default=0)
    parser.add_argument("--policy", action="append", default=None, help="default: engine")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_child(args)
        return
    policies = args.policy or ["engine"]
    cores = os.cpu_count()
    print(f"load average before: {load_average()}; {cores} cores; busy core {args.busy_core}")
    for policy in policies:
        env = {**os.environ, **policy_env(policy)}
        child = [sys.executable, __file__, "--child", "--rounds", str(args.rounds)]
        child += ["--busy-core", str(args.busy_core)]
        settings = " ".join(f"{k}={v}" for k, v in policy_env(policy).items())
        print(f"\n[{policy}] {settings or '(as mlafx sets it)'}")
        out = subprocess.run(child, env=env, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            print(out.stderr[-3000:], file=sys.stderr)
            raise SystemExit(f"the {policy} child failed (exit {out.returncode})")
        result = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{'case':<16}{'quiet ms':>10}{'busy ms':>10}{'kept':>8}")
        for name, t in result["cases"].items():
            kept = t["quiet"] / t["busy"]
            print(f"{name:<16}{t['quiet'] * 1e3:>10.1f}{t['busy'] * 1e3:>10.1f}{kept:>8.0%}")
        print(f"peak RSS {result['peak_rss_bytes'] / 2**30:.2f} GiB")
    print(f"\nload average after: {load_average()}")


if __name__ == "__main__":
    main()
