"""Derived constants (passes/derived_constants.py): what each name derives, and refusals."""

from __future__ import annotations

import pytest
import torch

from mlafx.kernels import pack_linear_weight, unpack_linear_weight
from mlafx.passes.derived_constants import (
    absorbed_names,
    derive,
    packed_name,
    source_of,
    with_derived_constants,
)


def test_absorbed_weights_are_the_per_head_slices():
    heads, nope, v, lkv = 3, 5, 4, 7
    weight = torch.randn(heads * (nope + v), lkv)
    uk_name, uvt_name = absorbed_names("layers.0.kv_b_proj.weight", heads, nope)
    assert source_of(uk_name) == source_of(uvt_name) == "layers.0.kv_b_proj.weight"
    per_head = weight.view(heads, nope + v, lkv)
    uk, uvt = derive(uk_name, weight), derive(uvt_name, weight)
    assert uk.is_contiguous() and uvt.is_contiguous()
    assert torch.equal(uk, per_head[:, :nope])
    assert torch.equal(uvt, per_head[:, nope:].transpose(1, 2))
    assert uvt.shape == (heads, lkv, v)


def test_packed_is_pack_linear_weight():
    weight = torch.randn(20, 6).bfloat16()
    name = packed_name("lm_head.weight")
    assert source_of(name) == "lm_head.weight"
    assert torch.equal(derive(name, weight).view(torch.uint8),
                       pack_linear_weight(weight).view(torch.uint8))  # fmt: skip
    # the packed copy is the only copy a compiled step keeps: it must hold all of the weight
    assert torch.equal(unpack_linear_weight(derive(name, weight), 20, 6), weight)


def test_with_derived_constants_adds_only_what_is_wanted_and_missing():
    weight = torch.randn(2 * 9, 7)
    uk_name, uvt_name = absorbed_names("kv.weight", 2, 5)
    given = {"kv.weight": weight, uk_name: torch.zeros(1)}
    out = with_derived_constants(given, [uk_name, uvt_name, "other_packed"])
    assert out[uk_name] is given[uk_name]  # already there: kept as given
    assert out[uvt_name].shape == (2, 7, 4)
    assert "other_packed" not in out  # its source is unknown


@pytest.mark.parametrize("name", ["kv.weight", "kv.weight_uk_h2", "kv.weight_uvt_hx_p1"])
def test_non_derived_names(name):
    assert source_of(name) is None
    with pytest.raises(ValueError, match="not the name of a derived constant"):
        derive(name, torch.zeros(4, 4))


def test_absorbed_name_that_does_not_fit_the_weight():
    with pytest.raises(ValueError, match="does not fit"):
        derive(absorbed_names("kv.weight", 4, 8)[0], torch.zeros(18, 3))
