"""mlafx::pack_linear_weight, unpack_linear_weight, linear_decode and linear_packed against
their references.

Packing is a permutation with zero padding: compared byte for byte, and unpacking must give
the weight back exactly. linear_decode (and linear_packed's oneDNN path for long rows) sum in
fp32 and round once to x's dtype, so each output may differ from the float64 product by
half an ulp of the output dtype (u) plus the fp32 summation error; the bound used is
``u * |ref| + (K + 2) * 2**-24 * (|x| @ |W|^T) * (1 + u)``, tight enough that a dropped
column pair or a row off by one fails. A bias is added after that rounding and rounded
again: one more ``u * (|x| @ |W|^T)``.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from cpu_flags import has_avx2
from hypothesis import given, settings
from hypothesis import strategies as st

from mlafx.kernels import (
    cpu_isa,
    linear_decode,
    linear_packed,
    pack_linear_weight,
    unpack_linear_weight,
)
from mlafx.kernels.gemm_reference import (
    linear_decode_ref,
    linear_packed_ref,
    pack_linear_weight_ref,
    unpack_linear_weight_ref,
)

FLOAT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}


def _assert_within_bound(out, x, weight, bias=None):
    ref = linear_decode_ref(x, weight)
    assert out.dtype == x.dtype and out.shape == ref.shape and out.is_contiguous()
    u = UNIT_ROUNDOFF[x.dtype]
    magnitude = x.double().abs() @ weight.double().abs().t()
    exact = x.double() @ weight.double().t()
    # The final rounding is relative (u) down to the dtype's subnormals, whose spacing is
    # absolute: half of it is the rounding error of a result that small.
    finfo = torch.finfo(x.dtype)
    half_subnormal = finfo.tiny * finfo.eps / 2
    bound = u * exact.abs() + (x.shape[1] + 2) * 2.0**-24 * magnitude * (1 + u) + half_subnormal
    if bias is not None:  # the product is rounded first, then the sum with the bias
        exact = exact + bias.double()
        bound = bound + u * exact.abs() + u * (1 + u) * magnitude + half_subnormal
    err = (out.double() - exact).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"


def _rows(M, K, dtype, gen, layout):
    x = torch.randn(M, K, generator=gen).to(dtype)
    if layout == "strided":
        wide = torch.zeros(M, K + 7, dtype=dtype)
        wide[:, 2 : 2 + K] = x
        x = wide[:, 2 : 2 + K]
    return x


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize(("N", "K"), [(1, 1), (16, 2), (17, 3), (33, 64 + 13)])
def test_pack_matches_reference_bytes(N, K, dtype):
    weight = torch.randn(N, K).to(dtype)
    packed = pack_linear_weight(weight)
    expected = pack_linear_weight_ref(weight)
    assert packed.shape == expected.shape and packed.dtype == dtype and packed.is_contiguous()
    assert torch.equal(packed.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(unpack_linear_weight_ref(packed, N, K), weight)
    unpacked = unpack_linear_weight(packed, N, K)
    assert unpacked.shape == (N, K) and unpacked.is_contiguous()
    assert torch.equal(unpacked.view(torch.uint8), weight.view(torch.uint8))


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize(("N", "K"), [(0, 5), (3, 0), (17, 1), (100, 31), (533, 2048 + 13)])
def test_unpack_is_the_inverse_of_pack(N, K, dtype):
    # Odd and even K, partial blocks, more than one 16-pair tile of the AVX-512 transpose.
    weight = torch.randn(N, K).to(dtype)
    packed = pack_linear_weight(weight)
    unpacked = unpack_linear_weight(packed, N, K)
    assert torch.equal(unpacked.view(torch.uint8), weight.view(torch.uint8))
    assert torch.equal(unpack_linear_weight_ref(packed, N, K), weight)


@settings(max_examples=80, deadline=None)
@given(
    M=st.sampled_from([0, 1, 2, 5, 8, 9, 17, 32, 33]),
    # Even K runs on the tile kernel where there is one: 34 and 64 + 14 end in a partial tile.
    K=st.sampled_from([1, 2, 3, 31, 34, 64 + 13, 64 + 14, 256]),
    N=st.sampled_from([1, 15, 16, 17, 100]),
    dtype=st.sampled_from(FLOAT_DTYPES),
    layout=st.sampled_from(["contiguous", "strided"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_reference(M, K, N, dtype, layout, seed):
    gen = torch.Generator().manual_seed(seed)
    x = _rows(M, K, dtype, gen, layout)
    weight = torch.randn(N, K, generator=gen).to(dtype)
    _assert_within_bound(linear_decode(x, pack_linear_weight(weight), N), x, weight)


@pytest.mark.parametrize(("N", "K"), [(576, 2048), (2048, 1408), (3072 + 5, 512)])
@pytest.mark.parametrize("M", [1, 8])
def test_model_shapes_bf16(M, N, K):
    # The embedded default's projection widths (kv_a, down, q-like): every thread's share
    # and the 256-row steps inside it are exercised with real K.
    gen = torch.Generator().manual_seed(N + K + M)
    x = torch.randn(M, K, generator=gen).bfloat16()
    weight = (torch.randn(N, K, generator=gen) / K**0.5).bfloat16()
    _assert_within_bound(linear_decode(x, pack_linear_weight(weight), N), x, weight)


def test_nan_propagates_to_its_row_only():
    x = torch.randn(3, 40).bfloat16()
    x[1, 7] = float("nan")
    out = linear_decode(x, pack_linear_weight(torch.randn(20, 40).bfloat16()), 20)
    assert torch.isnan(out[1]).all() and not torch.isnan(out[[0, 2]]).any()


@pytest.mark.parametrize(
    ("M", "dtype"), [(0, torch.float32), (3, torch.bfloat16), (9, torch.float16)]
)
def test_opcheck(M, dtype):
    x = torch.randn(M, 45).to(dtype)
    weight = torch.randn(21, 45).to(dtype)
    torch.library.opcheck(torch.ops.mlafx.pack_linear_weight.default, (weight,))
    packed = pack_linear_weight(weight)
    torch.library.opcheck(torch.ops.mlafx.linear_decode.default, (x, packed, 21))
    torch.library.opcheck(torch.ops.mlafx.unpack_linear_weight.default, (packed, 21, 45))


class _Linear(torch.nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.out_features = weight.shape[0]
        # Packed once at load time; the module keeps only the packed weight.
        self.register_buffer("packed_weight", pack_linear_weight(weight))

    def forward(self, x):
        return linear_decode(x + 1, self.packed_weight, self.out_features)


def test_torch_compile_fullgraph():
    weight = torch.randn(40, 24)
    x = torch.randn(5, 24)
    compiled = torch.compile(_Linear(weight), fullgraph=True, backend="inductor")
    _assert_within_bound(compiled(x), x + 1, weight)


def test_torch_export_dynamic_rows():
    weight = torch.randn(40, 24).bfloat16()
    program = torch.export.export(
        _Linear(weight),
        (torch.randn(5, 24).bfloat16(),),
        dynamic_shapes=({0: torch.export.Dim("rows")},),
    )
    assert "torch.ops.mlafx.linear_decode.default" in str(program.graph_module.code)
    x = torch.randn(8, 24).bfloat16()
    _assert_within_bound(program.module()(x), x + 1, weight)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ("x_float64", TypeError, "x must be bfloat16, float16 or float32"),
        ("dtype_mismatch", TypeError, "must equal x's dtype"),
        ("x_1d", ValueError, r"x must be \[num_rows, in_features\]"),
        ("not_packed", ValueError, "must come from pack_linear_weight"),
        ("out_features", ValueError, "out_features = 40 does not match"),
        ("in_features", ValueError, "x has 30 features"),
        ("x_last_dim_strided", ValueError, "x's last dim must be contiguous"),
    ],
)
def test_invalid_inputs_raise(change, error, match):
    weight = torch.randn(20, 24)
    packed = pack_linear_weight(weight)
    x, n = torch.randn(3, 24), 20
    if change == "x_float64":
        x = x.double()
    elif change == "dtype_mismatch":
        x = x.bfloat16()
    elif change == "x_1d":
        x = x[0]
    elif change == "not_packed":
        packed = weight
    elif change == "out_features":
        n = 40
    elif change == "in_features":
        x = torch.randn(3, 30)
    elif change == "x_last_dim_strided":
        x = torch.randn(3, 48)[:, ::2]
    with pytest.raises(error, match=match):
        linear_decode(x, packed, n)


def test_pack_rejects_bad_weights():
    with pytest.raises(ValueError, match="weight must be"):
        pack_linear_weight(torch.randn(2, 3, 4))
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        pack_linear_weight(torch.randn(2, 3).double())


_PATH_PROBE = """
import torch
from mlafx.kernels import cpu_isa, linear_decode, linear_packed, pack_linear_weight

