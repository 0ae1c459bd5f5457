"""mlafx::linear_fp8 and mlafx::moe_experts_fp8 against float64 references
(``kernels/fp8_reference.py``: the exact dequantized weight times x in float64).

Each product ``x * e4m3(w)`` is exact in fp32, so a kernel differs from the reference only by
its fp32 summation (bounded by ``|x| @ |w|^T * 2^-20``, far above fp32's few ulps per block
and far below any real error: a wrong scale block or a mis-decoded byte is off by whole
percents) and the final rounding to x's dtype (half an ulp: 2^-8 bf16, 2^-11 fp16, 2^-24 fp32,
relative). Child processes run the portable path (MLAFX_DISABLE_AVX512=1) next to the best one
this CPU has; the two agree to the same bound, not bit for bit (their fp32 sums run in
different orders).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from cpu_flags import has_avx2
from hypothesis import given, settings
from hypothesis import strategies as st

from mlafx.kernels import cpu_isa, linear_fp8, moe_experts_fp8
from mlafx.kernels.fp8_format import dequantize_fp8, quantize_fp8, scale_shape
from mlafx.kernels.fp8_reference import linear_fp8_f64, magnitude_f64, moe_experts_fp8_f64
from mlafx.models.fp8 import moe_experts_fp8_reference

FLOAT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
ROUNDING = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
NAN_BYTES = (0x7F, 0xFF)


def _weight(n, k, gen):
    """Random e4m3 bytes over every finite value (±448, subnormals, ±0 included)."""
    b = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.uint8)
    b[(b & 0x7F) == 0x7F] = 0x7E  # NaN -> ±448
    return b.view(torch.float8_e4m3fn)


def _scale(n, k, block, gen):
    return torch.rand(scale_shape(n, k, block), generator=gen) * 2e-3 + 1e-5


def _rows(m, k, dtype, gen, layout="contiguous"):
    x = torch.randn(m, k, generator=gen).to(dtype)
    if layout == "strided":
        wide = torch.zeros(m, k + 7, dtype=dtype)
        wide[:, 5 : 5 + k] = x
        x = wide[:, 5 : 5 + k]
    return x


def _assert_within_bound(out, x, w, s, block, bias=None):
    """|out - ref| within the fp32 summation bound plus the roundings to x's dtype: the
    product's, and with a bias the sum's (the op adds the bias after rounding). A rounding
    into the subnormal range errs by up to half the smallest subnormal, which is not
    relative: fp16's, 2^-25, is above 2^-11 |ref| for |ref| < 2^-14."""
    assert out.dtype == x.dtype and out.shape == (x.shape[0], w.shape[0])
    product = linear_fp8_f64(x, w, s, block)
    unit = ROUNDING[x.dtype]
    half_subnormal = torch.finfo(x.dtype).smallest_normal * torch.finfo(x.dtype).eps / 2
    bound = magnitude_f64(x, w, s, block) * 2.0**-20 + half_subnormal + product.abs() * unit
    ref = product
    if bias is not None:
        ref = product + bias.double()
        bound += torch.maximum(ref.abs(), out.double().abs()) * unit
    err = (out.double() - ref).abs()
    assert torch.all(err <= bound), f"worst {(err / bound).max().item():.3f} of the bound"


