"""Batch-invariant mode of the kernels (issue 27): with ``set_batch_invariant(True)`` a row's
output is bitwise the same whatever else is in the call and however its sequence's queries are
chunked. Attention: a sequence alone, inside a batch of others, as the last row of a prefill
chunk and of a whole prefill, over contexts below and across the fixed split size; experts: a
token alone and among hundreds (its experts past the streaming size); linears (bf16/fp32,
int8/int4 and block FP8) and the absorbed per-head products: a row alone and among more rows
than any size threshold. Each ISA path in a child process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mlafx.kernels import (
    batch_invariant,
    batch_invariant_mode,
    batched_matmul,
    cpu_isa,
    linear_packed,
    mla_attention_paged,
    moe_experts,
    pack_linear_weight,
    set_batch_invariant,
)
from mlafx.kernels.fp8_format import quantize_fp8, scale_shape
from mlafx.kernels.fp8_ops import linear_fp8, moe_experts_fp8
from mlafx.kernels.quant_ops import (
    linear_quantized,
    moe_experts_quantized,
    quantize_experts,
    quantize_linear_weight,
)
from tests.attention_cases import paged_cache
from tests.kquant_cases import Q, kquant_moe_case, kquant_weight

ROOT = Path(__file__).resolve().parents[1]
HEADS, RANK, ROPE, BLOCK = 16, 512, 64, 16
WIDTH = RANK + ROPE


@pytest.fixture
def invariant():
    set_batch_invariant(True)
    try:
        yield
    finally:
        set_batch_invariant(False)


class Sequences:
    """Cache rows and one query per position for a few sequences, so that any call can be
    built from (sequence, kv_len, first new position) entries over the same values."""

    def __init__(self, lengths: list[int], dtype: torch.dtype, seed: int):
        gen = torch.Generator().manual_seed(seed)
        self.dtype = dtype
        self.rows = [torch.randn(n, WIDTH, generator=gen).to(dtype) for n in lengths]
        self.queries = [torch.randn(n, HEADS, WIDTH, generator=gen).to(dtype) for n in lengths]

    def attend(self, entries: list[tuple[int, int, int]], seed: int) -> list[torch.Tensor]:
        """Outputs [kv_len - first, H, RANK] per entry (seq, kv_len, first) of one call."""
        gen = torch.Generator().manual_seed(seed)
        cache, table = paged_cache(
            [self.rows[s][:n] for s, n, _ in entries], BLOCK, self.dtype, gen
        )
        q = torch.cat([self.queries[s][a:n] for s, n, a in entries])
        starts = [0]
        for _, n, a in entries:
            starts.append(starts[-1] + n - a)
        positions = torch.cat([torch.arange(a, n) for _, n, a in entries])
        out, _ = mla_attention_paged(
            q, cache, table, torch.tensor([n for _, n, _ in entries], dtype=torch.int32),
            torch.tensor(starts, dtype=torch.int32), positions, WIDTH**-0.5, RANK,
        )  # fmt: skip
        return [out[starts[i] : starts[i + 1]] for i in range(len(entries))]


def test_mode_switch_round_trips():
    assert batch_invariant() is False
    set_batch_invariant(True)
    try:
        assert batch_invariant() is True
    finally:
        set_batch_invariant(False)
    assert batch_invariant() is False


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_row_is_the_same_in_any_call(invariant, dtype):
    # sequence 0 crosses the split size twice, sequence 1 stays under it; 2.. are neighbours
    seqs = Sequences([1300, 300, 2000, 7, 513, 900, 64, 1500], dtype, seed=0)
    others = [(s, n, n - 1) for s, n in [(2, 2000), (3, 7), (4, 513), (5, 900), (6, 64)]]
    for s, n in [(0, 1300), (1, 300), (0, 700)]:
        alone = seqs.attend([(s, n, n - 1)], seed=1)[0]
        in_batch = seqs.attend([others[0], (s, n, n - 1), *others[1:]], seed=2)[1]
        chunk = seqs.attend([(7, 1500, 1400), (s, n, n - 37)], seed=3)[1][-1:]
        whole = seqs.attend([(s, n, 0), others[2]], seed=4)[0]
        assert torch.equal(in_batch, alone)
        assert torch.equal(chunk, alone)
        assert torch.equal(whole[-1:], alone)
        # every position of the whole prefill equals its own decode over the same prefix
        for p in [p for p in [0, 299, 511, 512, 1024] if p < n]:
            assert torch.equal(whole[p : p + 1], seqs.attend([(s, p + 1, p)], seed=5)[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_experts_row_is_the_same_in_any_call(invariant, dtype):
    gen = torch.Generator().manual_seed(0)
    T, D, inter, E, k = 300, 256, 192, 4, 2  # ~150 pairs per expert: past any streaming size
    x = torch.randn(T, D, generator=gen).to(dtype)
    ids = torch.randint(0, E, (T, k), generator=gen)
    ids[7, 1] = ids[7, 0]  # a token picking one expert twice
    weights = torch.rand(T, k, generator=gen)
    w13 = (torch.randn(E, 2 * inter, D, generator=gen) / D**0.5).to(dtype)
    w2 = (torch.randn(E, D, inter, generator=gen) / inter**0.5).to(dtype)
    batch = moe_experts(x, ids, weights, w13, w2)
    for t in [0, 7, 150, 299]:
        alone = moe_experts(x[t : t + 1], ids[t : t + 1], weights[t : t + 1], w13, w2)
        assert torch.equal(batch[t : t + 1], alone), t
    few = moe_experts(x[:9], ids[:9], weights[:9], w13, w2)
    assert torch.equal(batch[:9], few)
    # top-3 with experts 1 and 3 rare (streamed) beside popular 0 and 2 (blocked where the
    # kernels allow): a token's three terms still add up in expert order
    ids3 = torch.tensor([0, 2, 0]).repeat(T, 1)
    ids3[::2, 2] = 2
    ids3[::40, 2], ids3[5::40, 0] = 3, 1
    weights3 = torch.rand(T, 3, generator=gen)
    mixed = moe_experts(x, ids3, weights3, w13, w2)
    for t in [0, 5, 40, 45, 299]:
        alone = moe_experts(x[t : t + 1], ids3[t : t + 1], weights3[t : t + 1], w13, w2)
        assert torch.equal(mixed[t : t + 1], alone), t


def _mixed_routing(rows: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-3 ids and weights for ``rows`` tokens over 4 experts: 1 and 3 rare (streamed)
    between the popular 0 and 2 (run on all threads one after the other), so a token's terms
    come from both kinds of group."""
    ids = torch.tensor([0, 2, 0]).repeat(rows, 1)
    ids[::2, 2] = 2
    ids[::40, 2], ids[5::40, 0] = 3, 1
    return ids, torch.rand(rows, 3, generator=gen)


