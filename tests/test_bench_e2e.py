"""``mlafx bench e2e --quick`` runs end to end (so the benchmark cannot rot), and its cost
model is right on hand-counted shapes. Timings are reported, never asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.e2e import costs
from bench.e2e.measure import outside_peak_rss, peak_rss_bytes, reset_peak_rss
from bench.e2e.models import MODELS
from mlafx.config import ModelConfig
from mlafx.config.presets import DEEPSEEK_V2_LITE

ROOT = Path(__file__).resolve().parents[1]


def test_quick_benchmark_writes_every_figure(tmp_path):
    """One thread: on a shared 2-core machine two threads can stall on each other."""
    out = tmp_path / "e2e.json"
    cmd = [sys.executable, "-m", "mlafx.cli", "bench", "e2e", "--quick", "--threads", "1"]
    cmd += ["--no-torch-compile", "--json", str(out), "--plots", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=os.environ.copy())
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [r for r in rows if "error" in r] == []
    assert {r["backend"] for r in rows} == {
        "mlafx",
        "mlafx_invariant",
        "mlafx_reference",
        "hf_eager",
    }
    assert all(r["median_ms"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    decode = [r for r in rows if r["phase"] == "decode"]
    assert all(r["x_floor"] > 0 and r["run_x_floor"] > 0 for r in decode)
    assert all(r["read_gbps_around"] > 0 for r in decode)  # each judged at its own moment
    assert all(0 < r["matmul_fraction"] for r in rows if r["phase"] == "prefill")
    kv = result["kv_bytes_per_token"]
    assert kv["mlafx"] == kv["transformers"]  # both cache the latent, not K and V
    for backend in ("mlafx", "mlafx_reference"):
        prefix = result["serving"][backend]["prefix"]
        assert prefix["cached_tokens"] == 299  # all but the last token (partial-block hit)
        mixed = result["serving"][backend]["mixed"]
        assert mixed["requests"] == 4 and mixed["tpot_median_ms"] > 0
    assert [t["target"] for t in result["targets"]][0] == "decode vs transformers eager"
    assert "targets (batch 8, prompts of 128 tokens)" in done.stdout
    assert "batch-invariant mode, time vs the default: prefill 8x128" in done.stdout
    for png in ("e2e_decode_vs_context.png", "e2e_batch_and_prefill.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="Linux's peak counter")
def test_a_probe_buffer_stays_out_of_the_peak_rss():
    """What an ``outside_peak_rss`` block holds is not counted; the peak before it and after
    it are."""
    reset_peak_rss()
    base = peak_rss_bytes()
    with outside_peak_rss():
        probe = torch.ones(256 * 2**20 // 4)
        del probe
    assert peak_rss_bytes() < base + 64 * 2**20
    kept = torch.ones(128 * 2**20 // 4)
    with outside_peak_rss():
        pass
    del kept
    assert peak_rss_bytes() >= base + 120 * 2**20


def _config(name: str) -> ModelConfig:
    return ModelConfig.from_hf_dict({**DEEPSEEK_V2_LITE, **MODELS[name]})


def test_prefill_flops_by_hand():
    """The embedded default, 1 sequence of 2 tokens, counted term by term."""
    cfg = _config("embedded")
    h, heads = 2048, 16
    per_token = (
        2 * h * heads * 192  # q_proj
        + 2 * h * 576  # kv_a_proj_with_mqa
        + 2 * 512 * heads * 256  # kv_b_proj
        + 2 * heads * 128 * h  # o_proj
        + 2 * h * 4  # router
        + (2 + 2) * 3 * 2 * h * 1408  # top-2 routed + 2 shared experts
    )
    pairs = 3  # causal pairs of 2 tokens: (0,0), (1,0), (1,1)
    attention = pairs * heads * 2 * (192 + 128)
    lm_head = 2 * h * 102400  # one sampled position
    want = 2 * (2 * per_token + attention) + lm_head
    assert costs.prefill_flops(cfg, 1, 2) == pytest.approx(want, rel=1e-12)


def test_decode_weight_bytes_reads_only_routed_experts_hit():
    cfg = _config("full-width-1layer")  # 64 experts, top-6
    with torch.device("meta"):
        from mlafx.models.deepseek import MLAForCausalLM

        model = MLAForCausalLM(cfg).to(torch.bfloat16)
    experts = sum(p.numel() * 2 for n, p in model.named_parameters() if ".mlp.experts." in n)
    embed = model.model.embed_tokens.weight
    rest = sum(p.numel() * 2 for n, p in model.named_parameters() if ".mlp.experts." not in n)
    rest -= embed.numel() * 2
    one = costs.decode_weight_bytes(model, cfg, 1)
    assert one == pytest.approx(rest + experts * 6 / 64 + 2048 * 2)
    many = costs.decode_weight_bytes(model, cfg, 4096)
    assert many == pytest.approx(rest + experts + 4096 * 2048 * 2, rel=1e-6)