@settings(max_examples=60, deadline=None)
@given(
    m=st.sampled_from([1, 2, 3, 5, 8, 9, 17]),
    n=st.sampled_from([1, 7, 16, 33, 130]),
    k=st.sampled_from([32, 40, 96, 129, 300]),
    block=st.sampled_from([(128, 128), (1, 32), (3, 64), (16, 96), (130, 32)]),
    dtype=st.sampled_from(FLOAT_DTYPES),
    layout=st.sampled_from(["contiguous", "strided"]),
    bias=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_linear_matches_reference(m, n, k, block, dtype, layout, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    w, s = _weight(n, k, gen), _scale(n, k, block, gen)
    x = _rows(m, k, dtype, gen, layout)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None
    _assert_within_bound(linear_fp8(x, w, s, block, b), x, w, s, block, b)


@settings(max_examples=40, deadline=None)
@given(
    m=st.sampled_from([2, 3, 15, 16, 17, 255, 256, 257, 300]),
    n=st.sampled_from([1, 15, 16, 17, 40]),
    k=st.sampled_from([64, 130, 200, 448]),
    block=st.sampled_from([(128, 128), (3, 64), (48, 192), (16, 64)]),
    seed=st.integers(0, 2**31 - 1),
)
def test_tile_path_edges(m, n, k, block, seed):
    """bf16 rows from 2 on with block_k a multiple of 64: on AMX the tile kernel
    (fp8_dot_amx_avx512.cpp). Partial 16-row tiles of weight and of x, rows of x past one
    256-row pass, K past a 64-column chunk, scales changing inside a 16-row tile (block_n 3)
    and panels of one and of two blocks."""
    gen = torch.Generator().manual_seed(seed)
    w, s = _weight(n, k, gen), _scale(n, k, block, gen)
    x = _rows(m, k, torch.bfloat16, gen, "strided")
    _assert_within_bound(linear_fp8(x, w, s, block), x, w, s, block)


@settings(max_examples=40, deadline=None)
@given(
    m=st.sampled_from([9, 16, 17, 33, 48, 49, 97]),
    n=st.sampled_from([1, 8, 15, 17, 63, 64, 65, 130]),
    k=st.sampled_from([1, 31, 64, 130, 257]),
    block=st.sampled_from([(128, 128), (3, 32), (48, 96), (16, 64)]),
    seed=st.integers(0, 2**31 - 1),
)
def test_pairs_path_edges(m, n, k, block, seed):
    """bf16 rows from 9 on without AMX tiles (this CPU without AMX, or block_k not a multiple
    of 64): the pairs GEMM (fp8_pairs_avx512.cpp). Panels of 48 rows cut short, 16- and 8-row
    register tiles cut short, 64-row chunks of weight and a partial one after them, odd K (a
    pair with one column), scales changing inside a register tile (block_n 3)."""
    gen = torch.Generator().manual_seed(seed)
    w, s = _weight(n, k, gen), _scale(n, k, block, gen)
    x = _rows(m, k, torch.bfloat16, gen, "strided")
    _assert_within_bound(linear_fp8(x, w, s, block), x, w, s, block)


def test_pairs_rows_do_not_depend_on_the_call():
    """The pairs GEMM (block_k 96 is not the AMX tiles' on any CPU) gives a row the same bits
    at 9 rows and at 97 (its sums run in one order for any row count from 9): its dispatch and
    its staging are seen, not only its error bound."""
    if cpu_isa() not in ("avx512_bf16", "avx512_amx"):
        pytest.skip("the pairs GEMM needs AVX-512 BF16")
    gen = torch.Generator().manual_seed(9)
    n, k, block = 130, 300, (48, 96)
    w, s = _weight(n, k, gen), _scale(n, k, block, gen)
    x = _rows(97, k, torch.bfloat16, gen)
    many, few = linear_fp8(x, w, s, block), linear_fp8(x[:9].clone(), w, s, block)
    assert torch.equal(many[:9], few)
    _assert_within_bound(many, x, w, s, block)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("m", [1, 8, 32, 33, 1024])
def test_rows_and_partial_blocks(m, dtype):
    """The row counts of decode, batched decode and prefill (every tile remainder), a width
    and height that leave partial edge blocks on both axes."""
    gen = torch.Generator().manual_seed(m)
    n, k, block = 300, 200, (128, 128)
    w, s = _weight(n, k, gen), _scale(n, k, block, gen)
    x = _rows(m, k, dtype, gen)
    _assert_within_bound(linear_fp8(x, w, s, block), x, w, s, block)


def test_every_byte_decodes_exactly():
    """Row b is byte b repeated (all 254 finite values: ±448, the subnormals 2^-9..1.75*2^-7,
    ±0): with x = 1 and scale 1 each output is 32 * value, exact in fp32, and equal to torch's
    own e4m3 decoding."""
    bytes_ = torch.tensor([b for b in range(256) if b not in NAN_BYTES], dtype=torch.uint8)
    w = bytes_.unsqueeze(1).expand(-1, 32).contiguous().view(torch.float8_e4m3fn)
    s = torch.ones(scale_shape(w.shape[0], 32, (1, 32)))
    for dtype in (torch.float32, torch.bfloat16):
        out = linear_fp8(torch.ones(1, 32, dtype=dtype), w, s, (1, 32))[0].float()
        expected = 32 * w[:, 0].float()
        assert torch.equal(out, expected.to(dtype).float())
    assert (w[:, 0].float().abs().max() == 448) and (w[:, 0].float().abs().min() == 0)


def test_subnormal_bytes_survive_flush_denormal():
    """With MXCSR's DAZ/FTZ set (torch.set_flush_denormal) the e4m3 subnormals still decode:
    no path holds them as fp32 subnormals (the AVX2 kernel widens them from fp16
    subnormals, which VCVTPH2PS converts whatever DAZ says)."""
    subnormals = torch.tensor([m | sign for m in range(1, 8) for sign in (0, 0x80)])
    w = subnormals.to(torch.uint8).unsqueeze(1).expand(-1, 64).contiguous()
    w = w.view(torch.float8_e4m3fn)
    s = torch.ones(scale_shape(w.shape[0], 64, (1, 32)))
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush denormals")
    try:
        out = linear_fp8(torch.ones(1, 64), w, s, (1, 32))[0]
    finally:
        torch.set_flush_denormal(False)
    assert torch.equal(out, 64 * w[:, 0].float())


@pytest.mark.parametrize("m", [1, 3, 8])
def test_nan_weight_poisons_its_row_only(m):
    """A NaN byte inside a whole 32-byte step and one in the partial last block: only those
    rows are NaN, whatever tile of weight rows they were decoded with."""
    gen = torch.Generator().manual_seed(m)
    w, s = _weight(8, 200, gen), _scale(8, 200, (128, 128), gen)
    w.view(torch.uint8)[2, 10] = 0x7F
    w.view(torch.uint8)[5, 195] = 0xFF
    out = linear_fp8(torch.randn(m, 200, generator=gen).bfloat16(), w, s, (128, 128))
    assert out[:, [2, 5]].isnan().all() and not out[:, [0, 1, 3, 4, 6, 7]].isnan().any()


@pytest.mark.parametrize("block", [(128, 128), (16, 32)])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8, 9, 17])
def test_long_rows_every_tile(m, block):
    """Rows long enough that the few-rows kernels cut K into segments (the AVX2 kernel keeps
    a segment of x's fp32 rows in L1) and weight rows in more than one chunk, with a partial
    last block: every row count's tile against the float64 reference."""
    gen = torch.Generator().manual_seed(10 + m)
    n, k = 37, 1100
    w, s = _weight(n, k, gen), _scale(n, k, block, gen)
    x = _rows(m, k, torch.bfloat16, gen, "strided")
    _assert_within_bound(linear_fp8(x, w, s, block), x, w, s, block)