def _assert_each_token_alone(experts, x: torch.Tensor, ids, weights) -> None:
    """``experts(x, ids, weights)`` of a few tokens alone equal their rows of the whole call."""
    mixed = experts(x, ids, weights)
    for t in [0, 5, 40, 45, 299]:
        alone = experts(x[t : t + 1], ids[t : t + 1], weights[t : t + 1])
        assert torch.equal(mixed[t : t + 1], alone), t


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_row_is_the_same_in_any_call(invariant, dtype, bits):
    """int8/int4 (quantize-on-load's formats): the linear's kernels (one row, row tiles, AMX-INT8
    from 32-48 rows) give a row the same bits; the experts add a token's terms in expert order
    (fp32 x, so that the sums' order would show)."""
    gen = torch.Generator().manual_seed(bits)
    M, K, N = 300, 320, 144
    x = torch.randn(M, K, generator=gen).to(dtype)
    packed = quantize_linear_weight((torch.randn(N, K, generator=gen) / K**0.5).to(dtype), bits)
    batch = linear_quantized(x, packed, N)
    for m in [0, 1, 299]:
        assert torch.equal(batch[m : m + 1], linear_quantized(x[m : m + 1], packed, N)), m
    for rows in [8, 33, 64]:
        assert torch.equal(batch[:rows], linear_quantized(x[:rows], packed, N)), rows
    D, inter, E = 256, 192, 4
    x = torch.randn(M, D, generator=gen).to(dtype)
    w13 = quantize_experts((torch.randn(E, 2 * inter, D, generator=gen) / D**0.5).to(dtype), bits)
    w2 = quantize_experts((torch.randn(E, D, inter, generator=gen) / inter**0.5).to(dtype), bits)
    ids, weights = _mixed_routing(M, gen)
    _assert_each_token_alone(lambda *a: moe_experts_quantized(*a, w13, w2, inter), x, ids, weights)


