"""mlafx::moe_experts_quantized against the float64 reference and quant_format's eager one.

The reference (``quant_reference.moe_experts_quantized_f64``) takes each (token, choice) pair
alone, in float64 except where the op's semantics round to x's dtype (g, u, h, y). The kernel
sums each product in fp32 and adds the k weighted terms in expert order, so outputs differ
from it by a few ulps of x's dtype at the scale of the case; the tolerance, relative to the
largest |reference| output, is bf16 2e-2, fp16 4e-3, fp32 1e-4 (a rounding flip in g or u
moves h by an ulp and then y). A dropped or doubled (token, choice) term is off by ~50%.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mlafx.kernels import moe_experts_quantized
from mlafx.kernels.quant_ops import quantize_experts
from mlafx.kernels.quant_reference import moe_experts_quantized_f64
from mlafx.models.quantized import moe_experts_quantized_reference

FLOAT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-4}
MAX_STREAMING_PAIRS = 16  # experts with more pairs take the per-expert GEMM path


def _case(T, D, inter, E, k, dtype, bits, gen, *, repeat=False, layout="contiguous"):
    x = torch.randn(T, D, generator=gen).to(dtype)
    if layout == "strided":
        wide = torch.zeros(T, D + 5, dtype=dtype)
        wide[:, 3 : 3 + D] = x
        x = wide[:, 3 : 3 + D]
    ids = torch.randint(0, E, (T, k), generator=gen)
    if repeat and k > 1:
        ids[:, 1] = ids[:, 0]  # the same expert twice for one token
    weights = torch.rand(T, k, generator=gen)
    w13 = quantize_experts(torch.randn(E, 2 * inter, D, generator=gen) / D**0.5, bits)
    w2 = quantize_experts(torch.randn(E, D, inter, generator=gen) / inter**0.5, bits)
    return x, ids, weights, w13, w2, inter


def _assert_close(out, args, dtype):
    x = args[0]
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
    if out.numel() == 0:
        return
    expected = moe_experts_quantized_f64(*args)
    tol = TOLERANCE[dtype]
    scale = max(expected.abs().max().item(), 1e-6)
    torch.testing.assert_close(out.double(), expected, atol=tol * scale, rtol=tol)
    # the eager reference rounds g, u, h and y to x's dtype too, each within tol of the float64
    # one but not always on the same side of a rounding boundary: they agree within 2 tol
    eager = moe_experts_quantized_reference(*args)
    torch.testing.assert_close(out.double(), eager.double(), atol=2 * tol * scale, rtol=2 * tol)


@settings(max_examples=40, deadline=None)
@given(
    T=st.sampled_from([0, 1, 3, 8, 33]),
    D=st.sampled_from([16, 64 + 13, 128]),
    inter=st.sampled_from([8, 21, 48]),
    E=st.sampled_from([1, 3, 8]),
    k=st.sampled_from([1, 2, 3]),
    dtype=st.sampled_from(FLOAT_DTYPES),
    bits=st.sampled_from([8, 4]),
    repeat=st.booleans(),
    layout=st.sampled_from(["contiguous", "strided"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_reference(T, D, inter, E, k, dtype, bits, repeat, layout, seed):
    gen = torch.Generator().manual_seed(seed)
    args = _case(T, D, inter, E, k, dtype, bits, gen, repeat=repeat, layout=layout)
    _assert_close(moe_experts_quantized(*args), args, dtype)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("pairs", [MAX_STREAMING_PAIRS, MAX_STREAMING_PAIRS + 1, 70])
def test_streaming_and_gemm_paths(pairs, bits):
    # One expert holding `pairs` pairs, another a few: both paths in one call.
    gen = torch.Generator().manual_seed(pairs + bits)
    args = list(_case(pairs + 3, 64 + 13, 21, 2, 1, torch.bfloat16, bits, gen))
    args[1] = torch.cat([torch.zeros(pairs, 1), torch.ones(3, 1)]).long()
    _assert_close(moe_experts_quantized(*args), args, torch.bfloat16)


def test_model_widths_bf16():
    gen = torch.Generator().manual_seed(0)
    args = _case(20, 2048, 1408 // 8, 4, 2, torch.bfloat16, 4, gen)
    _assert_close(moe_experts_quantized(*args), args, torch.bfloat16)


def test_nan_propagates_to_its_token_only():
    gen = torch.Generator().manual_seed(1)
    args = list(_case(4, 64, 16, 3, 2, torch.bfloat16, 8, gen))
    args[0][2, 5] = float("nan")
    out = moe_experts_quantized(*args)
    assert torch.isnan(out[2]).all() and not torch.isnan(out[[0, 1, 3]]).any()


@pytest.mark.parametrize(("T", "dtype", "bits"), [(0, torch.float32, 8), (5, torch.bfloat16, 4)])
def test_opcheck(T, dtype, bits):
    gen = torch.Generator().manual_seed(T)
    args = _case(T, 40, 24, 3, 2, dtype, bits, gen)
    torch.library.opcheck(torch.ops.mlafx.moe_experts_quantized.default, args)


@pytest.mark.parametrize("bad_id", [-1, 3])
def test_out_of_range_expert_raises(bad_id):
    args = list(_case(4, 32, 16, 3, 2, torch.float32, 8, torch.Generator().manual_seed(0)))
    args[1][2, 1] = bad_id
    with pytest.raises(IndexError, match=r"topk_ids\[2, 1\] = .* out of range for 3 experts"):
        moe_experts_quantized(*args)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ("x_float64", TypeError, "x must be bfloat16, float16 or float32"),
        ("ids_int32", TypeError, "topk_ids must be int64"),
        ("weights_shape", ValueError, "topk_weights must have topk_ids's shape"),
        ("w13_shape", ValueError, r"w13 must be \[num_experts = 3"),
        ("w2_not_packed", ValueError, "w2 must be packed experts"),
        ("w2_dtype", TypeError, "w2 must be uint8"),
        ("inter", ValueError, r"w13 must be \[num_experts = 3, 4"),
    ],
)
def test_invalid_inputs_raise(change, error, match):
    x, ids, weights, w13, w2, inter = _case(
        4, 32, 16, 3, 2, torch.float32, 8, torch.Generator().manual_seed(0)
    )
    if change == "x_float64":
        x = x.double()
    elif change == "ids_int32":
        ids = ids.int()
    elif change == "weights_shape":
        weights = weights[:, :1]
    elif change == "w13_shape":
        w13 = w13[:, :1]
    elif change == "w2_not_packed":
        w2 = w2[..., :100]
    elif change == "w2_dtype":
        w2 = w2.to(torch.int8)
    elif change == "inter":
        inter = 32
    with pytest.raises(error, match=match):
        moe_experts_quantized(x, ids, weights, w13, w2, inter)