def test_quantizer_round_trips_within_e4m3():
    gen = torch.Generator().manual_seed(1)
    weight = torch.randn(200, 300, generator=gen)
    q, s = quantize_fp8(weight, (128, 128))
    assert q.dtype == torch.float8_e4m3fn and s.shape == (2, 3)
    back = dequantize_fp8(q, s, (128, 128))
    # e4m3 keeps 3 mantissa bits: a relative error of at most 2^-4, or a subnormal step
    assert torch.all((back - weight).abs() <= weight.abs() * 2**-4 + s.max() * 2**-9)


# opcheck's test_schema compares inputs before and after with arithmetic torch lacks for
# float8 ("mul_cpu_reduced_float" not implemented); the other utils run, and _opcheck checks
# the inputs are left untouched itself.
_OPCHECK_UTILS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _opcheck(op, args):
    before = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
    torch.library.opcheck(op, args, test_utils=_OPCHECK_UTILS)
    for a, b in zip(args, before, strict=True):
        if isinstance(a, torch.Tensor):
            assert torch.equal(
                a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b,
            )


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_opcheck(dtype):
    gen = torch.Generator().manual_seed(2)
    w, s = _weight(33, 96, gen), _scale(33, 96, (16, 32), gen)
    w64, s64 = _weight(33, 96, gen), _scale(33, 96, (16, 64), gen)  # the AMX tiles from 4 rows
    for m in (0, 1, 9):
        x = _rows(m, 96, dtype, gen)
        bias = torch.randn(33, generator=gen).to(dtype)
        for b in (None, bias):
            _opcheck(torch.ops.mlafx.linear_fp8.default, (x, w, s, 16, 32, b))
            _opcheck(torch.ops.mlafx.linear_fp8.default, (x, w64, s64, 16, 64, b))
    args = _moe_case(5, 64, 40, 3, 2, dtype, gen)
    _opcheck(torch.ops.mlafx.moe_experts_fp8.default, (*args[:-1], *args[-1]))


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda a: a.update(w=a["w"].view(torch.uint8)), TypeError, "float8_e4m3fn"),
        (lambda a: a.update(s=a["s"].double()), TypeError, "float32"),
        (lambda a: a.update(s=a["s"][:, :1].contiguous()), ValueError, "one per"),
        (lambda a: a.update(block=(16, 48)), ValueError, "multiple of 32"),
        (lambda a: a.update(x=a["x"][:, :32]), ValueError, "must be"),
        (lambda a: a.update(x=a["x"].int()), TypeError, "bfloat16, float16 or float32"),
    ],
)
def test_invalid_inputs_raise(change, error, match):
    gen = torch.Generator().manual_seed(3)
    args = {"w": _weight(20, 64, gen), "block": (16, 32), "x": torch.randn(2, 64)}
    args["s"] = _scale(20, 64, args["block"], gen)
    change(args)
    with pytest.raises(error, match=match):
        linear_fp8(args["x"], args["w"], args["s"], args["block"])


