"""mlafx::mla_attention_paged and mlafx::varlen_attention against the Python references.

Tolerances (tests/attention_cases.py): bf16 out 1.5e-2 abs/rel (P is rounded to bf16 before
P.V on the AVX-512 path, the output to bf16), fp16 3e-3, fp32 2e-5; LSE 2e-3 (bf16/fp16) and
2e-5 (fp32) absolute. Caches hold NaN in every row that is not a token of some sequence and
invalid ids in unused block-table entries, so reading past kv_lens fails the comparison.
"""

from __future__ import annotations

import math

import pytest
import torch
from attention_cases import (
    FLOAT_DTYPES,
    assert_attention_close,
    make_paged,
    make_varlen,
    paged_cache,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlafx.kernels import merge_attn_states, mla_attention_paged, varlen_attention
from mlafx.kernels.attention_reference import mla_attention_paged_ref, varlen_attention_ref


# Lengths that stress blocks: empty, 1, 17, and either side of a block boundary.
def _lengths(block_size: int) -> st.SearchStrategy[int]:
    boundary = [block_size - 1, block_size, block_size + 1, 2 * block_size]
    return st.sampled_from(sorted({0, 1, 17, *[n for n in boundary if 0 < n <= 300]}))


def _check_paged(inputs, dtype) -> None:
    out, lse = mla_attention_paged(*inputs.args())
    ref_out, ref_lse = mla_attention_paged_ref(*inputs.args())
    assert_attention_close(out, lse, ref_out, ref_lse, dtype)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    block_size=st.sampled_from([1, 16, 64, 256]),
    # (512, 64), (64, 32) and (32, 0) run on the AMX core where there is one (widths that are
    # multiples of 32); the others on the AVX-512 core.
    dims=st.sampled_from([(512, 64), (64, 32), (45, 19), (32, 0), (7, 4)]),
    num_heads=st.sampled_from([1, 5, 16, 20]),
    dtype=st.sampled_from(FLOAT_DTYPES),
    position_mode=st.sampled_from(["decode", "context", "random"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_paged_matches_reference(data, block_size, dims, num_heads, dtype, position_mode, seed):
    num_seqs = data.draw(st.integers(1, 3))
    kv_lens = [data.draw(_lengths(block_size)) for _ in range(num_seqs)]
    q_lens = [data.draw(st.sampled_from([0, 1, 1, 2, 5])) for _ in range(num_seqs)]
    if position_mode == "decode":
        q_lens = [min(q, n) for q, n in zip(q_lens, kv_lens, strict=True)]
    lkv, r = dims
    inputs = make_paged(kv_lens, q_lens, num_heads, lkv, r, block_size, dtype, seed, position_mode)
    _check_paged(inputs, dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_fixed_paged_decode_deepseek_shapes(dtype):
    # DeepSeek-V2-Lite widths, a batch of decodes, long enough to be split across threads.
    inputs = make_paged([700, 33, 0, 300], [1, 1, 1, 1], 16, 512, 64, 16, dtype, seed=1)
    _check_paged(inputs, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fixed_paged_prefill_many_queries_and_heads(dtype):
    # 20 queries x 5 heads (several query groups per sequence) and 80 heads (head slices).
    _check_paged(make_paged([40, 130], [20, 13], 5, 24, 8, 16, dtype, seed=2), dtype)
    _check_paged(make_paged([70], [2], 80, 16, 8, 64, dtype, seed=3), dtype)


@pytest.mark.parametrize("block_size", [1, 16])
def test_fixed_paged_scores_growing_along_the_context(block_size):
    # Each key scores higher than the one before, so the running max keeps moving: the AMX
    # core's lazy max must rescale its output many times (and exactly), across splits.
    inputs = make_paged([1000, 77], [1, 1], 16, 512, 64, block_size, torch.bfloat16, seed=7)
    rows = inputs.kv_cache.view(-1, 576)
    slots = torch.arange(rows.shape[0])
    direction = inputs.q[0, 0].float() / inputs.q[0, 0].float().norm()
    growth = (slots % 1000).float()[:, None] * 0.05  # position of the row within its sequence
    real = ~torch.isnan(rows).any(dim=1)
    rows[real] = (rows[real].float() * 0.1 + growth[real] * direction).to(torch.bfloat16)
    _check_paged(inputs, torch.bfloat16)


def test_fixed_paged_no_visible_key_gives_zero_and_neg_inf():
    inputs = make_paged([5, 0], [2, 1], 3, 16, 8, 4, torch.bfloat16, seed=4, position_mode="decode")
    positions = torch.tensor([-1, 4, 0])  # query 0 sees nothing, query 2's sequence is empty
    inputs = type(inputs)(**{**inputs.__dict__, "positions": positions})
    out, lse = mla_attention_paged(*inputs.args())
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[2], out[0])
    assert torch.all(lse[:, 0] == -math.inf) and torch.all(lse[:, 2] == -math.inf)
    assert torch.all(torch.isfinite(lse[:, 1]))


def test_fixed_paged_nan_in_visible_row_propagates():
    inputs = make_paged([20], [1], 2, 16, 8, 16, torch.bfloat16, seed=5)
    block = int(inputs.block_table[0, 0])
    inputs.kv_cache[block, 3, 0] = math.nan
    out, lse = mla_attention_paged(*inputs.args())
    assert torch.isnan(out).all() and torch.isnan(lse).all()


def test_fixed_paged_strided_q():
    inputs = make_paged([50], [3], 4, 32, 8, 16, torch.bfloat16, seed=6)
    wide = torch.zeros(3, 4, 48, dtype=torch.bfloat16)
    wide[..., 8:] = inputs.q
    strided = type(inputs)(**{**inputs.__dict__, "q": wide[..., 8:]})
    assert not strided.q.is_contiguous()
    _check_paged(strided, torch.bfloat16)


# ---- varlen_attention ------------------------------------------------------------------------


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    dims=st.sampled_from([(128, 64, 128), (64, 32, 64), (16, 8, 32), (7, 3, 5), (24, 0, 16)]),
    num_heads=st.sampled_from([1, 3, 16]),
    dtype=st.sampled_from(FLOAT_DTYPES),
    causal=st.booleans(),
    strided=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_varlen_matches_reference(data, dims, num_heads, dtype, causal, strided, seed):
    num_seqs = data.draw(st.integers(1, 3))
    lens = st.sampled_from([0, 1, 2, 17, 64, 65, 100])
    q_lens = [data.draw(lens) for _ in range(num_seqs)]
    # k_len >= q_len is the usual prefill; shorter key runs leave leading rows with no key.
    k_lens = [data.draw(st.sampled_from([q, q, q + 17, max(0, q - 3)])) for q in q_lens]
    p, r, v = dims
    inputs = make_varlen(q_lens, k_lens, num_heads, p, r, v, dtype, causal, seed, strided)
    out, lse = varlen_attention(*inputs.args())
    ref_out, ref_lse = varlen_attention_ref(*inputs.args())
    assert_attention_close(out, lse, ref_out, ref_lse, dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_fixed_varlen_causal_prefill(dtype):
    inputs = make_varlen([150, 1, 0, 70], [150, 1, 5, 90], 4, 128, 64, 128, dtype, True, seed=7)
    out, lse = varlen_attention(*inputs.args())
    ref_out, ref_lse = varlen_attention_ref(*inputs.args())
    assert_attention_close(out, lse, ref_out, ref_lse, dtype)


def test_fixed_varlen_leading_rows_without_keys():
    # q_len 5 > k_len 2, causal bottom-right: rows 0..2 see nothing.
    inputs = make_varlen([5], [2], 2, 8, 4, 8, torch.float32, True, seed=8)
    out, lse = varlen_attention(*inputs.args())
    assert torch.equal(out[:3], torch.zeros_like(out[:3]))
    assert torch.all(lse[:, :3] == -math.inf) and torch.all(torch.isfinite(lse[:, 3:]))


def test_fixed_varlen_long_single_query_is_split():
    # One query against many keys: one group, so the keys are split across threads.
    inputs = make_varlen([1], [3000], 2, 16, 8, 16, torch.bfloat16, False, seed=9)
    out, lse = varlen_attention(*inputs.args())
    ref_out, ref_lse = varlen_attention_ref(*inputs.args())
    assert_attention_close(out, lse, ref_out, ref_lse, torch.bfloat16)


# ---- the two compute paths agree ------------------------------------------------------------


def _mla_problem(ctx_len: int, new: int, seed: int, dtype=torch.float32):
    """Weights, new queries, cache rows of one sequence: context + new tokens."""
    gen = torch.Generator().manual_seed(seed)
    heads, lkv, r, p, v = 4, 64, 16, 32, 24
    w_uk = torch.randn(heads, p, lkv, generator=gen) / lkv**0.5  # views of kv_b_proj
    w_uv = torch.randn(heads, v, lkv, generator=gen) / lkv**0.5
    q_nope = torch.randn(new, heads, p, generator=gen)
    q_pe = torch.randn(new, heads, r, generator=gen)
    kv_c = torch.randn(ctx_len + new, lkv, generator=gen)
    k_pe = torch.randn(ctx_len + new, r, generator=gen)
    return dict(heads=heads, lkv=lkv, r=r, p=p, v=v, w_uk=w_uk, w_uv=w_uv, q_nope=q_nope,
                q_pe=q_pe, kv_c=kv_c, k_pe=k_pe, scale=(p + r) ** -0.5)  # fmt: skip


def _absorbed(m, kv_len, positions, block_size, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.cat([m["kv_c"], m["k_pe"]], dim=-1)
    cache, table = paged_cache([rows], block_size, dtype, gen)
    q_lat = torch.einsum("thp,hpl->thl", m["q_nope"], m["w_uk"])
    q = torch.cat([q_lat, m["q_pe"]], dim=-1).to(dtype)
    out_lat, lse = mla_attention_paged(
        q,
        cache,
        table,
        torch.tensor([kv_len], dtype=torch.int32),
        torch.tensor([0, q.shape[0]], dtype=torch.int32),
        positions,
        m["scale"],
        m["lkv"],
    )
    return torch.einsum("thl,hvl->thv", out_lat.float(), m["w_uv"]), lse


def test_absorbed_equals_naive_decompressed_mha():
    ctx, new = 37, 5
    m = _mla_problem(ctx, new, seed=10)
    positions = torch.arange(ctx, ctx + new)
    out, lse = _absorbed(m, ctx + new, positions, 16, torch.float32, seed=11)
    # Naive: decompress every key per head, one masked SDPA.
    k_nope = torch.einsum("sl,hpl->hsp", m["kv_c"], m["w_uk"])
    k = torch.cat([k_nope, m["k_pe"].expand(m["heads"], -1, -1)], dim=-1)  # [H, S, P+R]
    v = torch.einsum("sl,hvl->hsv", m["kv_c"], m["w_uv"])
    q = torch.cat([m["q_nope"], m["q_pe"]], dim=-1).transpose(0, 1)  # [H, new, P+R]
    mask = torch.arange(ctx + new)[None, :] <= positions[:, None]
    logits = (q @ k.transpose(1, 2)) * m["scale"]
    logits = logits.masked_fill(~mask, -math.inf)
    naive = (torch.softmax(logits, -1) @ v).transpose(0, 1)
    torch.testing.assert_close(out, naive, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse, torch.logsumexp(logits, -1), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("ctx", [0, 1, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_context_plus_suffix_equals_one_pass(ctx, dtype):
    new = 9
    m = _mla_problem(ctx, new, seed=12)
    positions = torch.arange(ctx, ctx + new)
    one_pass, one_lse = _absorbed(m, ctx + new, positions, 16, dtype, seed=13)
    # Context half: absorbed over the first ctx rows (all visible to the new tokens).
    prefix, prefix_lse = _absorbed(m, ctx, positions, 16, dtype, seed=13)
    # Suffix half: decompressed causal MHA over the new tokens only.
    new_kv = m["kv_c"][ctx:]
    k_nope = torch.einsum("sl,hpl->shp", new_kv, m["w_uk"]).to(dtype)
    v = torch.einsum("sl,hvl->shv", new_kv, m["w_uv"]).to(dtype)
    q = torch.cat([m["q_nope"], m["q_pe"]], dim=-1).to(dtype)
    cu = torch.tensor([0, new], dtype=torch.int32)
    suffix, suffix_lse = varlen_attention(
        q, k_nope, m["k_pe"][ctx:].to(dtype), v, cu, cu, m["scale"], True
    )
    merged, merged_lse = merge_attn_states(prefix, prefix_lse, suffix.float(), suffix_lse)
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(merged, one_pass, atol=tol, rtol=tol)
    torch.testing.assert_close(merged_lse, one_lse, atol=tol, rtol=tol)
