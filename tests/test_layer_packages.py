"""The compiled step as one package per layer kind: layers of a kind share it with their own
weights, a package serves every depth, two processes share one cache, a failed verification
is an error that caches nothing, and a real-width model compiles and serves within its
memory targets (``mlafx bench real-size``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mlafx
import mlafx.passes.pipeline as pipeline
from mlafx.compile.compiled_step import LoweringError, compile_step
from mlafx.compile.layer_kinds import layer_kinds
from mlafx.passes.verify import VerificationError
from tests.tiny_models import TINY_OVERRIDES, tiny_llm

ROOT = Path(__file__).resolve().parents[1]
# five layers, two of them dense: two kinds, each run for several layers
DEEPER = {**TINY_OVERRIDES, "num_hidden_layers": 5, "first_k_dense_replace": 2}
PROMPTS = [[5, 6, 7, 8, 9], [3], list(range(10, 50))]


def greedy(llm: mlafx.LLM, max_tokens: int = 8) -> list[mlafx.RequestOutput]:
    params = mlafx.SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=2)
    return llm.generate(PROMPTS, params)


def assert_same_greedy(want: list, got: list) -> None:
    """Equal greedy tokens up to a near-tie (the top two within 1e-4), logprobs within 1e-4."""
    for a, b in zip(want, got, strict=True):
        for step, (x, y) in enumerate(
            zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True)
        ):
            assert max(abs(x[t] - y[t]) for t in x.keys() & y.keys()) < 1e-4
            top = sorted(x.values(), reverse=True)
            if a.outputs[0].token_ids[step] != b.outputs[0].token_ids[step]:
                assert top[0] - top[1] < 1e-4, f"step {step}: {x} vs {y}"
                break  # the sequences diverge after a near-tie


def packages_in(cache_dir: Path) -> list[str]:
    return sorted(p.name for p in cache_dir.iterdir() if p.suffix == ".pt2")


def test_real_widths_compile_and_serve_within_the_memory_targets(tmp_path):
    """DeepSeek-V2-Lite widths (64 experts, bf16, dummy weights) at 2 and 4 layers: peak RSS
    while building and compiling <= weights + 2 GB; serving RSS <= 1.15 x (weights + KV) +
    1 GB. Memory, not time, is asserted."""
    out = tmp_path / "real_size.json"
    cmd = [sys.executable, "-m", "mlafx.cli", "bench", "real-size", "--memory-layers", "2", "4"]
    cmd += ["--compile-layers", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=os.environ.copy())
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["memory"]
    assert [r["layers"] for r in rows] == [2, 4]
    for row in rows:
        assert row["peak_rss_gib"] <= row["peak_limit_gib"], row
        assert row["engine_rss_gib"] <= row["engine_limit_gib"], row
        assert len(row["tokens"]) == 4


def test_layer_kinds_group_the_layers_by_structure():
    llm = tiny_llm(hf_overrides=DEEPER)
    assert [(k.name, k.layers) for k in layer_kinds(llm.model)] == [
        ("SwiGLU", (0, 1)),
        ("MoE", (2, 3, 4)),
    ]


def test_every_layer_runs_its_kind_package_with_its_own_weights():
    """Five layers in two kinds, two packages (fp32): the reference's tokens. The suite's
    cache: the 2-layer tiny model (same layer kinds, another depth) shares the packages."""
    reference = tiny_llm(hf_overrides=DEEPER)
    compiled = tiny_llm(hf_overrides=DEEPER, compile=True)
    assert [p.kind.layers for p in compiled.compiled.packages] == [(0, 1), (2, 3, 4)]
    assert len(compiled.compiled.layers) == 5
    assert_same_greedy(greedy(reference), greedy(compiled))
    shallower = tiny_llm(compile=True)  # 2 layers, same kinds
    assert shallower.compiled.lowerings == {}
    assert [p.package for p in shallower.compiled.packages] == [
        p.package for p in compiled.compiled.packages
    ]


CHILD = """
import json, sys
from tests.tiny_models import TINY_OVERRIDES, tiny_llm
import mlafx
# one layer kind (no MoE layers): one package both processes race to build
dense = {**TINY_OVERRIDES, "n_routed_experts": 0}
llm = tiny_llm(compile=True, compile_cache_dir=sys.argv[1], hf_overrides=dense)
outs = llm.generate([[5, 6, 7, 8, 9]], mlafx.SamplingParams(max_tokens=6, ignore_eos=True))
print(json.dumps(outs[0].outputs[0].token_ids))
"""


def test_two_processes_on_an_empty_cache_both_serve(tmp_path):
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    children = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD, str(cache)],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [child.communicate(timeout=600) for child in children]
    for child, (_, err) in zip(children, results, strict=True):
        assert child.returncode == 0, err[-3000:]
    first, second = (json.loads(out.strip().splitlines()[-1]) for out, _ in results)
    assert first == second and len(first) == 6
    # one valid package, nothing half-written
    assert len(packages_in(cache)) == 1
    assert not [p.name for p in cache.iterdir() if ".tmp" in p.name]


def test_a_failed_verification_is_an_error_that_caches_nothing(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise VerificationError("forced for the test")

    monkeypatch.setattr(pipeline, "verify_rewrite", fail)
    model = tiny_llm().model
    with pytest.raises(LoweringError, match=r"layer kind SwiGLU .*scaled_dot_product_attention"):
        compile_step(model, 4, cache_dir=tmp_path)
    assert packages_in(tmp_path) == []


def test_allow_unlowered_serves_the_captured_layers_uncached(tmp_path, monkeypatch, caplog):
    def fail(*args, **kwargs):
        raise VerificationError("forced for the test")

    monkeypatch.setattr(pipeline, "verify_rewrite", fail)
    dense = {**TINY_OVERRIDES, "n_routed_experts": 0}  # one layer kind: one unlowered build
    reference = tiny_llm(hf_overrides=dense)
    unlowered = tiny_llm(
        hf_overrides=dense, compile=True, compile_cache_dir=tmp_path, allow_unlowered=True
    )
    assert "UNLOWERED" in caplog.text
    assert packages_in(tmp_path) == []
    assert unlowered.compiled.reads_key_rows  # the reference attention reads them
    assert_same_greedy(greedy(reference), greedy(unlowered))
