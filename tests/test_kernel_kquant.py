"""The K formats k8 / k4 (``kquant_format``: GGUF's Q4_K, Q5_K, Q6_K repacked without loss)
and the quantized ops over them.

Repacking is checked against ``gguf.quants.dequantize`` (llama.cpp's own decoding) bit for bit.
linear_quantized / moe_experts_quantized on a K-format weight are compared with the float64
product of the same quantized activations and dequantized weights (``quant_reference.py``)
within the fp32 rounding bound of ``test_kernel_quant``; the AVX2 and portable kernels' bit
identity is checked there too, in child processes (``test_best_path_is_bit_identical_...``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.quants import dequantize
from gguf_files import random_k_blocks
from hypothesis import given, settings
from hypothesis import strategies as st
from kquant_cases import Q, kquant_moe_case, kquant_weight
from test_kernel_quant import _assert_within_bound

from mlafx.kernels import linear_quantized, moe_experts_quantized
from mlafx.kernels.ggml_repack import repack_ggml_weight, stack_rows
from mlafx.kernels.kquant_format import dequantize_kquant, pack_kquant, unpack_kquant
from mlafx.kernels.quant_reference import moe_experts_quantized_f64

CASES = [(Q.Q4_K, "k4"), (Q.Q4_K, "k8"), (Q.Q5_K, "k8"), (Q.Q6_K, "k8")]


@pytest.mark.parametrize("qtype, fmt", CASES)
@pytest.mark.parametrize("n, k", [(1, 256), (37, 512), (16, 1024)])
def test_repack_is_exact_against_gguf(qtype, fmt, n, k):
    rng = np.random.default_rng(n + k)
    blocks = random_k_blocks((n, k), qtype, rng)
    packed = repack_ggml_weight(qtype.name, torch.from_numpy(blocks), n, k, fmt)
    assert packed.shape == (-(-n // 16), k // 256, 2496 if fmt == "k4" else 4544)
    want = torch.from_numpy(dequantize(blocks, qtype).reshape(n, k).astype(np.float32))
    assert torch.equal(dequantize_kquant(packed, n), want)
    assert torch.equal(pack_kquant(unpack_kquant(packed), 4 if fmt == "k4" else 8), packed)


def test_stacking_rows_of_two_types_is_lossless():
    gen = torch.Generator().manual_seed(0)
    gate = kquant_weight(Q.Q4_K, 21, 256, gen, "k8")
    up = kquant_weight(Q.Q6_K, 21, 256, gen)
    stacked = stack_rows("k8", [(gate, 21), (up, 21)])
    want = torch.cat([dequantize_kquant(gate, 21), dequantize_kquant(up, 21)])
    assert torch.equal(dequantize_kquant(stacked, 42), want)
    with pytest.raises(ValueError, match="does not fit k4"):
        stack_rows("k4", [(gate, 21), (up, 21)])


def test_types_outside_a_format_are_refused():
    blocks = torch.zeros(1, 210, dtype=torch.uint8)
    with pytest.raises(ValueError, match="Q6_K does not repack into k4"):
        repack_ggml_weight("Q6_K", blocks, 1, 256, "k4")
    with pytest.raises(ValueError, match="in_features % 256"):
        repack_ggml_weight("Q6_K", torch.zeros(1, 105, dtype=torch.uint8), 1, 128, "k8")


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M", [1, 3, 8, 70])
def test_linear_matches_reference(qtype, dtype, M):
    gen = torch.Generator().manual_seed(M)
    packed = kquant_weight(qtype, 40, 512, gen)
    x = torch.randn(M, 512, generator=gen).to(dtype)
    _assert_within_bound(linear_quantized(x, packed, 40), x, packed, 40)
    bias = torch.randn(40, generator=gen).to(dtype)
    _assert_within_bound(linear_quantized(x, packed, 40, bias), x, packed, 40, bias)


@settings(max_examples=30, deadline=None)
@given(
    qtype=st.sampled_from([Q.Q4_K, Q.Q5_K, Q.Q6_K]),
    M=st.sampled_from([1, 2, 3, 4, 5, 9, 33]),
    supers=st.integers(1, 3),
    N=st.sampled_from([1, 15, 16, 17, 40]),
    seed=st.integers(0, 2**16),
)
def test_linear_shapes_within_the_bound(qtype, M, supers, N, seed):
    """Every row-tile remainder, one to three super-blocks, N around the 16-row blocks."""
    gen = torch.Generator().manual_seed(seed)
    packed = kquant_weight(qtype, N, 256 * supers, gen)
    x = torch.randn(M, 256 * supers, generator=gen).to(torch.bfloat16)
    _assert_within_bound(linear_quantized(x, packed, N), x, packed, N)


@pytest.mark.parametrize("T", [3, 40])  # the streaming path and the per-expert GEMM path
def test_moe_with_k4_gate_up_and_k8_down(T):
    gen = torch.Generator().manual_seed(T)
    args = kquant_moe_case(T, 256, 256, 3, 2, gen)
    out = moe_experts_quantized(*args)
    reference = moe_experts_quantized_f64(*args)
    scale = max(reference.abs().max().item(), 1e-6)
    torch.testing.assert_close(out.double(), reference, atol=2e-2 * scale, rtol=2e-2)


def test_opcheck():
    gen = torch.Generator().manual_seed(1)
    packed = kquant_weight(Q.Q4_K, 20, 256, gen)
    x = torch.randn(3, 256, generator=gen).to(torch.bfloat16)
    torch.library.opcheck(torch.ops.mlafx.linear_quantized.default, (x, packed, 20, None))
    args = kquant_moe_case(4, 256, 256, 2, 2, gen)
    torch.library.opcheck(torch.ops.mlafx.moe_experts_quantized.default, args)


def test_in_features_not_whole_super_blocks_raise():
    gen = torch.Generator().manual_seed(2)
    packed = kquant_weight(Q.Q6_K, 20, 256, gen)
    with pytest.raises(ValueError, match="groups of 256 columns"):
        linear_quantized(torch.randn(2, 200), packed, 20)
    with pytest.raises(ValueError, match="blocks of 16 rows"):
        linear_quantized(torch.randn(2, 256), packed, 40)


def test_the_memory_estimate_knows_every_repacked_type():
    """config/ may not import kernels/: its bytes-per-weight table must equal the formats'."""
    from mlafx.config.gguf_config import REPACKED_BYTES_PER_WEIGHT
    from mlafx.kernels.ggml_repack import GGML_LOSSLESS_FORMATS, format_bytes_per_weight

    assert REPACKED_BYTES_PER_WEIGHT == {
        name: format_bytes_per_weight(formats[0]) for name, formats in GGML_LOSSLESS_FORMATS.items()
    }
