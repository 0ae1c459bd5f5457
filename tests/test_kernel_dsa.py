"""mlafx::dsa_indexer_topk and mlafx::mla_attention_sparse (DeepSeek Sparse Attention) against
the float64 references in mlafx/kernels/dsa_reference.py, as torch.library ops (opcheck), and
on both ISA paths (portable and AVX-512, each in a child process).

Selections: with integer inputs (tests/dsa_cases.py) every score is exact in fp32, so the
kernel must pick exactly the reference's positions, ties resolved by (score descending,
position ascending); with normal inputs the two may differ only at positions whose float64
score is within 1e-4 of the query's score magnitude of the k-th best (tie-aware). Attention:
tests/attention_cases.py's tolerances (bf16 1.5e-2, fp16 3e-3, fp32 2e-5; LSE 2e-3 / 2e-5).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from attention_cases import FLOAT_DTYPES, assert_attention_close, make_paged, paged_cache
from dsa_cases import (
    assert_selection_tie_aware,
    assert_selection_valid,
    make_indexer,
    starts,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlafx.kernels import cpu_isa, dsa_indexer_topk, mla_attention_paged, mla_attention_sparse
from mlafx.kernels.dsa_reference import (
    dsa_indexer_topk_ref,
    dsa_visible_scores_ref,
    mla_attention_sparse_ref,
)

OPS = torch.ops.mlafx


@contextmanager
def _threads(n: int):
    """Cuts along the keys/positions happen only with several threads: force them."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _lengths(topk: int, block_size: int) -> st.SearchStrategy[int]:
    around = [topk - 1, topk, topk + 1, 3 * topk + 5, block_size + 1]
    return st.sampled_from(sorted({0, 1, 17, *[n for n in around if 0 < n <= 200]}))


# ---- dsa_indexer_topk ----------------------------------------------------------------------


