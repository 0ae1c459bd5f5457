"""V4's stored-weight modules on mlafx's ops against their own semantics (the dequantized
weights in float32, ``reference``): FP8 and FP4 expert stacks with the clamped SwiGLU, the
grouped FP8 ``o_a_proj`` with group edges on and inside scale blocks, the FP8 linear."""

from __future__ import annotations

import pytest
import torch

from mlafx.kernels.fp4_format import quantize_fp4
from mlafx.kernels.fp8_format import quantize_fp8
from mlafx.models.deepseek_v4.quantized import Fp8GroupedLinear, Fp8KernelLinear, StoredExperts
from mlafx.models.fp8 import Fp8Linear

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    tol = TOLERANCE[got.dtype]
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), atol=tol * scale, rtol=tol)


def _fp8_stack(e: int, n: int, k: int, block: tuple[int, int], gen) -> tuple:
    qs = [quantize_fp8(torch.randn(n, k, generator=gen) * k**-0.5, block) for _ in range(e)]
    return torch.stack([q for q, _ in qs]), torch.stack([s for _, s in qs])


@pytest.mark.parametrize("fmt", ["fp4", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_stored_experts_match_their_reference(fmt, dtype, tokens):
    gen = torch.Generator().manual_seed(tokens)
    e, d, inter, block = 4, 64, 96, (32, 32)
    if fmt == "fp4":
        gate_up = quantize_fp4(torch.randn(e, 2 * inter, d, generator=gen) * d**-0.5)
        down = quantize_fp4(torch.randn(e, d, inter, generator=gen) * inter**-0.5)
        experts = StoredExperts("fp4", gate_up, down, limit=0.3)
    else:  # the gate's blocks, then the up's, stacked apart
        (g, gs), (u, us) = (_fp8_stack(e, inter, d, block, gen) for _ in range(2))
        down = _fp8_stack(e, d, inter, block, gen)
        experts = StoredExperts(
            "fp8", (torch.cat([g, u], 1), torch.cat([gs, us], 1)), down, 0.3, block
        )
    x = torch.randn(tokens, d, generator=gen).to(dtype)
    ids = torch.randint(0, e, (tokens, 2), generator=gen)
    weights = torch.rand(tokens, 2, generator=gen)
    _close(experts(x, ids, weights), experts.reference(x, ids, weights))


@pytest.mark.parametrize("out_per_group", [32, 24], ids=["whole-blocks", "edges-inside"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_fp8_linear_matches_its_reference(out_per_group, dtype):
    gen = torch.Generator().manual_seed(out_per_group)
    groups, inp, block = 3, 64, (16, 32)
    weight, scale = quantize_fp8(torch.randn(groups * out_per_group, inp, generator=gen), block)
    module = Fp8GroupedLinear(weight, scale, block, groups)
    x = torch.randn(7, groups, inp, generator=gen).to(dtype)
    _close(module(x), module.reference(x))


def test_fp8_kernel_linear_matches_the_reference_linear():
    gen = torch.Generator().manual_seed(0)
    weight, scale = quantize_fp8(torch.randn(48, 64, generator=gen), (16, 32))
    x = torch.randn(2, 5, 64, generator=gen)
    _close(Fp8KernelLinear(weight, scale, (16, 32))(x), Fp8Linear(weight, scale, (16, 32))(x))
