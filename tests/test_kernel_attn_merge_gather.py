"""mlafx::merge_attn_states and mlafx::gather_latent against the Python references.

merge tolerances: bf16 1e-2, fp16 2e-3, fp32 1e-5 (out, abs and rel); LSE 1e-5 (the inputs'
LSEs are fp32 for every dtype). gather is a copy: compared bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch
from attention_cases import FLOAT_DTYPES, paged_cache
from hypothesis import given, settings
from hypothesis import strategies as st

from mlafx.kernels import gather_latent, merge_attn_states
from mlafx.kernels.attention_reference import gather_latent_ref, merge_attn_states_ref

_MERGE_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def _lse(shape, gen, empty_fraction: float) -> torch.Tensor:
    lse = torch.randn(shape, generator=gen) * 3
    pick = torch.rand(shape, generator=gen)
    lse = torch.where(pick < empty_fraction / 2, -math.inf, lse)
    return torch.where((pick >= empty_fraction / 2) & (pick < empty_fraction), math.inf, lse)


@settings(max_examples=60, deadline=None)
@given(
    num_tokens=st.sampled_from([0, 1, 17, 40]),
    # 130: more heads than the AVX-512 kernel's 64-head block (V3 has 128)
    num_heads=st.sampled_from([1, 3, 16, 130]),
    head_dim=st.sampled_from([1, 16, 128, 45]),
    dtype=st.sampled_from(FLOAT_DTYPES),
    empty_fraction=st.sampled_from([0.0, 0.3, 1.0]),
    strided=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_merge_matches_reference(
    num_tokens, num_heads, head_dim, dtype, empty_fraction, strided, seed
):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_tokens, num_heads, head_dim)
    prefix = torch.randn(shape, generator=gen).to(dtype)
    suffix = torch.randn(shape, generator=gen).to(dtype)
    if strided:  # heads-major storage and a transposed LSE: strided but last-dim contiguous
        prefix = prefix.transpose(0, 1).contiguous().transpose(0, 1)
    p_lse = _lse((num_heads, num_tokens), gen, empty_fraction)
    s_lse = _lse((num_heads, num_tokens), gen, empty_fraction)
    if strided:
        p_lse = p_lse.T.contiguous().T
    out, lse = merge_attn_states(prefix, p_lse, suffix, s_lse)
    ref_out, ref_lse = merge_attn_states_ref(prefix, p_lse, suffix, s_lse)
    assert out.is_contiguous() and lse.is_contiguous() and out.dtype == dtype
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    tol = _MERGE_TOL[dtype]
    torch.testing.assert_close(out.float(), ref_out.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_merge_empty_halves_and_nan():
    prefix = torch.full((4, 1, 3), 5.0)
    suffix = torch.full((4, 1, 3), 7.0)
    prefix[1] = math.nan  # ignored: the prefix of token 1 is empty
    inf = math.inf
    p_lse = torch.tensor([[-inf, -inf, 1.5, math.nan]])
    s_lse = torch.tensor([[inf, 0.5, -inf, 0.0]])
    out, lse = merge_attn_states(prefix, p_lse, suffix, s_lse)
    assert torch.equal(out[0], torch.zeros(1, 3)) and lse[0, 0] == -inf  # both empty (+-inf)
    assert torch.equal(out[1], suffix[1]) and lse[0, 1] == 0.5  # prefix empty
    assert torch.equal(out[2], prefix[2]) and lse[0, 2] == 1.5  # suffix empty
    assert torch.isnan(out[3]).all() and torch.isnan(lse[0, 3])  # NaN LSE propagates


def test_merge_nan_output_propagates():
    prefix = torch.ones(1, 1, 20, dtype=torch.bfloat16)
    prefix[0, 0, 17] = math.nan
    out, _ = merge_attn_states(
        prefix, torch.zeros(1, 1), torch.ones_like(prefix), torch.zeros(1, 1)
    )
    assert torch.isnan(out[0, 0, 17]) and not torch.isnan(out[0, 0, :17]).any()


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ("dtype_mismatch", TypeError, "suffix_out must have prefix_out's dtype"),
        ("lse_fp16", TypeError, "must be float32"),
        ("lse_shape", ValueError, r"LSEs must be \[num_heads, num_tokens\]"),
        ("out_shape", ValueError, "suffix_out has shape"),
        ("last_dim_strided", ValueError, "last dim must be contiguous"),
        ("int_out", TypeError, "bfloat16, float16 or float32"),
    ],
)
def test_merge_invalid_inputs_raise(change, error, match):
    prefix, suffix = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    p_lse, s_lse = torch.randn(2, 3), torch.randn(2, 3)
    if change == "dtype_mismatch":
        suffix = suffix.bfloat16()
    elif change == "lse_fp16":
        p_lse = p_lse.half()
    elif change == "lse_shape":
        s_lse = s_lse.T.contiguous()
    elif change == "out_shape":
        suffix = suffix[:2]
    elif change == "last_dim_strided":
        prefix = torch.randn(3, 2, 16)[..., ::2]
        suffix = suffix.contiguous()
    elif change == "int_out":
        prefix, suffix = prefix.int(), suffix.int()
    with pytest.raises(error, match=match):
        merge_attn_states(prefix, p_lse, suffix, s_lse)


# ---- gather_latent ---------------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    lens=st.lists(st.sampled_from([0, 1, 17, 16, 64, 65]), min_size=1, max_size=3),
    block_size=st.sampled_from([1, 16, 64, 256]),
    dtype=st.sampled_from(FLOAT_DTYPES),
    seed=st.integers(0, 2**31 - 1),
)
def test_gather_matches_reference_bit_exact(lens, block_size, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    rows = [torch.randn(n, 40, generator=gen) for n in lens]
    cache, table = paged_cache(rows, block_size, dtype, gen)
    slots = []
    for b, n in enumerate(lens):
        slots += [int(table[b, j // block_size]) * block_size + j % block_size for j in range(n)]
    slots = torch.tensor(slots, dtype=torch.int64)
    slots = slots[torch.randperm(len(slots), generator=gen)]
    out = gather_latent(cache, slots)
    ref = gather_latent_ref(cache, slots)
    assert out.shape == (len(slots), 40) and out.dtype == dtype and out.is_contiguous()
    assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))
    assert not torch.isnan(out).any()  # only rows holding tokens were gathered


@pytest.mark.parametrize("bad_slot", [-1, 8, 1000])
def test_gather_out_of_range_slot_raises(bad_slot):
    cache = torch.zeros(2, 4, 16, dtype=torch.bfloat16)
    slots = torch.tensor([0, 5, bad_slot])
    with pytest.raises(IndexError, match=rf"slots\[2\] = {bad_slot} is out of range"):
        gather_latent(cache, slots)
    with pytest.raises(IndexError):
        gather_latent_ref(cache, slots)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ("slots_int32", TypeError, "slots must be int64"),
        ("cache_2d", ValueError, "kv_cache must be"),
        ("cache_not_contiguous", ValueError, "kv_cache must be contiguous"),
        ("cache_int", TypeError, "bfloat16, float16 or float32"),
    ],
)
def test_gather_invalid_inputs_raise(change, error, match):
    cache = torch.zeros(2, 4, 16, dtype=torch.bfloat16)
    slots = torch.tensor([0, 1])
    if change == "slots_int32":
        slots = slots.int()
    elif change == "cache_2d":
        cache = cache.view(8, 16)
    elif change == "cache_not_contiguous":
        cache = torch.zeros(4, 2, 16, dtype=torch.bfloat16).transpose(0, 1)
    elif change == "cache_int":
        cache = cache.to(torch.int16)
    with pytest.raises(error, match=match):
        gather_latent(cache, slots)
