"""Tensor parallelism (``LLM(tensor_parallel_size=2)``, ``mlafx.parallel``): greedy tokens
equal to one process's, on the tiny config (compiled per rank) and transformers' on a parity
checkpoint (each rank loads and slices it; rank 1 started as a rank on another machine
would be); a collective in the shard graph after each attention and MLP, none unsharded;
indivisible shapes refused before any process
starts; a worker killed mid-request fails the engine within seconds; no worker outlives
``close()`` or the driver's interpreter.

Each group spawns 2 processes (~15 s to import and build on a busy 2-core machine); the
compiled group's first run also compiles the rank step (~60 s cold, cached after that).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import mlafx
from mlafx.config import ModelConfig
from mlafx.graph.capture import capture_step
from mlafx.models.loader import build_model
from mlafx.models.step import SequenceSpan, build_step_inputs
from mlafx.parallel import TensorParallelError
from mlafx.parallel.collectives import install_all_reduce
from mlafx.parallel.group import free_port
from mlafx.parallel.sharding import shard_config, shard_model
from tests.engine_compare import assert_same_greedy, greedy_params, random_prompts, reference_alone
from tests.greedy_compare import compare_greedy, transformers_greedy
from tests.test_parity_transformers import NEW_TOKENS, PROMPTS, make_checkpoint
from tests.tiny_models import TINY_OVERRIDES, tiny_llm

REPO = Path(__file__).resolve().parents[1]


def _gone(pid: int) -> bool:
    """The process no longer exists (or is a zombie waiting for its reaper)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"


def _wait_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not all(_gone(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if not _gone(p)]


@pytest.mark.parametrize(
    ("overrides", "bad"),
    [
        ({"num_attention_heads": 3, "num_key_value_heads": 3}, "num_attention_heads=3"),
        ({"moe_intermediate_size": 33}, "moe_intermediate_size=33"),
        ({"intermediate_size": 95}, "intermediate_size=95"),
    ],
)
def test_indivisible_shapes_are_refused_before_any_worker_starts(overrides, bad):
    with pytest.raises(ValueError, match=f"tensor_parallel_size=2 .* does not divide {bad}"):
        tiny_llm(hf_overrides={**TINY_OVERRIDES, **overrides}, tensor_parallel_size=2)


def test_ranks_that_cannot_fit_in_memory_are_refused_before_starting(monkeypatch):
    monkeypatch.setattr("mlafx.parallel.group.available_memory_bytes", lambda: 1 << 20)
    with pytest.raises(ValueError, match=r"2 tensor-parallel rank\(s\) of deepseek_v2 need"):
        tiny_llm(tensor_parallel_size=2)


def test_shard_config_splits_heads_and_intermediate_widths_only():
    cfg = ModelConfig.from_model("deepseek-v2-lite", TINY_OVERRIDES)
    shard = shard_config(cfg, 2)
    assert (shard.num_attention_heads, shard.intermediate_size, shard.moe_intermediate_size) == (
        2,
        48,
        16,
    )
    assert shard.n_routed_experts == cfg.n_routed_experts
    assert shard.latent_width == cfg.latent_width  # the cache row is not split


def test_kv_connector_is_refused_with_tensor_parallelism(tmp_path):
    with pytest.raises(ValueError, match="kv_connector is not supported"):
        tiny_llm(tensor_parallel_size=2, kv_connector=f"disk:{tmp_path}")


@pytest.fixture(scope="module")
def tp2_compiled():
    llm = tiny_llm(tensor_parallel_size=2, compile=True, max_num_batched_tokens=24)
    pids = llm.workers.pids
    yield llm
    llm.close()
    assert _wait_gone(pids, 5.0) == [], "workers outlived close()"


def test_compiled_tp2_greedy_matches_one_process(tp2_compiled):
    """Batched, chunked (budget 24 tokens), prefix-cached serving on two compiled ranks
    against each prompt alone in one process (reference model). Compiled ranks ignore the
    key rows, so the driver neither builds nor ships them."""
    assert tp2_compiled.workers.reads_key_rows is False
    prompts = random_prompts(5, 3, 40, seed=9)
    prompts.append(prompts[0] + [7, 8, 9, 10, 11])  # a prefix-cache hit
    refs = reference_alone(prompts, max_tokens=12)
    outputs = tp2_compiled.generate(prompts, greedy_params(12, logprobs=1))
    assert_same_greedy(refs, outputs, "tp2 compiled")
    assert outputs[-1].num_cached_tokens > 0


def test_a_killed_worker_fails_the_request_within_seconds(tp2_compiled):
    llm = tp2_compiled
    pids = llm.workers.pids
    llm.add_request([3, 4, 5, 6, 7, 8, 9, 10], greedy_params(400))
    llm.step()
    killed_at: list[float] = []

    def kill() -> None:
        killed_at.append(time.monotonic())
        os.kill(pids[1], signal.SIGKILL)

    killer = threading.Timer(0.3, kill)
    killer.start()
    with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+\) exited with code -9"):
        while llm.has_unfinished_requests():
            llm.step()
    killer.join()
    assert time.monotonic() - killed_at[0] < 5.0
    assert _wait_gone(pids, 5.0) == [], "rank 0 outlived the failed group"
    with pytest.raises(TensorParallelError, match="failed earlier"):
        llm.step()