def _fp8_stack(count: int, rows: int, cols: int, block: tuple[int, int], gen) -> tuple:
    """``count`` weights [rows, cols] as stacked e4m3 bytes and block scales."""
    pairs = [
        quantize_fp8(torch.randn(rows, cols, generator=gen) / cols**0.5, block)
        for _ in range(count)
    ]
    return torch.stack([w for w, _ in pairs]), torch.stack([s for _, s in pairs])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("block", [(128, 128), (16, 32)])
def test_block_fp8_row_is_the_same_in_any_call(invariant, dtype, block):
    """Block FP8 (DeepSeek's checkpoints): linear_fp8 gives a row the same bits alone and among
    more rows than the tile (4), row-tile (8) and GEMM (64) thresholds: AMX tiles from one row,
    else the one-row tiles 8 rows at a time ([16, 32] blocks: the widening kernels); the experts
    add a token's terms in expert order."""
    gen = torch.Generator().manual_seed(block[1])
    M, K, N = 300, 1024, 256  # every row alone: bf16 outputs hide most reorderings of the sums
    x = torch.randn(M, K, generator=gen).to(dtype)
    w, s = quantize_fp8(torch.randn(N, K, generator=gen) / K**0.5, block)
    batch = linear_fp8(x, w, s, block)
    alone = torch.cat([linear_fp8(x[m : m + 1], w, s, block) for m in range(M)])
    assert torch.equal(batch, alone)
    for rows in [3, 9, 33, 64]:
        assert torch.equal(batch[:rows], linear_fp8(x[:rows], w, s, block)), rows
    D, inter, E = 256, 192, 4
    x = torch.randn(M, D, generator=gen).to(dtype)
    gate, gate_s = _fp8_stack(E, inter, D, block, gen)
    up, up_s = _fp8_stack(E, inter, D, block, gen)
    w13, s13 = torch.cat([gate, up], 1), torch.cat([gate_s, up_s], 1)
    w2, s2 = _fp8_stack(E, D, inter, block, gen)
    assert s13.shape[1] == 2 * scale_shape(inter, D, block)[0]
    ids, weights = _mixed_routing(M, gen)
    _assert_each_token_alone(
        lambda *a: moe_experts_fp8(*a, w13, s13, w2, s2, block), x, ids, weights
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gguf_k_quant_row_is_the_same_in_any_call(invariant, dtype):
    """GGUF's K-quants (Q4_K, Q6_K repacked into k4 / k8): one kernel at every row count (rows
    split among the threads from 64), so a row alone equals it among 300; the experts add a
    token's terms in expert order."""
    gen = torch.Generator().manual_seed(5)
    M, K, N = 300, 512, 144
    x = torch.randn(M, K, generator=gen).to(dtype)
    for qtype in (Q.Q4_K, Q.Q6_K):
        packed = kquant_weight(qtype, N, K, gen)
        batch = linear_quantized(x, packed, N)
        alone = torch.cat([linear_quantized(x[m : m + 1], packed, N) for m in range(M)])
        assert torch.equal(batch, alone), qtype
    _, _, _, w13, w2, inter = kquant_moe_case(1, 256, 256, 4, 3, gen)
    x = torch.randn(M, 256, generator=gen).to(dtype)
    ids, weights = _mixed_routing(M, gen)
    _assert_each_token_alone(lambda *a: moe_experts_quantized(*a, w13, w2, inter), x, ids, weights)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_row_is_the_same_in_any_call(invariant, dtype, with_bias):
    gen = torch.Generator().manual_seed(0)
    M, K, N = 600, 320, 144  # 600 rows: past every path's streaming limit
    x = torch.randn(M, K, generator=gen).to(dtype)
    packed = pack_linear_weight((torch.randn(N, K, generator=gen) / K**0.5).to(dtype))
    bias = torch.randn(N, generator=gen).to(dtype) if with_bias else None
    batch = linear_packed(x, packed, N, bias)
    for m in [0, 1, 299, 599]:
        assert torch.equal(batch[m : m + 1], linear_packed(x[m : m + 1], packed, N, bias)), m
    assert torch.equal(batch[:40], linear_packed(x[:40], packed, N, bias))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_batched_matmul_row_is_the_same_in_any_call(invariant, dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 300, 128, generator=gen).to(dtype)  # the absorbed q: [H, N, P]
    w = (torch.randn(16, 128, 512, generator=gen) / 128**0.5).to(dtype)  # W_UK [H, P, Lkv]
    batch = batched_matmul(x, w)
    torch.testing.assert_close(batch.double(), x.double() @ w.double(), atol=2e-2, rtol=1e-2)
    for m in [1, 2, 3, 17, 40]:  # fp32 bmm itself takes another kernel below 4 rows
        assert torch.equal(batch[:, :m], batched_matmul(x[:, :m], w)), m
    assert torch.equal(batch[:, 299:], batched_matmul(x[:, 299:], w))


@settings(max_examples=30, deadline=None)
@given(
    b=st.integers(1, 4), m=st.integers(0, 40), k=st.integers(1, 33), n=st.integers(1, 20),
    dtype=st.sampled_from([torch.bfloat16, torch.float32]), mode=st.booleans(),
    seed=st.integers(0, 2**16),
)  # fmt: skip
def test_batched_matmul_matches_fp64_bmm(b, m, k, n, dtype, mode, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, m, k, generator=gen).to(dtype)
    w = torch.randn(b, k, n, generator=gen).to(dtype)
    with batch_invariant_mode(mode):
        out = batched_matmul(x, w)
    assert out.dtype == dtype and out.shape == (b, m, n)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    ref = x.double() @ w.double()
    torch.testing.assert_close(out.double(), ref, atol=tol * k**0.5, rtol=tol)


@pytest.mark.parametrize("mode", [False, True])
def test_batched_matmul_opcheck(mode):
    set_batch_invariant(mode)
    try:
        x, w = torch.randn(3, 21, 8), torch.randn(3, 8, 5)
        assert torch.equal(batched_matmul(x, w), torch.bmm(x, w)) or mode
        torch.library.opcheck(torch.ops.mlafx.batched_matmul.default, (x, w))
    finally:
        set_batch_invariant(False)
    with pytest.raises(ValueError, match="must be"):
        batched_matmul(x, torch.randn(3, 7, 5))


PATHS = {
    "portable": {"MLAFX_DISABLE_AVX512": "1"},
    "avx512": {"MLAFX_DISABLE_AMX": "1"},  # the default path where there are no tiles
    # block FP8 without VBMI's byte tables (the only kernels that use them)
    "avx512_bf16": {"MLAFX_DISABLE_AMX": "1", "MLAFX_DISABLE_VBMI": "1"},
}
ONLY = {"avx512_bf16": "block_fp8"}


@pytest.mark.parametrize("path", list(PATHS))
def test_other_paths_are_invariant(path):
    if os.environ.get("MLAFX_INVARIANT_CHILD"):
        pytest.skip("inside the child run")
    if path == "avx512" and cpu_isa() != "avx512_amx":
        pytest.skip("no tile unit here: the default path is the AVX-512 one")
    if path == "avx512_bf16" and not cpu_isa().startswith("avx512"):
        pytest.skip("no AVX-512 BF16 here")
    env = {**os.environ, "MLAFX_DISABLE_AVX512": "0", "MLAFX_DISABLE_AMX": "0", **PATHS[path]}
    env["MLAFX_INVARIANT_CHILD"] = "1"
    only = ["-k", ONLY[path]] if path in ONLY else []
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *only, __file__],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
