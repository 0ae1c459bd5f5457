"""mlafx::quantize_linear_weight and linear_quantized against their references.

quantize_linear_weight must equal ``quant_format.quantize_weight_ref`` byte for byte (the int4
scale search included: see csrc/quant_weight.cpp for the one tie corner that depends on
torch's summation order). linear_quantized is compared with the float64 product of the same
quantized activations and dequantized weights (``quant_reference.py``): the kernel sums
(float)isum * d_x * d_w in fp32 (two roundings per term, one per add), then rounds once to
x's dtype, so the bound is ``u * |exact| + (G + 3) * 2**-24 * (|x_q| @ |W|^T)``, which a
dropped group or a row off by one exceeds by orders of magnitude. A bias is added after that
rounding and rounded again. The portable, AVX2 and AVX-512 kernels give bit-identical results
(separate fp32 roundings in all), which child processes (MLAFX_DISABLE_AVX512=1: portable;
no ISA variables: the best path) check.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from cpu_flags import cpu_flags, has_avx2
from hypothesis import given, settings
from hypothesis import strategies as st
from kquant_cases import Q, kquant_moe_case, kquant_weight

from mlafx.kernels import linear_quantized, quant_cpu_isa, quantize_linear_weight
from mlafx.kernels import quant_format as qf
from mlafx.kernels.kquant_format import kquant_name
from mlafx.kernels.quant_ops import quantize_experts
from mlafx.kernels.quant_reference import (
    linear_quantized_f64,
    magnitude_f64,
    moe_experts_quantized_f64,
)

UNIT_ROUNDOFF = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
FLOAT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _weight(N, K, gen, dtype=torch.float32):
    # Rows of very different magnitudes, so scales span several binades.
    scale = torch.exp2(torch.randint(-12, 4, (N, 1), generator=gen).float())
    return (torch.randn(N, K, generator=gen) * scale).to(dtype)


def _rows(M, K, dtype, gen, layout="contiguous"):
    x = torch.randn(M, K, generator=gen).to(dtype)
    if layout == "strided":  # rows of a wider buffer
        wide = torch.zeros(M, K + 7, dtype=dtype)
        wide[:, 3 : 3 + K] = x
        x = wide[:, 3 : 3 + K]
    return x


def _assert_within_bound(out, x, packed, N, bias=None):
    assert out.dtype == x.dtype and out.shape == (x.shape[0], N) and out.is_contiguous()
    exact = linear_quantized_f64(x, packed, N)
    magnitude = magnitude_f64(x, packed, N)
    u = UNIT_ROUNDOFF[x.dtype]
    finfo = torch.finfo(x.dtype)
    half_subnormal = finfo.tiny * finfo.eps / 2
    # a k8/k4 term is 5 roundings (two products, their difference, * d_x, the add), over 8
    # groups of 32 per super-block; an int8/int4 term 3
    kquant = kquant_name(packed) is not None
    groups = packed.shape[1] * (8 if kquant else 1)
    rounds = 5 if kquant else 3
    bound = u * exact.abs() + (groups + rounds) * 2.0**-24 * magnitude * (1 + u) + half_subnormal
    if bias is not None:
        exact = exact + bias.double()
        bound = bound + u * exact.abs() + u * (1 + u) * magnitude + half_subnormal
    err = (out.double() - exact).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item():.3g}"


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize(("N", "K"), [(0, 5), (1, 1), (16, 32), (17, 33), (33, 64 + 13)])
def test_quantize_weight_is_bit_identical(N, K, dtype, bits):
    gen = torch.Generator().manual_seed(N * 100 + K + bits)
    weight = _weight(N, K, gen, dtype)
    packed = quantize_linear_weight(weight, bits)
    expected = qf.quantize_weight_ref(weight, bits)
    assert packed.dtype == torch.uint8 and packed.shape == expected.shape
    assert packed.is_contiguous()
    assert torch.equal(packed, expected)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_weight_bit_identical_large_and_strided(bits):
    # 300 blocks' worth of random groups: a tie between int4 candidates would show here.
    gen = torch.Generator().manual_seed(bits)
    weight = _weight(600, 1024 + 8, gen, torch.bfloat16)[:, 8:]  # strided rows
    assert torch.equal(quantize_linear_weight(weight, bits), qf.quantize_weight_ref(weight, bits))


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_weight_error_is_at_most_ggml(bits):
    """Every group's error is at most llama.cpp's (Q8_0: every weight's; Q4_0: the group's
    squared error), as quant_format's docstring promises."""
    gguf = pytest.importorskip("gguf", reason="gguf (llama.cpp's quantizers) not installed")
    gen = torch.Generator().manual_seed(7)
    weight = _weight(64, 512, gen)
    ours = qf.dequantize_weight(quantize_linear_weight(weight, bits), 64, 512).double()
    kind = gguf.GGMLQuantizationType.Q8_0 if bits == 8 else gguf.GGMLQuantizationType.Q4_0
    theirs = torch.from_numpy(
        gguf.quants.dequantize(gguf.quants.quantize(weight.numpy(), kind), kind)
    ).double()
    w = weight.double()
    if bits == 8:
        assert ((ours - w).abs() <= (theirs - w).abs() * (1 + 1e-6) + 1e-30).all()
    else:
        ours_err = ((ours - w) ** 2).view(64, -1, 32).sum(-1)
        theirs_err = ((theirs - w) ** 2).view(64, -1, 32).sum(-1)
        assert (ours_err <= theirs_err * (1 + 1e-5) + 1e-30).all()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("N", "K"), [(16, 32), (45, 96)])