# ---- experts ------------------------------------------------------------------------------

MOE_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-4}


def _moe_case(T, D, inter, E, k, dtype, gen, block=(128, 128), repeat=False):
    x = torch.randn(T, D, generator=gen).to(dtype)
    ids = torch.randint(0, E, (T, k), generator=gen)
    if repeat and k > 1:
        ids[:, 1] = ids[:, 0]
    weights = torch.rand(T, k, generator=gen)
    gate_rows = 2 * scale_shape(inter, D, block)[0]
    w13 = _weight(E * 2 * inter, D, gen).view(E, 2 * inter, D)
    s13 = torch.rand(E, gate_rows, scale_shape(inter, D, block)[1], generator=gen) * 4e-3 / D**0.5
    w2 = _weight(E * D, inter, gen).view(E, D, inter)
    s2 = torch.rand(E, *scale_shape(D, inter, block), generator=gen) * 4e-3 / inter**0.5
    return x, ids, weights, w13, s13, w2, s2, block


def _assert_moe_close(out, args):
    x = args[0]
    assert out.dtype == x.dtype and out.shape == x.shape
    if out.numel() == 0:
        return
    expected = moe_experts_fp8_f64(*args)
    tol = MOE_TOLERANCE[x.dtype]
    scale = max(expected.abs().max().item(), 1e-6)
    torch.testing.assert_close(out.double(), expected, atol=tol * scale, rtol=tol)
    eager = moe_experts_fp8_reference(*args)
    torch.testing.assert_close(out.double(), eager.double(), atol=tol * scale, rtol=tol)


