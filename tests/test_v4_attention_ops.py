"""mlafx::v4_attention (DeepSeek-V4's window + pool attention with sinks in one pass,
mlafx.kernels.v4_sparse_attention) against the reference model's attend_with_sinks over the
same keys: decode and multi-query sequences, windows cut short at the start, empty pools and
empty selections, random sinks (their zero init hides bugs), fp32, fp16 and bf16, key lists
long enough to be split across threads, batch-invariant mode, opcheck and its errors. The ISA
children of tests/test_kernel_dsa.py rerun the cases per attention core."""

from __future__ import annotations

import pytest
import torch
from attention_cases import paged_cache
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlafx.kernels import set_batch_invariant
from mlafx.kernels.v4_attention import v4_sparse_attention
from mlafx.models.deepseek_v4.attention import attend_with_sinks

TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
OPS = torch.ops.mlafx


def _case(
    seed: int,
    dtype: torch.dtype,
    block: int,
    pool_block: int,
    with_pool: bool,
    *,
    heads: int = 4,
    width: int = 64,
    window: int = 5,
    topk: int = 3,
    min_len: int = 1,
    max_len: int = 40,
    seqs: int = 3,
    q_len: int | None = None,  # queries per sequence (None: 1-3 at random)
    args_only: bool = False,
):
    gen = torch.Generator().manual_seed(seed)
    rate = 4
    lens = [int(n) for n in torch.randint(min_len, max_len, (seqs,), generator=gen)]
    drawn = torch.randint(1, 4, (seqs,), generator=gen).tolist()
    q_lens = [min(n, q_len or q) for n, q in zip(lens, drawn, strict=True)]
    tokens = [torch.randn(n, width, generator=gen) for n in lens]
    entries = [torch.randn(n // rate, width, generator=gen) for n in lens]
    window_cache, window_table = paged_cache(tokens, block, dtype, gen)
    pool_cache, pool_table = paged_cache(entries, pool_block, dtype, gen)
    q_rows, window_sel, pool_sel, keys = [], [], [], []
    for b, n in enumerate(lens):
        for p in range(n - q_lens[b], n):  # the sequence's last q_lens[b] tokens
            q_rows.append(torch.randn(heads, width, generator=gen))
            seen = list(range(max(0, p - window + 1), p + 1))
            window_sel.append(seen + [-1] * (window - len(seen)))
            visible = (p + 1) // rate
            chosen = torch.randperm(visible, generator=gen)[:topk].tolist() if visible else []
            pool_sel.append(chosen + [-1] * (topk - len(chosen)))
            # the reference's keys: this query's rows, each attended once
            own = [tokens[b][j] for j in seen] + (
                [entries[b][w] for w in chosen] if with_pool else []
            )
            keys.append(torch.stack(own) if own else torch.zeros(0, width))
    q = torch.stack(q_rows).to(dtype)
    sinks = torch.randn(heads, generator=gen)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    pool = (
        (pool_cache, pool_table, torch.tensor([e.shape[0] for e in entries], dtype=torch.int32),
         torch.tensor(pool_sel))
        if with_pool else None
    )  # fmt: skip
    args = (q, starts, window_cache, window_table, torch.tensor(lens, dtype=torch.int32),
            torch.tensor(window_sel), sinks, width**-0.5, pool)  # fmt: skip
    if args_only:
        return args
    out = v4_sparse_attention(*args)
    expected = [
        attend_with_sinks(q[t : t + 1].float(), k.to(dtype).float(),
                          torch.ones(1, k.shape[0], dtype=torch.bool), sinks, width**-0.5)[0]
        for t, k in enumerate(keys)
    ]  # fmt: skip
    return out, torch.stack(expected)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
    block=st.sampled_from([1, 4, 16]),
    pool_block=st.sampled_from([1, 4]),
    with_pool=st.booleans(),
)
def test_matches_attend_with_sinks(seed, dtype, block, pool_block, with_pool):
    out, expected = _case(seed, dtype, block, pool_block, with_pool)
    assert out.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def _one_block(heads: int, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [1, heads, width], a cache whose block 1 holds 4 rows, and its one-block table."""
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, heads, width, generator=gen)
    cache = torch.randn(2, 4, width, generator=gen)
    return q, cache, torch.tensor([[1]], dtype=torch.int32)


def test_no_keys_gives_zero():
    heads, width = 2, 32
    q, cache, table = _one_block(heads, width)
    out = v4_sparse_attention(
        q, torch.tensor([0, 1], dtype=torch.int32), cache, table,
        torch.tensor([4], dtype=torch.int32), torch.full((1, 3), -1), torch.full((heads,), 0.5),
        width**-0.5,
    )  # fmt: skip
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("sink", [-30.0, 30.0])
def test_sink_weight(sink):
    """A very negative sink changes nothing; a very large one takes almost all the weight."""
    heads, width = 2, 16
    q, cache, table = _one_block(heads, width)
    args = (q, torch.tensor([0, 1], dtype=torch.int32), cache, table,
            torch.tensor([4], dtype=torch.int32), torch.tensor([[0, 1, 2, 3]]))  # fmt: skip
    with_sink = v4_sparse_attention(*args, torch.full((heads,), sink), width**-0.5)
    without = v4_sparse_attention(*args, torch.full((heads,), -1e4), width**-0.5)
    if sink < 0:
        torch.testing.assert_close(with_sink, without, atol=1e-6, rtol=1e-6)
    else:
        assert with_sink.abs().max() < 1e-9


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_long_key_lists_split_across_threads(dtype):
    """600-800 keys a query (V4-Flash: 128 + 512) and 2 queries: with 2 threads the driver
    splits each query's keys (past 512) and merges the parts before the sink's factor."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out, expected = _case(3, dtype, 16, 4, True, heads=8, width=64, window=300, topk=400,
                              min_len=1700, max_len=2000, seqs=1, q_len=2)  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


def test_batch_invariant_mode_cuts_the_keys_in_pieces():
    """Batch-invariant mode runs 9 queries of 1100-1300 keys in pieces of 512 merged in their
    item; the sink still scales the merged row once."""
    set_batch_invariant(True)
    try:
        out, expected = _case(4, torch.bfloat16, 4, 4, True, heads=4, width=64, window=600,
                              topk=500, min_len=2100, max_len=3000, q_len=3)  # fmt: skip
    finally:
        set_batch_invariant(False)
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)


