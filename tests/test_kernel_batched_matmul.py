"""mlafx::batched_matmul against float64 bmm: the few-row streaming kernel that decode's
absorbed products take on AVX-512 BF16 CPUs (batched_matmul_avx512.cpp, up to 4 rows per head
of bf16 / fp16), the tile kernel on AMX CPUs (batched_matmul_amx_avx512.cpp, bf16 at 5-16
rows), the pairs kernel on AVX-512 BF16 CPUs without AMX (batched_matmul_pairs_avx512.cpp, bf16
at 5-8 rows), the AVX2 streaming kernel on CPUs without AVX-512 BF16 (batched_matmul_avx2.cpp,
bf16 / fp16 up to 8 rows) and ATen's bmm above them, on the default path here and, each in a
child process, the portable one, AVX-512 without AMX and the AVX2 tier alone.

Bound: the fp32 sums err by at most ``sum |x| |w| * K * 2^-24`` (far below a wrong element,
which is off by whole percents) and the one rounding to x's dtype by half an ulp (2^-8 bf16,
2^-11 fp16, relative, or half the smallest subnormal)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cpu_flags import has_avx2
from hypothesis import given, settings
from hypothesis import strategies as st

from mlafx.kernels import batched_matmul, cpu_isa

ROOT = Path(__file__).resolve().parents[1]
ROUNDING = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def _assert_within_bound(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    assert out.dtype == x.dtype and out.shape == (x.shape[0], x.shape[1], w.shape[2])
    ref = x.double() @ w.double()
    magnitude = x.double().abs() @ w.double().abs()
    finfo = torch.finfo(x.dtype)
    bound = (
        magnitude * x.shape[2] * 2.0**-24
        + ref.abs() * ROUNDING[x.dtype]
        + finfo.smallest_normal * finfo.eps / 2
    )
    err = (out.double() - ref).abs()
    assert torch.all(err <= bound), f"worst {(err / bound).max().item():.3f} of the bound"


@settings(max_examples=60, deadline=None)
@given(
    heads=st.integers(1, 5),
    m=st.integers(0, 18),
    k=st.sampled_from([1, 7, 16, 33, 64, 128, 130]),
    n=st.sampled_from([1, 15, 16, 17, 64, 65, 100, 200]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    strided=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_fp64_bmm(heads, m, k, n, dtype, strided, seed):
    gen = torch.Generator().manual_seed(seed)
    if strided:  # the graph's q_nope: [tokens, heads, K] viewed as [heads, tokens, K]
        x = torch.randn(m, heads, k, generator=gen).to(dtype).transpose(0, 1)
    else:
        x = torch.randn(heads, m, k, generator=gen).to(dtype)
    w = (torch.randn(heads, k, n, generator=gen) / k**0.5).to(dtype)
    _assert_within_bound(batched_matmul(x, w), x, w)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_shapes_and_row_independence(dtype):
    """V2-Lite's W_UK and W_UV^T products at 1-4 rows (streaming), 5-16 (tiles on AMX; 5-8 the
    pairs kernel without; 1-8 AVX2's streaming kernel) and 17 (ATen). Where one of our kernels
    runs, a row's result does not depend on the call's other rows, bitwise: each row alone
    (streaming), or the first 5 rows of the call (tiles, pairs) (ATen's bmm promises no such
    thing)."""
    streams = cpu_isa() in ("avx512_amx", "avx512_bf16")
    streams_avx2 = cpu_isa() == "avx2"
    tiles = cpu_isa() == "avx512_amx" and dtype == torch.bfloat16
    pairs = cpu_isa() == "avx512_bf16" and dtype == torch.bfloat16
    gen = torch.Generator().manual_seed(1)
    for k, n in ((128, 512), (512, 128)):
        w = (torch.randn(16, k, n, generator=gen) / k**0.5).to(dtype)
        for m in (1, 2, 3, 4, 5, 6, 7, 8, 16, 17):
            x = torch.randn(m, 16, k, generator=gen).to(dtype).transpose(0, 1)
            out = batched_matmul(x, w)
            _assert_within_bound(out, x, w)
            if (streams and m <= 4) or (streams_avx2 and m <= 8):
                for r in range(m):
                    assert torch.equal(out[:, r : r + 1], batched_matmul(x[:, r : r + 1], w))
            if (tiles and 5 < m <= 16) or (pairs and 5 < m <= 8):  # pass<6..8>
                assert torch.equal(out[:, :5], batched_matmul(x[:, :5], w))


@pytest.mark.parametrize(
    "disable", ["MLAFX_DISABLE_AVX512", "MLAFX_DISABLE_AMX", "MLAFX_AVX2_ONLY"]
)
def test_other_paths_in_a_child(disable):
    """The portable path, AVX-512 without tiles (the streaming and pairs kernels, ATen) and
    the AVX2 tier alone (its streaming kernel, ATen on fp32 copies)."""
    if os.environ.get("MLAFX_BMM_CHILD"):
        pytest.skip("inside the child run")
    if disable == "MLAFX_DISABLE_AMX" and cpu_isa() != "avx512_amx":
        pytest.skip("no AMX here: the default run is that path")
    if disable == "MLAFX_AVX2_ONLY" and not (cpu_isa().startswith("avx512") and has_avx2()):
        pytest.skip("the default run is that path (or the CPU has no AVX2)")
    env = {**os.environ, disable: "1", "MLAFX_BMM_CHILD": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
