"""mlafx::moe_experts_fp4 (DeepSeek-V4's FP4 experts: e2m1 nibbles, a ue8m0 scale per 32 along
K) against a float64 reference (the exact dequantized weights times x in float64, rounding to
x's dtype only where the op's semantics round) and against its eager reference
(``models.deepseek_v4.quantized.moe_experts_fp4_reference``).

Every product ``x * e2m1 * 2^s`` is exact in fp32, so the kernels differ from the references
only by their fp32 summation and the roundings to x's dtype. Child processes run the portable
path (MLAFX_DISABLE_AVX512=1) next to the best one this CPU has.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from mlafx.kernels import cpu_isa, moe_experts_fp4
from mlafx.kernels.fp4_format import dequantize_fp4, quantize_fp4
from mlafx.models.deepseek_v4.quantized import moe_experts_fp4_reference

FLOAT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-4}


def _stack(e, n, k, gen, exponent):
    """Random nibbles (all 16 codes: ±0 to ±6) and ue8m0 bytes around ``2^exponent``."""
    packed = torch.randint(0, 256, (e, n, k // 2), generator=gen, dtype=torch.uint8)
    groups = -(-k // 32)
    scale = torch.randint(127 + exponent - 2, 127 + exponent + 1, (e, n, groups), generator=gen)
    return packed.view(torch.int8), scale.to(torch.uint8)


def _case(T, D, inter, E, k, dtype, gen, limit=math.inf, repeat=False, strided=False):
    x = torch.randn(T, D, generator=gen).to(dtype)
    if strided:
        wide = torch.zeros(T, D + 6, dtype=dtype)
        wide[:, 3 : 3 + D] = x
        x = wide[:, 3 : 3 + D]
    ids = torch.randint(0, E, (T, k), generator=gen)
    if repeat and k > 1:
        ids[:, 1] = ids[:, 0]
    weights = torch.rand(T, k, generator=gen)
    # scales so that g, u and y stay O(1): |e2m1| ~ 2.5 on average
    w13, s13 = _stack(E, 2 * inter, D, gen, -round(math.log2(D) / 2) - 2)
    w2, s2 = _stack(E, D, inter, gen, -round(math.log2(inter) / 2) - 2)
    return x, ids, weights, w13, s13, w2, s2, limit


def _f64(x, ids, weights, w13, s13, w2, s2, limit):
    out = torch.zeros(x.shape, dtype=torch.float64)
    inter = w2.shape[-1] * 2
    gate_up_w, down_w = dequantize_fp4(w13, s13).double(), dequantize_fp4(w2, s2).double()
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate_up = (x[t : t + 1].double() @ gate_up_w[e].t()).to(x.dtype)
            g, u = gate_up[:, :inter], gate_up[:, inter:]
            h = F.silu(g.clamp(max=limit)) * u.clamp(min=-limit, max=limit)
            y = (h.double() @ down_w[e].t()).to(x.dtype)
            out[t] += float(weights[t, j]) * y[0].double()
    return out


def _assert_close(out, args):
    x = args[0]
    assert out.dtype == x.dtype and out.shape == x.shape
    if out.numel() == 0:
        return
    expected = _f64(*args)
    tol = TOLERANCE[x.dtype]
    scale = max(expected.abs().max().item(), 1e-6)
    torch.testing.assert_close(out.double(), expected, atol=tol * scale, rtol=tol)
    eager = moe_experts_fp4_reference(*args)
    torch.testing.assert_close(out.double(), eager.double(), atol=tol * scale, rtol=tol)


@settings(max_examples=30, deadline=None)
@given(
    T=st.sampled_from([0, 1, 3, 8, 20]),
    D=st.sampled_from([32, 96, 200]),
    inter=st.sampled_from([32, 72, 130]),
    E=st.sampled_from([1, 3, 6]),
    k=st.sampled_from([1, 2, 3]),
    dtype=st.sampled_from(FLOAT_DTYPES),
    limit=st.sampled_from([math.inf, 0.3]),
    repeat=st.booleans(),
    strided=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_references(T, D, inter, E, k, dtype, limit, repeat, strided, seed):
    gen = torch.Generator().manual_seed(seed)
    args = _case(T, D, inter, E, k, dtype, gen, limit, repeat, strided)
    _assert_close(moe_experts_fp4(*args), args)


@pytest.mark.parametrize("pairs", [8, 9, 16, 17, 70])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_streaming_and_gemm_paths(pairs, dtype):
    """One expert with ``pairs`` pairs: up to 16 stream (bf16: up to 8 rows the few-rows
    kernel, from 9 AMX tiles where the CPU has them, else widened weight tiles), more take the
    per-expert path (AMX tiles, else the bf16 GEMM from 16 rows; fp32: widened tiles, the fp32
    GEMM from 64)."""
    gen = torch.Generator().manual_seed(pairs)
    x, ids, *rest = _case(pairs + 3, 200, 72, 2, 1, dtype, gen, limit=0.5)
    ids[:pairs] = 0
    ids[pairs:] = 1
    args = (x, ids, *rest)
    _assert_close(moe_experts_fp4(*args), args)


@pytest.mark.parametrize("per_expert", [2, 12], ids=["few-rows", "tiles"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_weights_and_scale_extremes(per_expert, dtype):
    """Weights from ``quantize_fp4`` (the published scales: a power of two per group), and
    scale bytes at the ends of ue8m0: 0 and 1 (2^-127, 2^-126: subnormal weights), 250 (2^123,
    over codes of 0.5, so the outputs stay finite), and 255 (NaN) in one group of one expert,
    which must make exactly the tokens routed there NaN. bf16 x takes the kernels that fold a
    scale into the bf16 exponents (2 rows an expert: the few-rows kernel; 12: AMX tiles where
    the CPU has them), which send the other scales through fp32."""
    gen = torch.Generator().manual_seed(7)
    D, inter, E = 64, 64, 3
    w13, s13 = quantize_fp4(torch.randn(E, 2 * inter, D, generator=gen) * D**-0.5)
    w2, s2 = quantize_fp4(torch.randn(E, D, inter, generator=gen) * inter**-0.5)
    s13, s2 = s13.view(torch.uint8).clone(), s2.view(torch.uint8).clone()
    x = torch.randn(3 * per_expert, D, generator=gen).to(dtype)
    ids = torch.arange(3).repeat(per_expert).view(-1, 1)
    weights = torch.ones(3 * per_expert, 1)
    args = (x, ids, weights, w13, s13, w2, s2, math.inf)
    _assert_close(moe_experts_fp4(*args), args)
    s13[0, :, 0] = 0  # expert 0: its gate/up's first group underflows to subnormal weights ...
    s13[0, :, 1] = 1  # ... and its second nearly
    s2[1, 3, 1] = 250  # expert 1: one output's second group at 2^123 ...
    w2.view(torch.uint8)[1, 3, 16:32] = 0x11  # ... over weights of 0.5: 2^122
    s13[2, 5, 1] = 255  # expert 2: NaN
    x[ids[:, 0] == 0] *= 2.0**120  # so that expert 0's subnormal weights give g, u of ~0.1
    out = moe_experts_fp4(x, ids, weights, w13, s13, w2, s2)
    ref = moe_experts_fp4_reference(x, ids, weights, w13, s13, w2, s2)
    nan = ref.isnan().any(dim=1)
    assert torch.equal(nan, ids[:, 0] == 2)
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.isinf(), ref.isinf())
    assert bool(ref[ids[:, 0] == 1, 3].float().abs().min() > 1e30)
    assert not bool(ref[~nan].isinf().any())
    ok = ~nan
    tol = TOLERANCE[dtype]
    assert bool(ref[ids[:, 0] == 0].float().abs().max() > 1e-3)  # the subnormals mattered
    scale = ref[ids[:, 0] == 1, :3].float().abs().median()
    torch.testing.assert_close(out[ok].float(), ref[ok].float(), atol=tol * scale, rtol=tol)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_opcheck(dtype):
    gen = torch.Generator().manual_seed(2)
    for t in (0, 1, 9):
        args = _case(t, 64, 40, 3, 2, dtype, gen, limit=1.0)
        torch.library.opcheck(torch.ops.mlafx.moe_experts_fp4.default, args)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda a: a.__setitem__(3, a[3].float()), TypeError, "bytes"),
        (lambda a: a.__setitem__(4, a[4][:, :, :1].contiguous()), ValueError, "w13_scale"),
        (lambda a: a.__setitem__(0, a[0][:, :63]), ValueError, "even"),
        (lambda a: a.__setitem__(0, a[0].int()), TypeError, "bfloat16, float16 or float32"),
        (lambda a: a.__setitem__(7, 0.0), ValueError, "positive"),
        (lambda a: a[1].__setitem__((1, 0), 3), IndexError, "out of range"),
    ],
)
def test_invalid_inputs_raise(change, error, match):
    args = list(_case(3, 64, 32, 3, 1, torch.float32, torch.Generator().manual_seed(3)))
    change(args)
    with pytest.raises(error, match=match):
        moe_experts_fp4(*args)


_PROBE = """
import sys, torch
from mlafx.kernels import cpu_isa, moe_experts_fp4
cases = torch.load(sys.argv[1])
torch.save((cpu_isa(), [moe_experts_fp4(*args) for args in cases]), sys.argv[2])
"""


def _run_probe(tmp_path, name, **env_vars):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLAFX_DISABLE")} | env_vars
    args = [sys.executable, "-c", _PROBE, str(tmp_path / "in.pt"), str(tmp_path / f"{name}.pt")]
    result = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return torch.load(tmp_path / f"{name}.pt")


def test_every_isa_path_within_the_bound(tmp_path):
    """The best path this CPU has (AMX tiles from 9 rows where it has them), the AVX-512 one
    without tiles (MLAFX_DISABLE_AMX=1: widened weight tiles, the bf16 GEMM) and the portable
    one (MLAFX_DISABLE_AVX512=1) on the same cases: 1/8/12/33/70 rows on one expert (the few-rows
    kernel, the streaming pass on tiles, the per-expert path), every dtype, partial groups and
    chunks (K = 200 and 72), strided rows."""
    gen = torch.Generator().manual_seed(5)
    cases = []
    for t in (1, 8, 12, 33, 70):
        for dtype in FLOAT_DTYPES:
            x, ids, *rest = _case(t, 200, 72, 2, 1, dtype, gen, limit=0.5, strided=True)
            cases.append((x, torch.zeros_like(ids), *rest))
    torch.save(cases, tmp_path / "in.pt")
    for name, env, isa in (
        ("best", {}, cpu_isa()),
        ("no_amx", {"MLAFX_DISABLE_AMX": "1"}, cpu_isa().replace("avx512_amx", "avx512_bf16")),
        ("portable", {"MLAFX_DISABLE_AVX512": "1", "MLAFX_DISABLE_AVX2": "1"}, "portable"),
    ):
        child_isa, outs = _run_probe(tmp_path, name, **env)
        assert child_isa == isa
        for out, args in zip(outs, cases, strict=True):
            _assert_close(out, args)