def test_opcheck_dsa_indexer_topk():
    inputs = make_indexer([20, 0, 37], [2, 1, 3], 4, 16, 8, torch.bfloat16, 8, seed=0)
    torch.library.opcheck(OPS.dsa_indexer_topk.default, inputs.args())


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    block_size=st.sampled_from([1, 16, 64]),
    heads=st.sampled_from([1, 3, 16, 64]),
    dim=st.sampled_from([8, 17, 32, 96]),
    topk=st.sampled_from([1, 4, 16]),
    dtype=st.sampled_from(FLOAT_DTYPES),
    mode=st.sampled_from(["decode", "random"]),
    values=st.sampled_from(["integer", "duplicate", "zero_weights"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_indexer_exact_scores_match_reference(
    data, block_size, heads, dim, topk, dtype, mode, values, seed
):
    num_seqs = data.draw(st.integers(1, 3))
    kv_lens = [data.draw(_lengths(topk, block_size)) for _ in range(num_seqs)]
    q_lens = [data.draw(st.sampled_from([0, 1, 1, 3, 6])) for _ in range(num_seqs)]
    inputs = make_indexer(
        kv_lens, q_lens, heads, dim, block_size, dtype, topk, seed, mode=mode, values=values
    )
    selected = dsa_indexer_topk(*inputs.args())
    assert torch.equal(selected, dsa_indexer_topk_ref(*inputs.args()))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    block_size=st.sampled_from([1, 16, 64]),
    heads=st.sampled_from([2, 64]),
    dim=st.sampled_from([17, 128, 256]),
    dtype=st.sampled_from(FLOAT_DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_indexer_random_scores_match_reference_up_to_near_ties(
    data, block_size, heads, dim, dtype, seed
):
    topk = 16
    kv_lens = [data.draw(_lengths(topk, block_size)) for _ in range(2)]
    inputs = make_indexer(kv_lens, [1, 4], heads, dim, block_size, dtype, topk, seed)
    selected = dsa_indexer_topk(*inputs.args())
    assert_selection_tie_aware(selected, inputs, dsa_indexer_topk_ref(*inputs.args()), 1e-4)


def test_indexer_ties_earlier_position_wins():
    # All-equal scores: the first topk positions; duplicated rows: equal scores in each class.
    inputs = make_indexer([50], [1], 4, 16, 16, torch.float32, 8, seed=1, values="zero_weights")
    assert dsa_indexer_topk(*inputs.args())[0].tolist() == list(range(8))
    row = torch.ones(1, 16)
    cache, table = paged_cache([row.expand(40, 16)], 16, torch.bfloat16, torch.Generator())
    q = torch.ones(1, 2, 16, dtype=torch.bfloat16)
    args = (q, torch.ones(1, 2), cache, table, torch.tensor([40], dtype=torch.int32),
            starts([1]), torch.tensor([39]), 5)  # fmt: skip
    assert dsa_indexer_topk(*args)[0].tolist() == [0, 1, 2, 3, 4]


def test_indexer_topk_larger_than_context_pads_with_minus_one():
    inputs = make_indexer([3, 0, 5], [1, 0, 3], 2, 8, 4, torch.bfloat16, 7, seed=2)
    # query 1 sees nothing (position -1); query 2 is causal: position 3 sees 0..3
    inputs = type(inputs)(**{**inputs.__dict__, "positions": torch.tensor([2, -1, 3, 4])})
    selected = dsa_indexer_topk(*inputs.args())
    assert selected.tolist() == [
        [0, 1, 2, -1, -1, -1, -1],
        [-1] * 7,
        [0, 1, 2, 3, -1, -1, -1],
        [0, 1, 2, 3, 4, -1, -1],
    ]


# dim 32: bf16 takes the AMX core where there is one, over many 256-key chunks and tiles
@pytest.mark.parametrize("dim", [16, 32])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_indexer_long_context_split_across_threads(dtype, dim):
    # One decode query over 9000 positions: cut into pieces merged afterwards (2+ threads),
    # plus a prefill of 5 queries; integer scores, so exact (and tie-heavy).
    inputs = make_indexer([9000, 300], [1, 5], 8, dim, 64, dtype, 200, seed=3, values="integer")
    scores = dsa_visible_scores_ref(*inputs.args()[:7])
    with _threads(2):
        selected = dsa_indexer_topk(*inputs.args())
    assert_selection_valid(selected, scores, 200)
    assert torch.equal(selected, dsa_indexer_topk_ref(*inputs.args()))


def test_indexer_strided_q_and_weights():
    inputs = make_indexer([70], [3], 4, 16, 16, torch.bfloat16, 10, seed=4, values="integer")
    wide_q = torch.zeros(3, 4, 24, dtype=torch.bfloat16)
    wide_q[..., 8:] = inputs.q
    weights_t = inputs.weights.T.contiguous().T  # column-major [T, Hi]
    args = (wide_q[..., 8:], weights_t, *inputs.args()[2:])
    assert not args[0].is_contiguous() and not args[1].is_contiguous()
    assert torch.equal(dsa_indexer_topk(*args), dsa_indexer_topk_ref(*inputs.args()))


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"weights": torch.ones(3, 4, dtype=torch.bfloat16)}, TypeError, "weights must be float32"),
        ({"topk": 0}, ValueError, "topk must be at least 1"),
        ({"kv_lens": torch.tensor([99], dtype=torch.int32)}, ValueError, r"kv_lens\[0\] = 99"),
        ({"block_table": torch.full((1, 8), 50, dtype=torch.int32)}, IndexError, "out of range"),
        ({"query_start_loc": torch.tensor([0, 2], dtype=torch.int32)}, ValueError, "num_tokens"),
    ],
)
def test_indexer_invalid_inputs_raise(change, error, match):
    inputs = make_indexer([20], [3], 4, 16, 8, torch.bfloat16, 4, seed=5)
    names = ["q", "weights", "index_cache", "block_table", "kv_lens", "query_start_loc",
             "positions", "topk"]  # fmt: skip
    args = {**dict(zip(names, inputs.args(), strict=True)), **change}
    with pytest.raises(error, match=match):
        dsa_indexer_topk(*args.values())


# ---- mla_attention_sparse ------------------------------------------------------------------


def _random_selection(inputs, topk: int, seed: int) -> torch.Tensor:
    """Per query: a random subset of its sequence's positions (distinct, any order, up to topk)
    with -1 entries scattered anywhere in the row."""
    gen = torch.Generator().manual_seed(seed)
    starts_ = inputs.query_start_loc.tolist()
    selected = torch.full((inputs.q.shape[0], topk), -1, dtype=torch.int64)
    for b, kv_len in enumerate(inputs.kv_lens.tolist()):
        for t in range(starts_[b], starts_[b + 1]):
            n = int(torch.randint(0, min(kv_len, topk) + 1, (1,), generator=gen))
            chosen = torch.randperm(kv_len, generator=gen)[:n]
            slots = torch.randperm(topk, generator=gen)[:n]
            selected[t, slots] = chosen
    return selected