def test_ggml_blocks_repack_exactly(N, K, bits):
    gguf = pytest.importorskip("gguf", reason="gguf (llama.cpp's quantizers) not installed")
    kind = gguf.GGMLQuantizationType.Q8_0 if bits == 8 else gguf.GGMLQuantizationType.Q4_0
    weight = _weight(N, K, torch.Generator().manual_seed(N + bits))
    blocks = gguf.quants.quantize(weight.numpy(), kind)  # uint8 [N, K/32 * (34 | 18)]
    repack = qf.repack_ggml_q8_0 if bits == 8 else qf.repack_ggml_q4_0
    packed = repack(torch.from_numpy(blocks), N, K)
    assert packed.shape == qf.packed_shape(N, K, bits) and qf.bits_of(packed) == bits
    expected = torch.from_numpy(gguf.quants.dequantize(blocks, kind))
    assert torch.equal(qf.dequantize_weight(packed, N, K), expected)
    x = torch.randn(5, K)
    _assert_within_bound(linear_quantized(x, packed, N), x, packed, N)


@settings(max_examples=60, deadline=None)
@given(
    M=st.sampled_from([1, 2, 5, 8, 32, 33]),
    K=st.sampled_from([1, 3, 31, 32, 33, 64 + 13, 256]),
    N=st.sampled_from([1, 15, 16, 17, 100]),
    dtype=st.sampled_from(FLOAT_DTYPES),
    bits=st.sampled_from([8, 4]),
    layout=st.sampled_from(["contiguous", "strided"]),
    bias=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_linear_matches_reference(M, K, N, dtype, bits, layout, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    x = _rows(M, K, dtype, gen, layout)
    packed = qf.quantize_weight_ref(_weight(N, K, gen), bits)
    b = torch.randn(N, generator=gen).to(dtype) if bias else None
    _assert_within_bound(linear_quantized(x, packed, N, b), x, packed, N, b)


@pytest.mark.parametrize("bits", [8, 4])
def test_linear_1024_rows(bits):
    gen = torch.Generator().manual_seed(1024)
    x = _rows(1024, 512 + 13, torch.bfloat16, gen, "strided")
    packed = quantize_linear_weight(_weight(70, 512 + 13, gen), bits)
    out = linear_quantized(x, packed, 70)
    _assert_within_bound(out, x, packed, 70)
    # and the module's own eager semantics, to the fp32 summation order and one ulp of bf16
    ref = qf.linear_quantized_reference(x, packed, 70)
    tol = 2 * UNIT_ROUNDOFF[torch.bfloat16] * (ref.double().abs() + 1e-3)
    assert ((out.double() - ref.double()).abs() <= tol).all()


@pytest.mark.parametrize("bits", [8, 4])
def test_model_shapes_bf16(bits):
    gen = torch.Generator().manual_seed(5)
    for M, N, K in [(1, 576, 2048), (8, 2048, 1408)]:
        x = torch.randn(M, K, generator=gen).bfloat16()
        packed = quantize_linear_weight((torch.randn(N, K, generator=gen) / K**0.5), bits)
        _assert_within_bound(linear_quantized(x, packed, N), x, packed, N)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_nan_and_inf_propagate_to_their_row_only(value):
    x = torch.randn(3, 70).bfloat16()
    x[1, 40] = value
    packed = quantize_linear_weight(torch.randn(20, 70), 4)
    out = linear_quantized(x, packed, 20)
    ref = qf.linear_quantized_reference(x, packed, 20)
    assert torch.isnan(out[1]).all() and torch.isnan(ref[1]).all()
    assert not torch.isnan(out[[0, 2]]).any()


def test_tiny_activations_stay_finite():
    # amax / 127 below ~2.9e-39: 1 / d overflows; zeros must stay 0 (not 0 * inf = NaN).
    x = torch.zeros(2, 32)
    x[0, 3] = 1e-38
    x[1, 5] = -3e-39
    packed = quantize_linear_weight(torch.randn(16, 32), 8)
    out = linear_quantized(x, packed, 16)
    assert torch.isfinite(out).all()
    assert torch.isfinite(qf.linear_quantized_reference(x, packed, 16)).all()


@pytest.mark.parametrize(("M", "dtype", "bits"), [(0, torch.float32, 8), (3, torch.bfloat16, 4)])
def test_opcheck(M, dtype, bits):
    weight = torch.randn(21, 45).to(dtype)
    torch.library.opcheck(torch.ops.mlafx.quantize_linear_weight.default, (weight, bits))
    packed = quantize_linear_weight(weight, bits)
    x = torch.randn(M, 45).to(dtype)
    bias = torch.randn(21).to(dtype)
    for b in (None, bias):
        torch.library.opcheck(torch.ops.mlafx.linear_quantized.default, (x, packed, 21, b))


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ("x_float64", TypeError, "x must be bfloat16, float16 or float32"),
        ("x_1d", ValueError, r"x must be \[num_rows, in_features\]"),
        ("not_uint8", TypeError, "packed_weight must be uint8"),
        ("not_packed", ValueError, "packed_weight must be an int8/int4 weight"),
        ("out_features", ValueError, "out_features = 40 does not match"),
        ("in_features", ValueError, "x has 70 features but packed_weight has 2 groups"),
        ("x_last_dim_strided", ValueError, "x's last dim must be contiguous"),
        ("bias_shape", ValueError, r"bias must be \[out_features\] = \[20\]"),
        ("bias_dtype", TypeError, "bias dtype"),
    ],
)
def test_invalid_inputs_raise(change, error, match):
    packed = quantize_linear_weight(torch.randn(20, 64), 8)
    x, n, b = torch.randn(3, 64), 20, None
    if change == "x_float64":
        x = x.double()
    elif change == "x_1d":
        x = x[0]
    elif change == "not_uint8":
        packed = packed.to(torch.int8)
    elif change == "not_packed":
        packed = packed[..., :100]
    elif change == "out_features":
        n = 40
    elif change == "in_features":
        x = torch.randn(3, 70)
    elif change == "x_last_dim_strided":
        x = torch.randn(3, 128)[:, ::2]
    elif change == "bias_shape":
        b = torch.randn(21)
    elif change == "bias_dtype":
        b = torch.randn(20).double()
    with pytest.raises(error, match=match):
        linear_quantized(x, packed, n, b)


