"""The host's measured attention-path costs: measured once per key, cached, re-measured when
the host, the build or the file changes."""

from __future__ import annotations

import json

import pytest
import torch

import mlafx.kernels as K
from mlafx.config import ModelConfig
from mlafx.models.attention_path import PathCosts, split_threshold
from mlafx.runtime import attention_costs
from tests.tiny_models import TINY_OVERRIDES


@pytest.fixture
def cfg() -> ModelConfig:
    return ModelConfig.from_model("deepseek-v2-lite", TINY_OVERRIDES)


@pytest.fixture
def measured(monkeypatch, tmp_path):
    """Counts real measurements; the cache lives in tmp_path."""
    monkeypatch.setenv("MLAFX_CACHE_DIR", str(tmp_path))
    calls = []
    real = attention_costs.measure_path_costs

    def counting(cfg, dtype):
        calls.append(dtype)
        return real(cfg, dtype)

    monkeypatch.setattr(attention_costs, "measure_path_costs", counting)
    return calls


def test_costs_are_measured_once_and_then_read(cfg, measured, tmp_path):
    first = attention_costs.attention_path_costs(cfg, torch.float32)
    assert measured == [torch.float32]
    assert all(value > 0 for value in vars(first).values())
    (record,) = (tmp_path / "attention_costs").glob("*.json")
    key = json.loads(record.read_text())["key"]
    assert key["cpu_isa"] == K.cpu_isa() and key["dtype"] == "float32"
    assert attention_costs.attention_path_costs(cfg, torch.float32) == first
    assert measured == [torch.float32]
    split_threshold(cfg, first)  # a threshold, finite or not


def test_another_host_dtype_or_build_measures_again(cfg, measured, monkeypatch):
    attention_costs.attention_path_costs(cfg, torch.float32)
    attention_costs.attention_path_costs(cfg, torch.bfloat16)
    monkeypatch.setattr(K, "cpu_isa", lambda: "another_cpu")
    attention_costs.attention_path_costs(cfg, torch.float32)
    monkeypatch.setattr(K, "build_sha256", lambda: "0" * 64)
    attention_costs.attention_path_costs(cfg, torch.float32)
    assert len(measured) == 4


def test_a_damaged_file_is_measured_again(cfg, measured, tmp_path, caplog):
    attention_costs.attention_path_costs(cfg, torch.float32)
    (record,) = (tmp_path / "attention_costs").glob("*.json")
    record.write_text("{not json")
    costs = attention_costs.attention_path_costs(cfg, torch.float32)
    assert len(measured) == 2 and "unreadable attention path costs" in caplog.text
    assert isinstance(costs, PathCosts)
    assert json.loads(record.read_text())["costs"] == vars(costs)
