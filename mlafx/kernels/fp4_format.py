"""FP4 (e2m1) weights with ue8m0 scales, as DeepSeek-V4 publishes its routed experts: what the
bytes mean, for the loader, the modules and the tests to agree on.

A weight W [N, K] is stored as ``weight`` int8 [N, K/2]: two e2m1 nibbles per byte, element
``2j`` in the low nibble and ``2j+1`` in the high one; and ``scale`` [N, ceil(K/32)], one
power of two per 32 consecutive weights of a row, as ue8m0 (``float8_e8m0fnu``, or raw bytes:
``2^(byte - 127)``; 255 is NaN). The dequantized weight is

    w[n, k] = e2m1(W[n, k]) * scale[n, k // 32]

e2m1: sign, 2 exponent bits, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives,
every one exact in bfloat16 (so is every product with a power-of-two scale).
"""

from __future__ import annotations

import torch

GROUP = 32  # weights per scale along K
E2M1_MAX = 6.0
E2M1_VALUES = (
    0.0,
    0.5,
    1.0,
    1.5,
    2.0,
    3.0,
    4.0,
    6.0,
    -0.0,
    -0.5,
    -1.0,
    -1.5,
    -2.0,
    -3.0,
    -4.0,
    -6.0,
)


def ue8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """ue8m0 scales (``float8_e8m0fnu`` or uint8 bytes) -> float32 powers of two (exact)."""
    if scale.dtype == torch.float8_e8m0fnu:
        return scale.float()
    if scale.dtype != torch.uint8:
        raise TypeError(f"ue8m0 scales are float8_e8m0fnu or uint8 bytes, not {scale.dtype}")
    exponent = scale.to(torch.float32) - 127.0
    return torch.where(scale == 255, torch.nan, torch.exp2(exponent))


def float_to_ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """float32 powers of two -> float8_e8m0fnu (``ValueError`` for any other value)."""
    exponent = torch.log2(scale)
    if not torch.equal(exponent, exponent.round()) or bool((exponent.abs() > 127).any()):
        raise ValueError("ue8m0 holds powers of two from 2^-127 to 2^127 only")
    return scale.to(torch.float8_e8m0fnu)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] int8/uint8 -> [..., K] float32 e2m1 values (low nibble first)."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    u8 = packed.view(torch.uint8).to(torch.int64)
    return torch.stack([table[u8 & 0xF], table[u8 >> 4]], dim=-1).flatten(-2)


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``packed`` [..., N, K/2] with ``scale`` [..., N, ceil(K/32)] (ue8m0 or float32) ->
    float32 [..., N, K]."""
    values = unpack_e2m1(packed)
    s = scale if scale.dtype == torch.float32 else ue8m0_to_float(scale)
    k = values.shape[-1]
    return values * s.repeat_interleave(GROUP, dim=-1)[..., :k]


def quantize_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., N, K] (K even) -> (int8 [..., N, K/2], float8_e8m0fnu [..., N, ceil(K/32)]):
    per group the smallest power of two ``s`` with ``amax / s <= 6``, each weight rounded to
    the nearest e2m1 value of ``w / s`` (ties to the even mantissa). For tests and tools: the
    published checkpoints come quantized."""
    k = weight.shape[-1]
    if k % 2:
        raise ValueError(f"FP4 packs two weights per byte: K={k} must be even")
    groups = -(-k // GROUP)
    w = weight.float()
    padded = torch.nn.functional.pad(w, (0, groups * GROUP - k))
    amax = padded.unflatten(-1, (groups, GROUP)).abs().amax(-1)
    scale = torch.exp2(torch.ceil(torch.log2(torch.where(amax > 0, amax / E2M1_MAX, 1.0))))
    scaled = w / scale.repeat_interleave(GROUP, dim=-1)[..., :k]
    grid = torch.tensor(E2M1_VALUES[:8], dtype=torch.float32)
    # the nearest magnitude; half-way between two, the one with the even mantissa (the even
    # index of the grid): argmin keeps the lower of a tie, so an odd lower one moves up
    distance = (scaled.abs().unsqueeze(-1) - grid).abs()
    index = distance.argmin(-1)
    best = distance.gather(-1, index.unsqueeze(-1)).squeeze(-1)
    upper = (index + 1).clamp(max=7)
    tie = (distance.gather(-1, upper.unsqueeze(-1)).squeeze(-1) == best) & (upper != index)
    index = torch.where(tie & (index % 2 == 1), upper, index)
    nibble = index + 8 * (scaled < 0).to(torch.int64)
    pairs = nibble.unflatten(-1, (k // 2, 2))
    packed = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8).view(torch.int8)
    return packed, float_to_ue8m0(scale)
