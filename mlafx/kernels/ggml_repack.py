"""Which GGUF (llama.cpp) block types run from their own bytes, and in which mlafx format: the
one table the GGUF loader and its memory estimate read.

    Q8_0 -> int8          Q4_0 -> int4 (or int8)     Q5_0 -> int8       (quant_format)
    Q4_K -> k4 (or k8)    Q5_K -> k8                 Q6_K -> k8         (kquant_format)

Each repack is lossless: the same quants and scales, re-laid out (Q4_0 / Q5_0 / Q4_K values are
also int8 / k8 values). The first format of each type is the smallest; a second one is taken
where two tensors must share a format (gate and up rows stacked into one expert weight).
"""

from __future__ import annotations

import torch

from mlafx.kernels.kquant_format import (
    KQUANT_BITS,
    kquant_group_bytes,
    kquant_shape,
    repack_ggml_kquant,
    stack_kquant_rows,
)
from mlafx.kernels.quant_format import (
    BITS,
    group_bytes,
    packed_shape,
    repack_ggml_q4_0,
    repack_ggml_q5_0,
    repack_ggml_q8_0,
    stack_packed_rows,
)

# GGUF type -> the mlafx formats it repacks into without loss, smallest first
GGML_LOSSLESS_FORMATS: dict[str, tuple[str, ...]] = {
    "Q8_0": ("int8",),
    "Q4_0": ("int4", "int8"),
    "Q5_0": ("int8",),
    "Q4_K": ("k4", "k8"),
    "Q5_K": ("k8",),
    "Q6_K": ("k8",),
}


def _bits(fmt: str) -> int:
    return KQUANT_BITS[fmt] if fmt in KQUANT_BITS else BITS[fmt]


def format_bytes_per_weight(fmt: str) -> float:
    """Packed bytes per weight of a format (rows in whole blocks of 16)."""
    if fmt in KQUANT_BITS:
        return kquant_group_bytes(KQUANT_BITS[fmt]) / (16 * 256)
    return group_bytes(BITS[fmt]) / (16 * 32)


def common_format(type_names: list[str]) -> str | None:
    """The smallest format every one of these GGUF types repacks into (None: there is none)."""
    options = [GGML_LOSSLESS_FORMATS.get(name, ()) for name in type_names]
    for fmt in options[0]:
        if all(fmt in option for option in options[1:]):
            return fmt
    return None


def packed_weight_shape(fmt: str, out_features: int, in_features: int) -> tuple[int, int, int]:
    if fmt in KQUANT_BITS:
        return kquant_shape(out_features, in_features, KQUANT_BITS[fmt])
    return packed_shape(out_features, in_features, BITS[fmt])


def repack_ggml_weight(
    type_name: str, data: torch.Tensor, out_features: int, in_features: int, fmt: str
) -> torch.Tensor:
    """A GGUF weight [N, K] (its raw uint8 rows) -> packed in ``fmt``, lossless; ValueError if
    the type does not fit the format."""
    if fmt not in GGML_LOSSLESS_FORMATS.get(type_name, ()):
        raise ValueError(f"GGUF {type_name} does not repack into {fmt} without loss")
    if fmt in KQUANT_BITS:
        return repack_ggml_kquant(type_name, data, out_features, in_features, _bits(fmt))
    if type_name == "Q8_0":
        return repack_ggml_q8_0(data, out_features, in_features)
    if type_name == "Q5_0":
        return repack_ggml_q5_0(data, out_features, in_features)
    return repack_ggml_q4_0(data, out_features, in_features, _bits(fmt))


def stack_rows(fmt: str, parts: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """Packed weights ``(packed, rows)`` in ``fmt`` -> their rows stacked in one weight."""
    if fmt in KQUANT_BITS:
        return stack_kquant_rows(parts, KQUANT_BITS[fmt])
    return stack_packed_rows(parts)
