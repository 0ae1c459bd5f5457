"""mlafx::moe_experts against the float64 reference (and the model's eager MoE block).

Tolerances, relative to the largest |reference| output of a case (the scale every output
error is measured against) plus a relative part: bf16 2e-2, fp16 3e-3, fp32 2e-5. The kernel
sums in fp32 and keeps h = silu(g) * u at fp32 accuracy, so it is within one rounding of the
fp64 value (held to 1.5x of that by tests/test_kernel_bf16_accuracy.py); the eager model
reference rounds g, u and h, which the bounds cover with margin, and a dropped or doubled
(token, choice) term is off by ~50% of the scale.
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

from mlafx.kernels import cpu_isa, moe_experts
from mlafx.kernels.moe_reference import moe_experts_ref
from mlafx.models.moe import routed_experts_reference

FLOAT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 2e-5}
# Pairs per expert streamed (more go to the blocked or the ATen fp32 GEMM path): 8 for the
# scalar kernel, 16 on the AMX tile unit (bf16, D and I multiples of 32), 32 for bf16 with
# VDPBF16PS.
MAX_STREAMING_PAIRS = 8
MAX_STREAMING_PAIRS_TILES = 16
MAX_STREAMING_PAIRS_DPBF16 = 32


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert actual.is_contiguous()
    if expected.numel() == 0:
        return
    tol = TOLERANCE[dtype]
    scale = max(expected.double().abs().max().item(), 1e-6)
    torch.testing.assert_close(
        actual.double(), expected.double(), atol=tol * scale, rtol=tol, equal_nan=True
    )


def _case(T, D, inter, E, k, dtype, gen, *, repeat=False, layout="contiguous"):
    """Random inputs; weights scaled so that activations stay O(1) for every dtype."""
    x = torch.randn(T, D, generator=gen).to(dtype)
    if layout == "strided":  # rows of a wider buffer, as views of a fused projection are
        wide = torch.zeros(T, D + 5, dtype=dtype)
        wide[:, 3 : 3 + D] = x
        x = wide[:, 3 : 3 + D]
    ids = torch.randint(0, E, (T, k), generator=gen)
    if repeat and k > 1:
        ids[:, 1] = ids[:, 0]  # the same expert twice for one token
    weights = torch.rand(T, k, generator=gen)
    w13 = (torch.randn(E, 2 * inter, D, generator=gen) / D**0.5).to(dtype)
    w2 = (torch.randn(E, D, inter, generator=gen) / inter**0.5).to(dtype)
    if layout == "strided":  # every other expert of a larger stack: a strided expert dim
        w13 = torch.stack([w13, torch.full_like(w13, float("nan"))], 1).flatten(0, 1)[::2]
        w2 = torch.stack([w2, torch.full_like(w2, float("nan"))], 1).flatten(0, 1)[::2]
    return x, ids, weights, w13, w2


@settings(max_examples=60, deadline=None)
@given(
    T=st.sampled_from([0, 1, 3, 8, 40]),
    # Widths that are multiples of 32 run bf16 on the tile unit where there is one.
    D=st.sampled_from([16, 64, 64 + 13, 128]),
    inter=st.sampled_from([8, 21, 32, 48]),
    E=st.sampled_from([1, 3, 8]),
    k=st.sampled_from([1, 2, 3]),
    dtype=st.sampled_from(FLOAT_DTYPES),
    repeat=st.booleans(),
    layout=st.sampled_from(["contiguous", "strided"]),
    limit=st.sampled_from([None, 0.5, 7.0]),  # DeepSeek-V4's SwiGLU clamp, tight or loose
    seed=st.integers(0, 2**31 - 1),
)
def test_matches_reference(T, D, inter, E, k, dtype, repeat, layout, limit, seed):
    gen = torch.Generator().manual_seed(seed)
    args = _case(T, D, inter, E, k, dtype, gen, repeat=repeat, layout=layout)
    _assert_close(moe_experts(*args, limit), moe_experts_ref(*args, limit), dtype)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize(
    "counts",
    [
        [1, 0, 0, 3],  # decode: experts no token picked are skipped
        [5, 6, 7, 8],  # tiles of 5..8 rows of x
        [MAX_STREAMING_PAIRS, MAX_STREAMING_PAIRS + 1, 0],  # both paths at the boundary
        [MAX_STREAMING_PAIRS_TILES, MAX_STREAMING_PAIRS_TILES + 1, 0],  # the tiles' boundary
        [MAX_STREAMING_PAIRS_DPBF16, MAX_STREAMING_PAIRS_DPBF16 + 1, 3],  # VDPBF16PS's
        [70, 2],  # prefill-sized group next to a decode-sized one
    ],
)
@pytest.mark.parametrize(("D", "inter"), [(64 + 13, 40), (64, 96 + 8)])  # (64, 104): tiles
def test_streaming_and_gemm_paths(dtype, counts, D, inter):
    gen = torch.Generator().manual_seed(sum(counts))
    ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])
    ids = ids[torch.randperm(len(ids), generator=gen)].view(-1, 1)
    x, _, weights, w13, w2 = _case(len(ids), D, inter, len(counts), 1, dtype, gen)
    _assert_close(
        moe_experts(x, ids, weights, w13, w2), moe_experts_ref(x, ids, weights, w13, w2), dtype
    )


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("counts", [[1, 0, 3], [MAX_STREAMING_PAIRS_DPBF16 + 9, 2]])
@pytest.mark.parametrize(("D", "inter"), [(64 + 13, 40), (64, 96)])  # (64, 96): tiles
def test_swiglu_limit_clamps_gate_and_up_on_every_path(dtype, counts, D, inter):
    """DeepSeek-V4's clamped SwiGLU, on the streaming and the GEMM paths; the limit sits
    inside the range of g and u, so that it changes the result."""
    gen = torch.Generator().manual_seed(D + sum(counts))
    ids = torch.cat([torch.full((c,), e) for e, c in enumerate(counts)])
    ids = ids[torch.randperm(len(ids), generator=gen)].view(-1, 1)
    x, _, weights, w13, w2 = _case(len(ids), D, inter, len(counts), 1, dtype, gen)
    x = x * 4  # g and u of a few units
    ref = moe_experts_ref(x, ids, weights, w13, w2, 0.5)
    _assert_close(moe_experts(x, ids, weights, w13, w2, swiglu_limit=0.5), ref, dtype)
    plain = moe_experts_ref(x, ids, weights, w13, w2).double()
    assert (plain - ref.double()).abs().max() > 0.1 * ref.double().abs().max()


@pytest.mark.parametrize("limit", [0.0, -1.0])
def test_swiglu_limit_must_be_positive(limit):
    args = _case(2, 16, 8, 2, 1, torch.float32, torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="swiglu_limit must be positive"):
        moe_experts(*args, swiglu_limit=limit)


@pytest.mark.parametrize("T", [1, 8, 64])
@pytest.mark.parametrize("inter", [176, 192])  # 192: a multiple of 32 (the tile unit)
def test_matches_model_reference_bf16(T, inter):
    # The model's eager MoE block (what the compiler replaces) at the embedded default's
    # widths, scaled down in I; both round in bf16, so the tolerance is bf16's.
    gen = torch.Generator().manual_seed(T)
    args = _case(T, 2048, inter, 4, 2, torch.bfloat16, gen)
    _assert_close(moe_experts(*args), routed_experts_reference(*args), torch.bfloat16)


def test_k_zero_gives_zeros():
    gen = torch.Generator().manual_seed(0)
    x, _, _, w13, w2 = _case(3, 16, 8, 2, 1, torch.float32, gen)
    out = moe_experts(x, torch.zeros(3, 0, dtype=torch.int64), torch.zeros(3, 0), w13, w2)
    assert torch.equal(out, torch.zeros(3, 16))


def test_nan_propagates():
    gen = torch.Generator().manual_seed(0)
    x, ids, weights, w13, w2 = _case(4, 32, 8, 2, 2, torch.bfloat16, gen)
    x[2, 5] = float("nan")
    out = moe_experts(x, ids, weights, w13, w2)
    assert torch.isnan(out[2]).all() and not torch.isnan(out[[0, 1, 3]]).any()


@pytest.mark.parametrize(
    ("T", "dtype"), [(5, torch.bfloat16), (40, torch.float32), (0, torch.float16)]
)
def test_opcheck(T, dtype):
    gen = torch.Generator().manual_seed(T)
    args = _case(T, 40, 24, 3, 2, dtype, gen, repeat=True)
    torch.library.opcheck(torch.ops.mlafx.moe_experts.default, args)
    torch.library.opcheck(torch.ops.mlafx.moe_experts.default, (*args, 0.25))


class _Experts(torch.nn.Module):
    def __init__(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        super().__init__()
        self.w13 = torch.nn.Parameter(w13, requires_grad=False)
        self.w2 = torch.nn.Parameter(w2, requires_grad=False)

    def forward(self, x, topk_ids, topk_weights):
        return moe_experts(x * 2, topk_ids, topk_weights, self.w13, self.w2)


def test_torch_compile_fullgraph():
    gen = torch.Generator().manual_seed(1)
    x, ids, weights, w13, w2 = _case(6, 48, 16, 4, 2, torch.float32, gen)
    module = _Experts(w13, w2)
    compiled = torch.compile(module, fullgraph=True, backend="inductor")
    _assert_close(
        compiled(x, ids, weights), moe_experts_ref(x * 2, ids, weights, w13, w2), torch.float32
    )


def test_torch_export_dynamic_tokens():
    gen = torch.Generator().manual_seed(2)
    x, ids, weights, w13, w2 = _case(6, 48, 16, 4, 2, torch.bfloat16, gen)
    tokens = torch.export.Dim("tokens")
    program = torch.export.export(
        _Experts(w13, w2),
        (x, ids, weights),
        dynamic_shapes=({0: tokens}, {0: tokens}, {0: tokens}),
    )
    assert "torch.ops.mlafx.moe_experts.default" in str(program.graph_module.code)
    x, ids, weights, _, _ = _case(11, 48, 16, 4, 2, torch.bfloat16, gen)
    _assert_close(
        program.module()(x, ids, weights),
        moe_experts_ref(x * 2, ids, weights, w13, w2),
        torch.bfloat16,
    )


# ---- errors ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad_id", [4, 100, -1])
def test_out_of_range_expert_raises(bad_id):
    gen = torch.Generator().manual_seed(0)
    x, ids, weights, w13, w2 = _case(3, 16, 8, 4, 2, torch.float32, gen)
    ids[1, 1] = bad_id
    with pytest.raises(IndexError, match=rf"topk_ids\[1, 1\] = {bad_id} is out of range for 4"):
        moe_experts(x, ids, weights, w13, w2)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ("ids_int32", TypeError, "topk_ids must be int64"),
        ("weights_bf16", TypeError, "topk_weights must be float32"),
        ("x_float64", TypeError, "x must be bfloat16, float16 or float32"),
        ("w13_other_dtype", TypeError, "w13 and w2 must have x's dtype"),
        ("x_3d", ValueError, r"x must be \[num_tokens, hidden\]"),
        ("ids_token_count", ValueError, "topk_ids must be"),
        ("weights_shape", ValueError, "topk_weights must have topk_ids's shape"),
        ("w13_odd_rows", ValueError, "w13 must be"),
        ("w2_wrong_inter", ValueError, "w2 must be"),
        ("x_last_dim_strided", ValueError, "x's last dim must be contiguous"),
    ],
)
def test_invalid_inputs_raise(change, error, match):
    gen = torch.Generator().manual_seed(0)
    x, ids, weights, w13, w2 = _case(3, 16, 8, 4, 2, torch.float32, gen)
    if change == "ids_int32":
        ids = ids.int()
    elif change == "weights_bf16":
        weights = weights.bfloat16()
    elif change == "x_float64":
        x, w13, w2 = x.double(), w13.double(), w2.double()
    elif change == "w13_other_dtype":
        w13 = w13.bfloat16()
    elif change == "x_3d":
        x = x[None]
    elif change == "ids_token_count":
        ids = ids[:2]
    elif change == "weights_shape":
        weights = weights[:, :1]
    elif change == "w13_odd_rows":
        w13 = w13[:, :15]
    elif change == "w2_wrong_inter":
        w2 = w2[:, :, :7]
    elif change == "x_last_dim_strided":
        x = torch.randn(3, 32)[:, ::2]
    with pytest.raises(error, match=match):
        moe_experts(x, ids, weights, w13, w2)


# ---- the portable path --------------------------------------------------------------------

_PATH_PROBE = """
import sys
import torch
from mlafx.kernels import cpu_isa, moe_experts
from mlafx.kernels.moe_reference import moe_experts_ref

