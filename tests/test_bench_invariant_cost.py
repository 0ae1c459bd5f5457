"""``mlafx bench invariant-cost`` runs end to end on the tiny model (so the benchmark cannot
rot) and prints a ratio for every case. Timings are reported, never asserted."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from bench.invariant_cost import CASES

ROOT = Path(__file__).resolve().parents[1]


def test_prints_both_modes_for_every_case():
    cmd = [sys.executable, "-m", "mlafx.cli", "bench", "invariant-cost", "--model", "tiny"]
    cmd += ["--rounds", "1", "--threads", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=os.environ.copy())
    assert done.returncode == 0, done.stderr[-3000:]
    for name, *_ in CASES:
        line = next(x for x in done.stdout.splitlines() if x.startswith(name))
        default, invariant, ratio = map(float, re.findall(r"[\d.]+(?= ms|x)", line[len(name) :]))
        assert default > 0 and invariant > 0
        # as printed: times to 0.005 ms, the ratio to 0.005
        low = (invariant - 0.005) / (default + 0.005) - 0.005
        high = (invariant + 0.005) / (default - 0.005) + 0.005
        assert low <= ratio <= high
    assert "peak RSS" in done.stdout


def test_an_fp8_checkpoint_is_written_once_and_served(tmp_path):
    """``--quantization fp8``: the tiny model's dummy weights written as a DeepSeek-layout FP8
    checkpoint in ``--checkpoint-dir``, then served from it in both modes."""
    cmd = [sys.executable, "-m", "mlafx.cli", "bench", "invariant-cost", "--model", "tiny"]
    cmd += ["--rounds", "1", "--threads", "1", "--only", "decode b1", "--quantization", "fp8"]
    cmd += ["--checkpoint-dir", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=os.environ.copy())
    assert done.returncode == 0, done.stderr[-3000:]
    assert "fp8 weights" in done.stdout
    assert sum(x.startswith("decode b1") for x in done.stdout.splitlines()) == 1
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "fp8"
    assert list(tmp_path.glob("*.safetensors"))