def test_a_worker_that_raises_reports_its_traceback():
    """A step the ranks cannot run (a token id past the vocabulary, which the engine's own
    checks would refuse) raises in every rank; the driver reports the first traceback."""
    llm = tiny_llm(tensor_parallel_size=2, num_kv_blocks=8)
    pids = llm.workers.pids
    try:
        step = build_step_inputs([SequenceSpan([3, 10**6], 0, 2, [1])], llm.block_size)
        with pytest.raises(TensorParallelError, match=r"rank \d failed to run a step(.|\n)*Error"):
            llm.workers(step.input_ids, step.positions, [], step.meta, step.logits_indices)
        with pytest.raises(TensorParallelError, match="failed earlier"):
            llm.generate([[3, 4]])
    finally:
        llm.close()
    assert _wait_gone(pids, 5.0) == []


def test_tp2_with_a_remote_rank_matches_transformers_on_a_v3_checkpoint(tmp_path, monkeypatch):
    """V3 shape (q LoRA: q_b_proj split; sigmoid noaux_tc routing over 8 experts; a dense
    first layer), weights loaded and sliced by each rank, reference path per rank. Rank 1
    is started the way a rank on another machine is (``python -m mlafx.parallel.remote``,
    rendezvous by environment), here on this machine."""
    hf_model = make_checkpoint("v3_noaux_tc", tmp_path)
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port("127.0.0.1"))}
    env["MLAFX_TP_AUTHKEY"] = "test-secret"
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    remote = subprocess.Popen(
        [sys.executable, "-m", "mlafx.parallel.remote", "--rank", "1", "--threads", "1"],
        cwd=REPO,
        env={**os.environ, **env, "PYTHONPATH": str(REPO)},
    )
    try:
        llm = mlafx.LLM(
            str(tmp_path),
            dtype="float32",
            block_size=4,
            num_kv_blocks=64,
            compile=False,
            progress=False,
            tensor_parallel_size=2,
            tensor_parallel_local_ranks=1,
        )
        try:
            assert llm.workers.reads_key_rows  # reference ranks: the driver sends them
            outputs = llm.generate(PROMPTS, greedy_params(NEW_TOKENS))
        finally:
            llm.close()
        assert remote.wait(timeout=10) == 0, "the remote rank did not exit cleanly on close()"
    finally:
        if remote.poll() is None:
            remote.kill()
    compared = 0
    for i, (prompt, out) in enumerate(zip(PROMPTS, outputs, strict=True)):
        tokens, logprobs = transformers_greedy(hf_model, prompt, NEW_TOKENS)
        got = out.outputs[0]
        got_logprobs = [top[t] for t, top in zip(got.token_ids, got.logprobs, strict=True)]
        compared += compare_greedy(
            tokens, logprobs, got.token_ids, got_logprobs, label=f"v3 #{i}"
        ).compared
    assert compared >= len(PROMPTS) * NEW_TOKENS * 3 // 4


def test_no_worker_outlives_the_driver_interpreter():
    """The driver exits without ``close()``: the workers go with it."""
    script = (
        "from tests.tiny_models import tiny_llm\n"
        "llm = tiny_llm(tensor_parallel_size=2)\n"
        "print(*llm.workers.pids, flush=True)\n"
        "llm.generate([[5, 6, 7]])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 2
    assert _wait_gone(pids, 5.0) == []


def _all_reduces(model) -> int:
    graph = capture_step(model, block_size=4).graph
    return sum(1 for n in graph.nodes if n.target is torch.ops.mlafx_tp.all_reduce_sum.default)


def test_only_shard_graphs_hold_all_reduces():
    """tensor_parallel_size=1 captures no collective; a shard captures one after each
    layer's attention and one after its MLP."""
    full = build_model(
        ModelConfig.from_model("deepseek-v2-lite", TINY_OVERRIDES), "float32", "dummy"
    )
    assert all(getattr(m, "all_reduce", None) is None for m in full.modules())
    assert _all_reduces(full) == 0
    shard = shard_model(full, 1, 2)
    assert install_all_reduce(shard) == full.config.num_hidden_layers
    assert _all_reduces(shard) == 2 * full.config.num_hidden_layers


def test_cli_passes_tensor_parallel_size_and_refuses_what_it_cannot_combine(tmp_path, capsys):
    from mlafx.cli import main

    tiny = ["--hf-overrides", json.dumps(TINY_OVERRIDES), "--no-compile"]
    assert main(["run", *tiny, "--tensor-parallel-size", "2", "--kv-connector", "disk:x"]) == 2
    assert "kv_connector is not supported with tensor_parallel_size > 1" in capsys.readouterr().err
    assert main(["run", *tiny, "--tensor-parallel-size", "3"]) == 2
    assert "does not divide num_attention_heads=4" in capsys.readouterr().err
    assert main(["run", "--artifact", str(tmp_path), "--tensor-parallel-size", "2"]) == 2
    assert "cannot be combined with --artifact" in capsys.readouterr().err


@pytest.mark.parametrize("shape", [(3, 5), (0, 7), (2, 4, 6)])
def test_all_reduce_op_passes_opcheck_and_is_the_identity_alone(shape):
    """Without a process group the 'group' is this process: the sum is x, as a new tensor."""
    x = torch.randn(shape)
    torch.library.opcheck(torch.ops.mlafx_tp.all_reduce_sum.default, (x,))
    out = torch.ops.mlafx_tp.all_reduce_sum(x)
    assert torch.equal(out, x) and out is not x
    assert x.numel() == 0 or out.data_ptr() != x.data_ptr()  # a copy, never an alias