assert cpu_isa() == sys.argv[1], cpu_isa()
gen = torch.Generator().manual_seed(0)
for dtype, tol in ((torch.bfloat16, 2e-2), (torch.float16, 3e-3), (torch.float32, 2e-5)):
    for T, k, D, inter in ((3, 2, 64 + 13, 21), (40, 1, 64 + 13, 21), (12, 2, 64, 32)):
        # decode-sized groups, then GEMM-sized ones, then widths the tile unit takes
        x = torch.randn(T, D, generator=gen).to(dtype)
        ids = torch.randint(0, 3, (T, k), generator=gen)
        weights = torch.rand(T, k, generator=gen)
        w13 = (torch.randn(3, 2 * inter, D, generator=gen) / 9).to(dtype)
        w2 = (torch.randn(3, D, inter, generator=gen) / 5).to(dtype)
        for limit in (None, 0.3):  # the plain SwiGLU and DeepSeek-V4's clamped one
            out = moe_experts(x, ids, weights, w13, w2, limit).double()
            ref = moe_experts_ref(x, ids, weights, w13, w2, limit).double()
            scale = ref.abs().max().item()
            torch.testing.assert_close(out, ref, atol=tol * scale, rtol=tol)
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
def test_other_paths_match_reference(isa, env_overrides):
    if isa == "avx512_bf16" and cpu_isa() != "avx512_amx":
        pytest.skip("this run already uses that path (or the CPU lacks it)")
    if isa == "avx2" and not (cpu_isa().startswith("avx512") and has_avx2()):
        pytest.skip("this run already uses that path (or the CPU lacks it)")
    env = {**os.environ, **env_overrides}
    result = subprocess.run(
        [sys.executable, "-c", _PATH_PROBE, isa],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