def test_quantize_rejects_bad_inputs():
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        quantize_linear_weight(torch.randn(4, 32), 3)
    with pytest.raises(ValueError, match=r"weight must be \[out_features, in_features\]"):
        quantize_linear_weight(torch.randn(2, 3, 4), 8)
    with pytest.raises(TypeError, match="weight must be bfloat16, float16 or float32"):
        quantize_linear_weight(torch.randn(2, 3).double(), 8)


_PROBE = """
import sys, torch
from mlafx.kernels import linear_quantized, moe_experts_quantized, quant_cpu_isa
from mlafx.kernels import quantize_linear_weight
linear_cases, moe_cases, weight_cases = torch.load(sys.argv[1])
out = [linear_quantized(x, packed, n) for x, packed, n in linear_cases]
moe = [moe_experts_quantized(*args) for args in moe_cases]
packed = [quantize_linear_weight(w, bits) for w, bits in weight_cases]
torch.save((quant_cpu_isa(), out, moe, packed), sys.argv[2])
"""
_ISA_ENV = ("MLAFX_DISABLE_AVX512", "MLAFX_DISABLE_AVX2", "MLAFX_DISABLE_AMX", "MLAFX_AVX2_ONLY")


def _run_probe(tmp_path, name, **env_vars):
    """quant_cpu_isa() and the outputs of the cases saved in tmp_path/in.pt, in a child
    process whose ISA variables are exactly env_vars (none set: the best path this CPU has)."""
    env = {k: v for k, v in os.environ.items() if k not in _ISA_ENV} | env_vars
    args = [sys.executable, "-c", _PROBE, str(tmp_path / "in.pt"), str(tmp_path / f"{name}.pt")]
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return torch.load(tmp_path / f"{name}.pt")