def _sparse_args(inputs, selected) -> tuple:
    i = inputs
    return (i.q, i.kv_cache, i.block_table, i.kv_lens, i.query_start_loc, selected, i.scale,
            i.kv_lora_rank)  # fmt: skip


def test_opcheck_mla_attention_sparse():
    inputs = make_paged([20, 0, 5], [2, 1, 1], 3, 24, 8, 8, torch.bfloat16, seed=0)
    selected = _random_selection(inputs, 6, seed=0)
    torch.library.opcheck(OPS.mla_attention_sparse.default, _sparse_args(inputs, selected))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    block_size=st.sampled_from([1, 16, 64]),
    dims=st.sampled_from([(512, 64), (32, 8), (45, 19), (7, 4)]),
    num_heads=st.sampled_from([1, 5, 16, 80]),
    dtype=st.sampled_from(FLOAT_DTYPES),
    topk=st.sampled_from([1, 8, 40]),
    seed=st.integers(0, 2**31 - 1),
)
def test_sparse_matches_reference(data, block_size, dims, num_heads, dtype, topk, seed):
    num_seqs = data.draw(st.integers(1, 3))
    kv_lens = [data.draw(_lengths(topk, block_size)) for _ in range(num_seqs)]
    q_lens = [data.draw(st.sampled_from([0, 1, 2, 4])) for _ in range(num_seqs)]
    lkv, r = dims
    inputs = make_paged(kv_lens, q_lens, num_heads, lkv, r, block_size, dtype, seed, "random")
    args = _sparse_args(inputs, _random_selection(inputs, topk, seed))
    out, lse = mla_attention_sparse(*args)
    assert_attention_close(out, lse, *mla_attention_sparse_ref(*args), dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_sparse_deepseek_decode_shape(dtype):
    # H=128 (two head groups per query), Lkv=512, R=64, a batch of decodes.
    inputs = make_paged([300, 40, 0, 129], [1, 1, 1, 1], 128, 512, 64, 16, dtype, seed=1)
    args = _sparse_args(inputs, _random_selection(inputs, 64, seed=1))
    out, lse = mla_attention_sparse(*args)
    assert_attention_close(out, lse, *mla_attention_sparse_ref(*args), dtype)


def test_sparse_single_query_split_across_threads():
    # One query, 2048 selected of 3000: few groups, so its keys are split and merged.
    inputs = make_paged([3000], [1], 16, 64, 16, 16, torch.bfloat16, seed=2)
    selected = torch.randperm(3000, generator=torch.Generator().manual_seed(2))[:2048][None]
    args = _sparse_args(inputs, selected)
    with _threads(2):
        out, lse = mla_attention_sparse(*args)
    assert_attention_close(out, lse, *mla_attention_sparse_ref(*args), torch.bfloat16)


def test_sparse_over_every_visible_position_equals_paged_attention():
    # The indexer with topk >= context selects every visible position: the sparse step is then
    # the dense one (prefill, causal).
    paged = make_paged([40, 17], [5, 3], 8, 32, 8, 16, torch.float32, seed=3)
    index = make_indexer([40, 17], [5, 3], 2, 8, 16, torch.float32, 64, seed=3)
    index = type(index)(**{**index.__dict__, "positions": paged.positions})
    selected = dsa_indexer_topk(*index.args())
    out, lse = mla_attention_sparse(*_sparse_args(paged, selected))
    dense_out, dense_lse = mla_attention_paged(*paged.args())
    torch.testing.assert_close(lse, dense_lse, atol=2e-5, rtol=0)
    torch.testing.assert_close(out, dense_out, atol=2e-5, rtol=2e-5)


def test_sparse_empty_selection_gives_zero_and_neg_inf():
    inputs = make_paged([5, 0], [2, 1], 3, 16, 8, 4, torch.bfloat16, seed=4)
    selected = torch.tensor([[-1, -1], [4, -1], [-1, -1]])
    out, lse = mla_attention_sparse(*_sparse_args(inputs, selected))
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[2], out[0])
    assert torch.all(lse[:, 0] == -math.inf) and torch.all(lse[:, 2] == -math.inf)
    assert torch.all(torch.isfinite(lse[:, 1]))