def _op_args(with_pool: bool = True) -> tuple:
    q, starts, window_cache, window_table, lens, window_sel, sinks, scale, pool = _case(
        5, torch.bfloat16, 4, 4, with_pool, args_only=True
    )
    return (q, starts, window_cache, window_table, lens, window_sel, sinks, scale,
            *(pool if pool is not None else ()))  # fmt: skip


@pytest.mark.parametrize("with_pool", [True, False])
def test_opcheck_v4_attention(with_pool):
    torch.library.opcheck(OPS.v4_attention.default, _op_args(with_pool))


def test_bad_inputs_name_the_argument():
    args = list(_op_args())
    # positions past a pool's length, a repeated window position, a part of the pool
    pool_sel = args[11].clone()
    pool_sel[0, 0] = 10_000
    out_of_range = r"pool_selected\[0, 0\] = 10000 is out of range .*pool_lens\[0\]"
    with pytest.raises(IndexError, match=out_of_range):
        OPS.v4_attention(*args[:11], pool_sel)
    window_sel = args[5].clone()
    window_sel[0, 1] = window_sel[0, 0]  # a query's first window entry is a real position
    with pytest.raises(ValueError, match=r"window_selected\[0, :\] holds position"):
        OPS.v4_attention(*args[:5], window_sel, *args[6:])
    with pytest.raises(ValueError, match=r"\(all four or none\), got 3 of them"):
        OPS.v4_attention(*args[:11])
    with pytest.raises(TypeError, match="pool_cache must have q's dtype"):
        OPS.v4_attention(*args[:8], args[8].float(), *args[9:])
    with pytest.raises(TypeError, match="window_cache must have q's dtype"):
        OPS.v4_attention(*args[:2], args[2].float(), *args[3:])
    with pytest.raises(ValueError, match=r"sinks must be \[4\]"):
        OPS.v4_attention(*args[:6], args[6][:3], *args[7:])