def _moe_case(T, D, inter, E, k, bits, gen):
    x = _rows(T, D, torch.bfloat16, gen, "strided")
    ids = torch.randint(0, E, (T, k), generator=gen)
    weights = torch.rand(T, k, generator=gen)
    w13 = quantize_experts(torch.randn(E, 2 * inter, D, generator=gen) / D**0.5, bits)
    w2 = quantize_experts(torch.randn(E, D, inter, generator=gen) / inter**0.5, bits)
    return x, ids, weights, w13, w2, inter


def test_best_path_is_bit_identical_to_portable(tmp_path):
    """The best kernel this CPU has (AVX-512 VNNI or AVX2; a child with no ISA variables)
    and the AVX2 tier alone (MLAFX_AVX2_ONLY=1, what a CPU without AVX-512 runs) against the
    portable one (MLAFX_DISABLE_AVX512=1): equal bit for bit, and within the fp64 bound; the
    weight quantizer's packed bytes too. Shapes cover every row-tile remainder (M mod 4), one
    row, prefill-sized M, odd K, N not a multiple of 16, several weight chunks (K = 2048),
    strided rows."""
    gen = torch.Generator().manual_seed(3)
    linear_cases = []
    shapes = [(1, 77, 33), (5, 64 + 13, 100), (6, 33, 17), (7, 96, 40), (8, 256, 17)]
    shapes += [(33, 256, 17), (1, 2048, 200), (8, 2048 + 13, 70), (1030, 96 + 5, 40)]
    # AMX-INT8 from 48 rows (int8) / 32 (int4): whole row tiles, several steps of blocks, a
    # partial last row tile, odd K (the padded row stride of the quantized rows)
    shapes += [(32, 64, 16), (48, 64, 16), (64, 2048, 300), (50, 2048 + 13, 40)]
    for bits in (8, 4):
        for M, K, N in shapes:
            x = _rows(M, K, torch.bfloat16, gen, "strided")
            linear_cases.append((x, quantize_linear_weight(_weight(N, K, gen), bits), N))
    # the activation quantizer on the other input dtypes and on its edge groups: all zero,
    # -0, values whose 1 / d overflows, a last group of 13 columns
    edge = torch.randn(4, 77, generator=gen)
    edge[0, :32] = 0.0
    edge[1, 40] = -0.0
    edge[2, :64] = 0.0
    edge[2, 3], edge[2, 40] = 1e-38, -3e-39
    for x in (edge, _rows(5, 77, torch.float16, gen, "strided"), edge[:, :45].bfloat16()):
        packed = quantize_linear_weight(_weight(40, x.shape[1], gen), 4)
        linear_cases.append((x, packed, 40))
    # the K formats (GGUF's Q4_K as k4, Q6_K and Q5_K as k8): every row-tile remainder, N
    # not a multiple of 16, several super-blocks and weight chunks
    for qtype in (Q.Q4_K, Q.Q6_K, Q.Q5_K):
        for M, K, N in [(1, 256, 33), (2, 512, 17), (3, 256, 40), (4, 2048, 200), (9, 768, 20)]:
            x = _rows(M, K, torch.bfloat16, gen, "strided")
            linear_cases.append((x, kquant_weight(qtype, N, K, gen), N))
    # moe: the streaming path (few pairs per expert) and the per-expert GEMM path (> 16), and
    # a GGUF Q4_K_M-like stack (gate/up k4, down k8)
    moe_cases = [_moe_case(T, 64 + 13, 21, 3, 2, bits, gen) for bits in (8, 4) for T in (3, 40)]
    # 48 rows on one expert (the per-expert GEMM path): AMX-INT8 over a thread's 19 blocks of
    # w2's rows, more than one staged chunk
    moe_cases += [_moe_case(48, 600, 64, 1, 1, bits, gen) for bits in (8, 4)]
    # the SwiGLU's edges (AVX-512 rows against the scalar loop): gates so large that
    # exp(-g) overflows (silu -> -0) or underflows to 0, on both paths
    big = _moe_case(40, 64 + 13, 21, 3, 2, 8, gen)
    moe_cases.append((big[0] * 2000, *big[1:]))
    moe_cases += [kquant_moe_case(T, 256, 256, 3, 2, gen) for T in (3, 40)]
    # the weight quantizer (AVX2: 8 groups per vector), odd K and a zero-padded last block
    weight_cases = [
        (_weight(N, K, gen, dtype), bits)
        for bits in (8, 4)
        for N, K, dtype in [(33, 77, torch.float32), (200, 2048 + 13, torch.bfloat16)]
    ]
    torch.save((linear_cases, moe_cases, weight_cases), tmp_path / "in.pt")
    isa, best, best_moe, best_packed = _run_probe(tmp_path, "best")
    portable_isa, portable, portable_moe, portable_packed = _run_probe(
        tmp_path, "portable", MLAFX_DISABLE_AVX512="1"
    )
    # where the CPU has AMX-INT8, the best path runs it from 32 / 48 rows; without it, VNNI alone
    _, no_amx, no_amx_moe, _ = _run_probe(tmp_path, "no_amx", MLAFX_DISABLE_AMX="1")
    # the AVX2 tier alone, what a CPU without AVX-512 runs (on any CPU with AVX2)
    avx2_isa, avx2, avx2_moe, avx2_packed = _run_probe(tmp_path, "avx2_only", MLAFX_AVX2_ONLY="1")
    assert portable_isa == "portable"
    flags = cpu_flags()
    if has_avx2():
        assert isa in ("avx2", "avx512_vnni"), isa
        assert avx2_isa == "avx2"
    if {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "f16c"} <= flags:
        assert isa == "avx512_vnni", isa
    for (x, packed, n), out, out_vnni, out_avx2, expected in zip(
        linear_cases, best, no_amx, avx2, portable, strict=True
    ):
        assert torch.equal(out, expected), (isa, tuple(x.shape), n, packed.shape[-1])
        assert torch.equal(out_vnni, expected), ("no AMX", tuple(x.shape), n)
        assert torch.equal(out_avx2, expected), ("AVX2 only", tuple(x.shape), n)
        _assert_within_bound(out, x, packed, n)
    for args, out, out_vnni, out_avx2, expected in zip(
        moe_cases, best_moe, no_amx_moe, avx2_moe, portable_moe, strict=True
    ):
        assert torch.equal(out, expected), (isa, tuple(args[0].shape))
        assert torch.equal(out_vnni, expected), ("no AMX", tuple(args[0].shape))
        assert torch.equal(out_avx2, expected), ("AVX2 only", tuple(args[0].shape))
        reference = moe_experts_quantized_f64(*args)
        scale = max(reference.abs().max().item(), 1e-6)
        torch.testing.assert_close(out.double(), reference, atol=2e-2 * scale, rtol=2e-2)
    for (weight, bits), ours, ours_avx2, expected in zip(
        weight_cases, best_packed, avx2_packed, portable_packed, strict=True
    ):
        assert torch.equal(ours, expected), (isa, tuple(weight.shape), bits)
        assert torch.equal(ours_avx2, expected), ("AVX2 only", tuple(weight.shape), bits)
    # and the in-process kernel (whatever this process's environment chose) agrees too
    for (x, packed, n), expected in zip(linear_cases[:4], portable, strict=False):
        assert torch.equal(linear_quantized(x, packed, n), expected), quant_cpu_isa()


def test_disable_avx2_leaves_no_avx2(tmp_path):
    torch.save(([], [], []), tmp_path / "in.pt")
    isa, *_ = _run_probe(tmp_path, "no_avx2", MLAFX_DISABLE_AVX2="1")
    assert isa in ("avx512_vnni", "portable")
