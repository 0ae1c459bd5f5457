"""Load on `mlafx serve`: N completion requests from C concurrent clients; prints requests/s,
output tokens/s and latency percentiles (and the server's /metrics summary).

    .venv/bin/python bench/serve_load.py [--model tiny|embedded] [--compile] \
        [--dtype float32|bfloat16] [--requests 1000] [--concurrency 32] [--max-tokens 16]
    .venv/bin/python bench/serve_load.py --url http://127.0.0.1:8000   # a running server
    .venv/bin/mlafx bench serve-load -- --model embedded --compile

Without ``--url`` it starts ``mlafx serve`` in a subprocess (``ServerProcess``) on a free
loopback port. ``run_load`` is also the suite's bounded load test (tests/test_serve.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from mlafx.config import EMBEDDED_DEFAULT_OVERRIDES  # noqa: E402
from tests.tiny_models import TINY_OVERRIDES  # noqa: E402

MODELS = {"tiny": TINY_OVERRIDES, "embedded": EMBEDDED_DEFAULT_OVERRIDES}


class ServerProcess:
    """``mlafx serve <flags> --port 0`` in a subprocess: ``url`` once it answers /health;
    ``stop()`` sends Ctrl-C (SIGINT) and waits. A context manager."""

    def __init__(self, flags: list[str], *, start_timeout: float = 300.0) -> None:
        command = [sys.executable, "-m", "mlafx.cli", "serve", *flags, "--port", "0"]
        self.process = subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=None,  # the server's log goes to ours
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        line = self.process.stdout.readline()  # "mlafx serve: http://HOST:PORT (model NAME)"
        if not line.startswith("mlafx serve: "):
            self.stop()
            raise RuntimeError(f"mlafx serve did not start (exit {self.process.returncode})")
        self.url = line.split()[2]
        deadline = time.monotonic() + start_timeout
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or self.process.poll() is not None:
                self.stop()
                raise RuntimeError(f"mlafx serve at {self.url} never became healthy")
            time.sleep(0.1)

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def server_flags(
    model: str, *, compile: bool, dtype: str = "float32", batch_invariant: bool = False
) -> list[str]:
    return [
        "--model",
        "deepseek-v2-lite",
        "--load-format",
        "dummy",
        "--hf-overrides",
        json.dumps(MODELS[model]),
        "--dtype",
        dtype,
        "--compile" if compile else "--no-compile",
        "--log-level",
        "warning",
        *(["--batch-invariant"] if batch_invariant else []),
    ]


@dataclass(frozen=True)
class LoadReport:
    num_requests: int
    errors: list[str]  # one line per failed request
    seconds: float
    latencies_s: list[float]  # of the successful requests, sorted
    output_tokens: int

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.seconds

    def percentile(self, q: float) -> float:
        """Nearest-rank percentile of the latencies (q in 0..100)."""
        ranked = self.latencies_s
        return ranked[min(len(ranked) - 1, max(0, round(q / 100 * len(ranked)) - 1))]

    def summary(self) -> str:
        return (
            f"{self.num_requests} requests in {self.seconds:.2f} s: "
            f"{self.requests_per_s:.1f} requests/s, "
            f"{self.output_tokens / self.seconds:.1f} output tokens/s; latency "
            f"p50 {self.percentile(50) * 1e3:.0f} ms, p90 {self.percentile(90) * 1e3:.0f} ms, "
            f"p99 {self.percentile(99) * 1e3:.0f} ms; {len(self.errors)} errors"
        )


def random_prompts(count: int, min_len: int, max_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(2, 256) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)
    ]


async def _load(
    url: str, model: str, prompts: list[list[int]], concurrency: int, max_tokens: int
) -> LoadReport:
    pending = list(enumerate(prompts))
    latencies: list[float] = []
    errors: list[str] = []
    tokens = 0

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal tokens
        while pending:
            index, prompt = pending.pop()
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0,
                "ignore_eos": True,
            }
            start = time.perf_counter()
            try:
                response = await http.post(f"{url}/v1/completions", json=body)
            except httpx.HTTPError as e:
                errors.append(f"request {index}: {type(e).__name__}: {e}")
                continue
            if response.status_code != 200:
                errors.append(f"request {index}: HTTP {response.status_code} {response.text}")
                continue
            latencies.append(time.perf_counter() - start)
            tokens += response.json()["usage"]["completion_tokens"]

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        start = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    return LoadReport(len(prompts), errors, seconds, sorted(latencies), tokens)


def run_load(
    url: str, model: str, prompts: list[list[int]], *, concurrency: int, max_tokens: int
) -> LoadReport:
    """Send every prompt (greedy, ``max_tokens`` each, eos ignored) from ``concurrency``
    clients, each with one request in flight at a time."""
    return asyncio.run(_load(url, model, prompts, concurrency, max_tokens))


def metrics_summary(url: str) -> str:
    values = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.split()
            values[name.removeprefix("mlafx_")] = float(value)
    return (
        f"server: {values['engine_steps_total']:.0f} steps, prefix cache hit rate "
        f"{values['prefix_cache_hit_rate']:.1%}, generation "
        f"{values['generation_tokens_per_second']:.1f} tokens/s of step time, "
        f"{values['preemptions_total']:.0f} preemptions"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=None, help="a running server (default: start one)")
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--compile", action="store_true", help="serve the compiled step")
    parser.add_argument(
        "--batch-invariant",
        action="store_true",
        help="serve in batch-invariant mode (with --compile; its cost under load)",
    )
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--min-prompt", type=int, default=8)
    parser.add_argument("--max-prompt", type=int, default=128)
    args = parser.parse_args()
    prompts = random_prompts(args.requests, args.min_prompt, args.max_prompt)
    if args.url is not None:
        name = httpx.get(f"{args.url}/v1/models").json()["data"][0]["id"]
        report = run_load(
            args.url, name, prompts, concurrency=args.concurrency, max_tokens=args.max_tokens
        )
        print(report.summary())
        print(metrics_summary(args.url))
        return 1 if report.errors else 0
    flags = server_flags(
        args.model, compile=args.compile, dtype=args.dtype, batch_invariant=args.batch_invariant
    )
    with ServerProcess(flags) as server:
        report = run_load(
            server.url,
            "deepseek-v2-lite",
            prompts,
            concurrency=args.concurrency,
            max_tokens=args.max_tokens,
        )
        print(
            f"mlafx serve ({args.model} model, {'compiled' if args.compile else 'reference'} "
            f"step, {args.dtype}{', batch-invariant' if args.batch_invariant else ''}), "
            f"{args.concurrency} clients, {args.max_tokens} tokens each, "
            f"prompts of {args.min_prompt}-{args.max_prompt} tokens"
        )
        print(report.summary())
        print(metrics_summary(server.url))
    for line in report.errors[:10]:
        print(line)
    return 1 if report.errors else 0


if __name__ == "__main__":
    sys.exit(main())
