"""mlafx.kernels.v4_sparse_attention (DeepSeek-V4's window + pool attention with sinks, from
mla_attention_sparse and merge_attn_states) against the reference model's attend_with_sinks
over the same keys: decode and multi-query sequences, windows cut short at the start, empty
pools and empty selections, random sinks (their zero init hides bugs), fp32 and bf16."""

from __future__ import annotations

import pytest
import torch
from attention_cases import paged_cache
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlafx.kernels.v4_attention import v4_sparse_attention
from mlafx.models.deepseek_v4.attention import attend_with_sinks

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _case(seed: int, dtype: torch.dtype, block: int, pool_block: int, with_pool: bool):
    gen = torch.Generator().manual_seed(seed)
    heads, width, window, rate, topk = 4, 64, 5, 4, 3
    lens = [int(n) for n in torch.randint(1, 40, (3,), generator=gen)]
    q_lens = [
        min(n, int(q)) for n, q in zip(lens, torch.randint(1, 4, (3,), generator=gen), strict=True)
    ]
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
    out = v4_sparse_attention(
        q, starts, window_cache, window_table, torch.tensor(lens, dtype=torch.int32),
        torch.tensor(window_sel), sinks, width**-0.5, pool,
    )  # fmt: skip
    expected = [
        attend_with_sinks(q[t : t + 1].float(), k.to(dtype).float(),
                          torch.ones(1, k.shape[0], dtype=torch.bool), sinks, width**-0.5)[0]
        for t, k in enumerate(keys)
    ]  # fmt: skip
    return out, torch.stack(expected)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
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
