"""``mlafx::v4_compress_pool`` (DeepSeek-V4's compressor at a window close) against the model's
``PoolCompressor.close`` (the reference semantics: the same roundings) and a float64 reference,
on CSA's two overlapping series and HCA's one, first windows (no window before them) included;
the portable path in a child process; opcheck; bad inputs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mlafx.config.deepseek_v4 import DeepseekV4Config
from mlafx.kernels import cpu_isa, v4_compress_pool
from mlafx.kernels.v4_compressor_ops import v4_compress_pool_f64
from mlafx.models.deepseek_v4.compressor import PoolCompressor
from mlafx.models.deepseek_v4.rope import V4RotaryEmbedding
from mlafx.models.deepseek_v4.step import PoolStep
from mlafx.models.rope import rope_cos_sin

BLOCK = 8


def _case(c: int, rate: int, overlap: bool, entries: list[int], dtype, seed: int):
    """A compressor with random weights, token rows for windows up to the last entry, and the
    PoolStep closing ``entries`` (window indices), each into its own pool slot."""
    gen = torch.Generator().manual_seed(seed)
    cfg = DeepseekV4Config.from_hf_dict(
        {"model_type": "deepseek_v4", "hidden_size": 16, "head_dim": c, "qk_rope_head_dim": 8}
    )
    comp = PoolCompressor(cfg, c, rate, overlap)
    with torch.no_grad():
        comp.position_bias.copy_(torch.randn(comp.position_bias.shape, generator=gen))
        comp.kv_norm.weight.copy_(1 + 0.3 * torch.randn(c, generator=gen))
    tokens = (max(entries, default=0) + 1) * rate
    blocks = -(-tokens // BLOCK) + 1
    rows = (2 * torch.randn(blocks, BLOCK, comp.input_width, generator=gen)).to(dtype)
    slot = torch.randperm(blocks * BLOCK, generator=gen)[:tokens]  # token p's row
    sources = [
        [int(slot[max(w - 1, 0) * rate + j]) for j in range(rate)]
        + [int(slot[w * rate + j]) for j in range(rate)]
        for w in entries
    ]
    pool = PoolStep(
        rate=rate,
        close_slots=torch.randperm(len(entries) + 3, generator=gen)[: len(entries)],
        close_sources=torch.tensor(sources, dtype=torch.int64).view(-1, 2 * rate),
        close_has_previous=torch.tensor([w > 0 for w in entries], dtype=torch.bool),
        close_positions=torch.tensor([w * rate for w in entries], dtype=torch.int64),
        entry_slots=torch.zeros(0, dtype=torch.int64),
        entry_seq_ids=torch.zeros(0, dtype=torch.int64),
        entry_index=torch.zeros(0, dtype=torch.int64),
    )
    rope = V4RotaryEmbedding(cfg.compress_rope, cfg.qk_rope_head_dim)
    pool_cache = torch.zeros(len(entries) + 3, 1, c, dtype=dtype)
    return comp, rows, pool, rope, pool_cache


def _run_op(comp, rows, pool, rope, pool_cache):
    cos, sin = rope_cos_sin(pool.close_positions, rope.inv_freq, rope.scale)
    v4_compress_pool(
        rows, pool.close_sources, pool.close_has_previous, comp.position_bias.float(),
        comp.kv_norm.weight.float(), comp.kv_norm.eps, cos, sin, comp.overlap, pool_cache,
        pool.close_slots,
    )  # fmt: skip


@settings(max_examples=25, deadline=None)
@given(
    c=st.sampled_from([24, 40, 64]),
    rate=st.sampled_from([1, 4, 16]),
    overlap=st.booleans(),
    entries=st.lists(st.integers(0, 6), min_size=0, max_size=5, unique=True),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_the_models_close(c, rate, overlap, entries, dtype, seed):
    comp, rows, pool, rope, want = _case(c, rate, overlap, entries, dtype, seed)
    got = want.clone()
    with torch.no_grad():
        comp.close(rows, want, pool, rope)
    _run_op(comp, rows, pool, rope, got)
    # the same roundings; a sum's order and exp/rsqrt may differ by an ulp, which a rounding
    # to the dtype can carry to one unit of its last place
    tol = {torch.float32: 2e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got.float(), want.float(), atol=tol * 4, rtol=tol)
    if entries:  # and the float64 arithmetic, within the dtype's roundings
        cos, sin = rope_cos_sin(pool.close_positions, rope.inv_freq, rope.scale)
        exact = v4_compress_pool_f64(
            rows, pool.close_sources, pool.close_has_previous, comp.position_bias,
            comp.kv_norm.weight, comp.kv_norm.eps, cos, sin, overlap,
        )  # fmt: skip
        written = got.view(-1, c)[pool.close_slots].double()
        torch.testing.assert_close(written, exact, atol=tol * 20, rtol=tol * 5)


def test_first_window_of_a_csa_pool_reads_its_own_window_only():
    """w = 0 has no window before it: its series-A slots are masked, so their columns (kv and
    gate of series A) change nothing; series B's do."""
    c = 24
    comp, rows, pool, rope, cache = _case(c, 4, True, [0], torch.float32, 0)
    _run_op(comp, rows, pool, rope, cache)
    first = cache.clone()
    flat, src = rows.view(-1, rows.shape[-1]), pool.close_sources[0]
    sw = comp.series_width
    flat[src[:, None], torch.cat([torch.arange(c), sw + torch.arange(c)])] += 3.0  # series A
    _run_op(comp, rows, pool, rope, cache)
    assert torch.equal(first, cache)
    flat[src[:, None], c + torch.arange(c)] += 3.0  # series B's kv
    _run_op(comp, rows, pool, rope, cache)
    assert not torch.equal(first, cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("overlap", [True, False])
def test_opcheck(dtype, overlap):
    comp, rows, pool, rope, cache = _case(40, 4, overlap, [0, 3, 5], dtype, 1)
    cos, sin = rope_cos_sin(pool.close_positions, rope.inv_freq, rope.scale)
    args = (
        rows, pool.close_sources, pool.close_has_previous, comp.position_bias.detach().float(),
        comp.kv_norm.weight.detach().float(), comp.kv_norm.eps, cos, sin, overlap, cache,
        pool.close_slots,
    )  # fmt: skip
    torch.library.opcheck(torch.ops.mlafx.v4_compress_pool.default, args)


@pytest.mark.parametrize(
    ("field", "value", "error", "match"),
    [
        ("sources", 10**6, IndexError, "out of range"),
        ("slots", -1, IndexError, "out of range"),
    ],
)
def test_bad_indices_write_nothing(field, value, error, match):
    comp, rows, pool, rope, cache = _case(24, 4, True, [1, 2], torch.float32, 2)
    if field == "sources":
        pool.close_sources[1, 3] = value
    else:
        pool.close_slots[0] = value
    before = cache.clone()
    with pytest.raises(error, match=match):
        _run_op(comp, rows, pool, rope, cache)
    assert torch.equal(cache, before)


def test_mismatched_widths_are_refused():
    comp, rows, pool, rope, cache = _case(24, 4, True, [1], torch.float32, 3)
    with pytest.raises(ValueError, match="sw"):
        _run_op(comp, rows, pool, rope, torch.zeros(4, 1, 32))


_PORTABLE_PROBE = """
import sys
sys.path.insert(0, sys.argv[1])
import torch
from mlafx.kernels import cpu_isa
from test_kernel_v4_compressor import _case, _run_op

assert cpu_isa() == "portable", cpu_isa()
for dtype in (torch.float32, torch.bfloat16):
    for overlap in (True, False):
        comp, rows, pool, rope, want = _case(40, 4, overlap, [0, 2, 5], dtype, 7)
        got = want.clone()
        with torch.no_grad():
            comp.close(rows, want, pool, rope)
        _run_op(comp, rows, pool, rope, got)
        tol = 2e-5 if dtype == torch.float32 else 1.6e-2
        torch.testing.assert_close(got.float(), want.float(), atol=4 * tol, rtol=tol)
print("ok")
"""


def test_the_portable_path_matches_in_a_child_process():
    if cpu_isa() == "portable":
        pytest.skip("this run is already portable")
    env = {**os.environ, "MLAFX_DISABLE_AVX512": "1"}
    tests_dir = os.path.dirname(__file__)
    result = subprocess.run(
        [sys.executable, "-c", _PORTABLE_PROBE, tests_dir],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