@settings(max_examples=30, deadline=None)
@given(
    T=st.sampled_from([0, 1, 3, 8, 20]),
    D=st.sampled_from([32, 96, 200]),
    inter=st.sampled_from([32, 72, 130]),
    E=st.sampled_from([1, 3, 6]),
    k=st.sampled_from([1, 2, 3]),
    block=st.sampled_from([(128, 128), (16, 32), (64, 64)]),
    dtype=st.sampled_from(FLOAT_DTYPES),
    repeat=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_moe_matches_reference(T, D, inter, E, k, block, dtype, repeat, seed):
    gen = torch.Generator().manual_seed(seed)
    args = _moe_case(T, D, inter, E, k, dtype, gen, block, repeat)
    _assert_moe_close(moe_experts_fp8(*args), args)


@pytest.mark.parametrize("pairs", [16, 17, 70])
def test_moe_streaming_and_gemm_paths(pairs):
    """One expert with ``pairs`` pairs (more than 16 take the per-expert path), others few."""
    gen = torch.Generator().manual_seed(pairs)
    x, ids, *rest = _moe_case(pairs + 3, 200, 72, 2, 1, torch.bfloat16, gen)
    ids[:pairs] = 0
    ids[pairs:] = 1
    args = (x, ids, *rest)
    _assert_moe_close(moe_experts_fp8(*args), args)


@pytest.mark.parametrize("tokens", [3, 40])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_moe_swiglu_limit(tokens, dtype):
    """DeepSeek-V4's clamped SwiGLU (g from above, u on both sides), on the streaming and the
    per-expert paths; opcheck with the limit."""
    gen = torch.Generator().manual_seed(tokens)
    x, ids, weights, w13, s13, w2, s2, block = _moe_case(tokens, 200, 72, 2, 2, dtype, gen)
    s13 *= 8  # g and u of a few units: a limit of 0.5 clamps most of them
    args = (x, ids, weights, w13, s13, w2, s2, block)
    out = moe_experts_fp8(*args, swiglu_limit=0.5)
    expected = moe_experts_fp8_f64(*args, swiglu_limit=0.5)
    tol = MOE_TOLERANCE[dtype]
    scale = max(expected.abs().max().item(), 1e-6)
    torch.testing.assert_close(out.double(), expected, atol=tol * scale, rtol=tol)
    eager = moe_experts_fp8_reference(*args, swiglu_limit=0.5)
    torch.testing.assert_close(out.double(), eager.double(), atol=tol * scale, rtol=tol)
    unclamped = moe_experts_fp8_f64(*args)
    assert (unclamped - expected).abs().max() > 10 * tol * scale  # the limit mattered
    _opcheck(torch.ops.mlafx.moe_experts_fp8.default, (*args[:-1], *block, 0.5))


def test_moe_out_of_range_id_raises():
    gen = torch.Generator().manual_seed(4)
    x, ids, *rest = _moe_case(3, 64, 32, 2, 1, torch.float32, gen)
    ids[1, 0] = 2
    with pytest.raises(IndexError, match="out of range"):
        moe_experts_fp8(x, ids, *rest)


# ---- every ISA path, in child processes ---------------------------------------------------

_PROBE = """
import sys, torch
from mlafx.kernels import fp8_cpu_isa, linear_fp8, moe_experts_fp8
linear_cases, moe_cases = torch.load(sys.argv[1])
out = [linear_fp8(*args) for args in linear_cases]
moe = [moe_experts_fp8(*args) for args in moe_cases]
torch.save((fp8_cpu_isa(), out, moe), sys.argv[2])
"""


_ISA_VARIABLES = ("MLAFX_DISABLE", "MLAFX_AVX2_ONLY")


def _run_probe(tmp_path, name, **env_vars):
    env = {k: v for k, v in os.environ.items() if not k.startswith(_ISA_VARIABLES)} | env_vars
    args = [sys.executable, "-c", _PROBE, str(tmp_path / "in.pt"), str(tmp_path / f"{name}.pt")]
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return torch.load(tmp_path / f"{name}.pt")


def test_every_isa_path_within_the_bound(tmp_path):
    """The best path this CPU has (no variables; AMX tiles and the VBMI byte-table decoding
    where the CPU has them), the AVX-512 one without AMX (VBMI up to 8 rows, the pairs GEMM
    from 9), the arithmetic decoding (MLAFX_DISABLE_VBMI=1), the one
    below AVX2 (MLAFX_DISABLE_AVX2=1: AVX-512 where the CPU has it, else portable) and the
    portable one (MLAFX_DISABLE_AVX512=1), and the AVX2 tier alone (MLAFX_AVX2_ONLY=1: what a
    CPU without AVX-512 runs, on any CPU with AVX2) on the same cases: rows 1/8/32/33/1024,
    every dtype, partial blocks, strided rows, segmented long rows, both expert paths."""
    gen = torch.Generator().manual_seed(5)
    linear_cases = []
    for m in (1, 8, 32, 33, 1024):
        for dtype in FLOAT_DTYPES:
            n, k, block = 150, 200, (128, 128)
            w, s = _weight(n, k, gen), _scale(n, k, block, gen)
            linear_cases.append((_rows(m, k, dtype, gen, "strided"), w, s, block))
    for m in (1, 3, 4, 8):  # segments of K and chunks of weight rows (the AVX2 kernel's)
        n, k, block = 37, 1100, (16, 32)
        w, s = _weight(n, k, gen), _scale(n, k, block, gen)
        linear_cases.append((_rows(m, k, torch.bfloat16, gen), w, s, block))
    moe_cases = [_moe_case(t, 200, 72, 4, 2, dtype, gen) for t in (1, 40) for dtype in FLOAT_DTYPES]
    torch.save((linear_cases, moe_cases), tmp_path / "in.pt")
    runs = {
        "best": _run_probe(tmp_path, "best"),
        "no_amx": _run_probe(tmp_path, "no_amx", MLAFX_DISABLE_AMX="1"),
        "no_vbmi": _run_probe(tmp_path, "no_vbmi", MLAFX_DISABLE_VBMI="1"),
        "no_avx2": _run_probe(tmp_path, "no_avx2", MLAFX_DISABLE_AVX2="1"),
        "avx2_only": _run_probe(tmp_path, "avx2_only", MLAFX_AVX2_ONLY="1"),
        "portable": _run_probe(tmp_path, "portable", MLAFX_DISABLE_AVX512="1"),
    }
    assert runs["portable"][0] == "portable"
    assert runs["avx2_only"][0] == ("avx2" if has_avx2() else "portable")
    if cpu_isa() in ("avx512_bf16", "avx512_amx"):  # its paths, whatever AVX2 says
        assert runs["best"][0] in ("avx512_amx", "avx512_vbmi", "avx512_bf16")
        assert runs["no_avx2"][0] == runs["best"][0]
        assert runs["no_amx"][0] == runs["best"][0].replace("avx512_amx", "avx512_vbmi")
        assert runs["no_vbmi"][0] == "avx512_bf16"
    elif has_avx2():
        assert runs["best"][0] == "avx2" and runs["no_avx2"][0] == "portable"
    for _, out, moe in runs.values():
        for result, args in zip(out, linear_cases, strict=True):
            _assert_within_bound(result, *args)
        for result, args in zip(moe, moe_cases, strict=True):
            _assert_moe_close(result, args)