assert cpu_isa() == "{isa}", cpu_isa()
gen = torch.Generator().manual_seed(0)
for dtype in (torch.bfloat16, torch.float16, torch.float32):
    for M, K, N in ((1, 77, 33), (9, 64 + 14, 100), (33, 31, 17)):
        x = torch.randn(M, K, generator=gen).to(dtype)
        w = torch.randn(N, K, generator=gen).to(dtype)
        torch.save((x, w, linear_decode(x, pack_linear_weight(w), N)), f"{{}}/{dtype}-{M}.pt")
    # linear_packed above every streaming threshold: the unpacked chunks and ATen's mm, with
    # more than one chunk (8192 + 13 columns) and odd widths
    for M, K, N in ((100, 8192 + 13, 533), (300, 77, 40)):
        x = torch.randn(M, K, generator=gen).to(dtype)
        w = torch.randn(N, K, generator=gen).to(dtype)
        out = linear_packed(x, pack_linear_weight(w), N)
        torch.save((x, w, out), f"{{}}/{dtype}-packed-{M}.pt")
print("ok")
"""


@pytest.mark.parametrize(
    ("isa", "env_overrides"),
    [
        ("portable", {"MLAFX_DISABLE_AVX512": "1"}),
        ("avx512_bf16", {"MLAFX_DISABLE_AMX": "1"}),  # the FMA kernel of CPUs without AMX
        ("avx2", {"MLAFX_AVX2_ONLY": "1"}),  # what CPUs without AVX-512 run
    ],
)
def test_other_paths_match_reference(tmp_path, isa, env_overrides):
    if isa == "avx512_bf16" and cpu_isa() != "avx512_amx":
        pytest.skip("this run already uses that path (or the CPU lacks it)")
    if isa == "avx2" and not (cpu_isa().startswith("avx512") and has_avx2()):
        pytest.skip("this run already uses that path (or the CPU lacks it)")
    env = {**os.environ, **env_overrides}
    probe = _PATH_PROBE.replace("{{}}", str(tmp_path)).replace("{isa}", isa)
    result = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    files = sorted(tmp_path.glob("*.pt"))
    assert len(files) == 15
    for path in files:
        x, w, out = torch.load(path)
        _assert_within_bound(out, x, w)


@pytest.mark.parametrize("bias", [False, True])
# Both sides of the streaming/chunked switch: 8 rows (bf16: 32 with AMX, 256 without).
@pytest.mark.parametrize("M", [0, 1, 8, 9, 32, 33, 100, 256, 257, 300])
@pytest.mark.parametrize("K", [77, 78])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_linear_packed_is_linear_on_both_paths(M, K, dtype, bias):
    gen = torch.Generator().manual_seed(M)
    x = torch.randn(M, K, generator=gen).to(dtype)
    weight = torch.randn(33, K, generator=gen).to(dtype)
    b = torch.randn(33, generator=gen).to(dtype) if bias else None
    packed = pack_linear_weight(weight)
    out = linear_packed(x, packed, 33, b)
    assert out.dtype == dtype and out.shape == (M, 33)
    _assert_within_bound(out, x, weight, b)
    # and the reference, which rounds once, within a few ulps of the magnitudes involved
    ref = linear_packed_ref(x, packed, 33, b)
    u = UNIT_ROUNDOFF[dtype]
    tol = 4 * u * (x.double().abs() @ weight.double().abs().t() + 1) + K * 2.0**-20
    assert ((out.double() - ref.double()).abs() <= tol).all()
    torch.library.opcheck(torch.ops.mlafx.linear_packed.default, (x, packed, 33, b))


@settings(max_examples=80, deadline=None)
@given(
    # both sides of the 8-, 32- and 256-row switches, and long rows
    M=st.sampled_from([0, 1, 7, 8, 9, 16, 31, 32, 33, 100, 256, 257, 300]),
    # 8192 + 13: rows of 16 KB, so a 16-bit chunk of 4 MB is 240 rows and N = 533 takes three
    # (fp32: 112 rows, five)
    K=st.sampled_from([1, 3, 64 + 13, 64 + 14, 8192 + 13]),
    N=st.sampled_from([1, 17, 40, 533]),
    dtype=st.sampled_from(FLOAT_DTYPES),
    layout=st.sampled_from(["contiguous", "strided"]),
    bias=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_linear_packed_matches_reference(M, K, N, dtype, layout, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    x = _rows(M, K, dtype, gen, layout)
    weight = torch.randn(N, K, generator=gen).to(dtype)
    b = torch.randn(N, generator=gen).to(dtype) if bias else None
    _assert_within_bound(linear_packed(x, pack_linear_weight(weight), N, b), x, weight, b)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize(("M", "N"), [(33, 533), (300, 1000)])
def test_long_rows_span_several_chunks(M, N, dtype):
    # Chunks of 240 (bf16, fp16) or 112 (fp32) rows at K = 8192 + 13; N a multiple of neither
    # the chunk nor 16. Every output column is checked, so a chunk written to the wrong
    # columns, or one left out, fails.
    gen = torch.Generator().manual_seed(N)
    K = 8192 + 13
    x = torch.randn(M, K, generator=gen).to(dtype)
    weight = (torch.randn(N, K, generator=gen) / K**0.5).to(dtype)
    b = torch.randn(N, generator=gen).to(dtype)
    _assert_within_bound(linear_packed(x, pack_linear_weight(weight), N, b), x, weight, b)


@pytest.mark.parametrize(("N", "K"), [(576, 2048), (3072, 2048), (2048, 1408)])
def test_long_rows_model_shapes_bf16(N, K):
    gen = torch.Generator().manual_seed(N + K)
    x = torch.randn(64, K, generator=gen).bfloat16()
    weight = (torch.randn(N, K, generator=gen) / K**0.5).bfloat16()
    out = linear_packed(x, pack_linear_weight(weight), N)
    _assert_within_bound(out, x, weight)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ("in_features", ValueError, "linear_packed: x has 30 features"),
        ("out_features", ValueError, "linear_packed: out_features = 40 does not match"),
        ("bias_shape", ValueError, r"linear_packed: bias must be \[out_features\] = \[20\]"),
        ("bias_dtype", TypeError, "linear_packed: bias dtype"),
        ("x_last_dim_strided", ValueError, "linear_packed: x's last dim must be contiguous"),
        ("not_packed", ValueError, "linear_packed: packed_weight must come from"),
    ],
)
@pytest.mark.parametrize("M", [3, 100])  # checked up front on either path
def test_linear_packed_invalid_inputs_raise(change, error, match, M):
    weight = torch.randn(20, 24)
    packed = pack_linear_weight(weight)
    x, n, b = torch.randn(M, 24), 20, torch.randn(20)
    if change == "in_features":
        x = torch.randn(M, 30)
    elif change == "out_features":
        n = 40
    elif change == "bias_shape":
        b = torch.randn(21)
    elif change == "bias_dtype":
        b = b.double()
    elif change == "x_last_dim_strided":
        x = torch.randn(M, 48)[:, ::2]
    elif change == "not_packed":
        packed = weight
    with pytest.raises(error, match=match):
        linear_packed(x, packed, n, b)


def test_unpack_rejects_mismatched_sizes():
    packed = pack_linear_weight(torch.randn(20, 24))
    with pytest.raises(ValueError, match="in_features = 26 does not match"):
        unpack_linear_weight(packed, 20, 26)
    with pytest.raises(ValueError, match="out_features = 33 does not match"):
        unpack_linear_weight(packed, 33, 24)


_F32_PROBE = """
import sys, torch
from mlafx.kernels import linear_packed, pack_linear_weight
cases = torch.load(sys.argv[1])
outs = [linear_packed(x, pack_linear_weight(w), w.shape[0], None) for x, w in cases]
torch.save(outs, sys.argv[2])
"""


def test_float32_avx512_is_bit_identical_to_portable(tmp_path):
    """fp32 (the router's gate): the AVX-512 kernel adds the same products in the same order
    as the portable one, each rounded alone; every row tile (1-4 rows), odd K, a NaN row."""
    if cpu_isa() == "portable":
        pytest.skip("no AVX-512 kernel on this CPU")
    gen = torch.Generator().manual_seed(4)
    cases = []
    for M, K, N in ((1, 77, 33), (3, 78, 100), (5, 2048, 64), (8, 2047, 64), (9, 31, 17)):
        x, w = torch.randn(M, K, generator=gen), torch.randn(N, K, generator=gen)
        x[-1, K // 2] = math.nan
        cases.append((x, w))
    torch.save(cases, tmp_path / "in.pt")
    env = {**os.environ, "MLAFX_DISABLE_AVX512": "1"}
    args = [sys.executable, "-c", _F32_PROBE, str(tmp_path / "in.pt"), str(tmp_path / "out.pt")]
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for (x, w), expected in zip(cases, torch.load(tmp_path / "out.pt"), strict=True):
        out = linear_packed(x, pack_linear_weight(w), w.shape[0], None)
        assert torch.equal(out.nan_to_num(7.0), expected.nan_to_num(7.0)), tuple(x.shape)
        assert torch.equal(out.isnan(), expected.isnan())
