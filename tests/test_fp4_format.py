"""``kernels/fp4_format.py``: e2m1 + ue8m0 bytes against transformers' dequantizer and the
format's own definition."""

from __future__ import annotations

import pytest
import torch

from mlafx.kernels.fp4_format import (
    E2M1_VALUES,
    dequantize_fp4,
    float_to_ue8m0,
    quantize_fp4,
    ue8m0_to_float,
)


def test_random_bytes_dequantize_as_transformers_does():
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    gen = torch.Generator().manual_seed(0)
    packed = torch.randint(-128, 128, (3, 24, 32), dtype=torch.int8, generator=gen)
    scale = torch.randint(100, 140, (3, 24, 2), dtype=torch.uint8, generator=gen)
    want = Fp8Dequantize(None)._dequantize_one(packed, scale, torch.float32)
    assert torch.equal(dequantize_fp4(packed, scale), want)
    assert torch.equal(dequantize_fp4(packed, scale.view(torch.float8_e8m0fnu)), want)


def test_every_e2m1_value_round_trips_exactly():
    values = torch.tensor(E2M1_VALUES).repeat(4).view(2, 32) * 0.25
    packed, scale = quantize_fp4(values)
    assert torch.equal(dequantize_fp4(packed, scale), values)
    assert scale.float().tolist() == [[0.25], [0.25]]


def test_half_way_values_round_to_the_even_mantissa():
    row = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, 6.0, 0.0]])
    got = dequantize_fp4(*quantize_fp4(row))
    assert got.tolist() == [[0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, 6.0, 0.0]]


def test_quantization_error_is_within_half_a_step():
    w = torch.randn(4, 96, generator=torch.Generator().manual_seed(1))
    packed, scale = quantize_fp4(w)
    # the largest step of e2m1 is 2 (between 4 and 6), times the group's scale
    step = 2 * scale.float().repeat_interleave(32, dim=-1)
    assert bool(((dequantize_fp4(packed, scale) - w).abs() <= step / 2).all())


def test_ue8m0_bytes():
    raw = torch.tensor([0, 126, 127, 128, 254, 255], dtype=torch.uint8)
    got = ue8m0_to_float(raw)
    assert got[:5].tolist() == [2.0**-127, 0.5, 1.0, 2.0, 2.0**127]
    assert torch.isnan(got[5])
    assert float_to_ue8m0(torch.tensor([0.5, 4.0])).view(torch.uint8).tolist() == [126, 129]
    with pytest.raises(ValueError, match="powers of two"):
        float_to_ue8m0(torch.tensor([3.0]))
    with pytest.raises(TypeError):
        ue8m0_to_float(torch.tensor([1.0]))