@pytest.mark.parametrize(
    ("row", "error", "match"),
    [
        ([3, 20], IndexError, r"selected\[1, 1\] = 20 is out of range for query 1"),
        ([-2, 0], IndexError, r"selected\[1, 0\] = -2 is out of range for query 1"),
        ([5, 5], ValueError, "position 5 twice"),
    ],
)
def test_sparse_invalid_selection_raises(row, error, match):
    inputs = make_paged([20], [2], 2, 16, 8, 16, torch.bfloat16, seed=5)
    selected = torch.tensor([[0, 1], row])
    with pytest.raises(error, match=match):
        mla_attention_sparse(*_sparse_args(inputs, selected))


# ---- ISA paths -------------------------------------------------------------------------------

_ROOT = Path(__file__).resolve().parents[1]
# Representative tests (both ops and V4's one-pass attention on the same core, every dtype,
# splits, ties, odd widths, the property tests) rerun per path.
_SUBSET = [
    "tests/test_kernel_dsa.py::test_isa_is_the_expected_one",
    "tests/test_kernel_dsa.py::test_indexer_exact_scores_match_reference",
    "tests/test_kernel_dsa.py::test_indexer_random_scores_match_reference_up_to_near_ties",
    "tests/test_kernel_dsa.py::test_indexer_ties_earlier_position_wins",
    "tests/test_kernel_dsa.py::test_indexer_topk_larger_than_context_pads_with_minus_one",
    "tests/test_kernel_dsa.py::test_indexer_long_context_split_across_threads",
    "tests/test_kernel_dsa.py::test_indexer_strided_q_and_weights",
    "tests/test_kernel_dsa.py::test_sparse_deepseek_decode_shape",
    "tests/test_kernel_dsa.py::test_sparse_single_query_split_across_threads",
    "tests/test_kernel_dsa.py::test_sparse_empty_selection_gives_zero_and_neg_inf",
    "tests/test_v4_attention_ops.py::test_matches_attend_with_sinks",
    "tests/test_v4_attention_ops.py::test_long_key_lists_split_across_threads",
    "tests/test_v4_attention_ops.py::test_batch_invariant_mode_cuts_the_keys_in_pieces",
    "tests/test_v4_attention_ops.py::test_no_keys_gives_zero",
]
_PATHS = {
    "portable": ({"MLAFX_DISABLE_AVX512": "1"}, ("portable",)),
    "avx512": ({"MLAFX_DISABLE_AVX512": "0"}, ("avx512_bf16", "avx512_amx")),
    # on a CPU with tiles, the AVX-512 cores that the default (AMX) path replaces
    "avx512_no_amx": ({"MLAFX_DISABLE_AVX512": "0", "MLAFX_DISABLE_AMX": "1"}, ("avx512_bf16",)),
}


def _cpu_has_avx512_bf16() -> bool:
    flags = Path("/proc/cpuinfo").read_text().split()
    return all(f in flags for f in ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"))


def test_isa_is_the_expected_one():
    expected = os.environ.get("MLAFX_EXPECT_ISA")
    if expected is None:
        pytest.skip("runs in the ISA children (MLAFX_EXPECT_ISA names the path)")
    assert cpu_isa() in expected.split(",")


@pytest.mark.parametrize("path", list(_PATHS))
def test_isa_path_passes_subset(path):
    if os.environ.get("MLAFX_EXPECT_ISA") is not None:
        pytest.skip("already an ISA child")
    if path.startswith("avx512") and not _cpu_has_avx512_bf16():
        pytest.skip("CPU lacks AVX-512 BF16 (avx512f/bw/vl/dq/avx512_bf16): the AVX-512 "
                    "indexer and attention cores cannot run here")  # fmt: skip
    if path == "avx512_no_amx" and cpu_isa() != "avx512_amx":
        pytest.skip("no tile unit here: the avx512 child already runs the AVX-512 cores")
    overrides, isas = _PATHS[path]
    env = {**os.environ, **overrides, "MLAFX_EXPECT_ISA": ",".join(isas)}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *_SUBSET],
        cwd=_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]
