"""mlafx's quantized weight formats, int8 and int4: what the bytes mean (one place for the
quantizer, the kernels, the loader and the GGUF repacking to agree on).

A weight W [N, K] is cut into groups of ``GROUP = 32`` consecutive columns of one row, each
group with one float16 scale ``d`` (llama.cpp's Q8_0 and Q4_0 blocks: the same 32 weights and
scale, so a GGUF tensor in either type repacks into this layout without loss):

    int8  q in [-128, 127]   w = d * q          (Q8_0)       8.5 bits per weight
    int4  q in [0, 15]       w = d * (q - 8)    (Q4_0)       4.5 bits per weight

Layout, ``packed`` uint8 [ceil(N/16), G = ceil(K/32), S]: block b holds rows 16b..16b+15 and,
for each group g, ``S = QUANT_BYTES[bits] + 32`` bytes: the quants, then the 16 rows' scales
(float16, little-endian, row 16b+i at bytes QUANT_BYTES + 2i). Quants are laid out for
``VPDPBUSD`` with lanes along the block's 16 rows (4 consecutive columns of one row per 32-bit
lane, so no horizontal sums): byte ``64*s + 4*i + j`` of the group is

    int8  q[16b+i, 32g+4s+j] + 128 (offset binary), s in 0..7
    int4  q[16b+i, 32g+4s+j] | q[16b+i, 32g+16+4s+j] << 4, s in 0..3
          (low nibbles hold the group's columns 0..15, high nibbles 16..31: Q4_0's order)

Rows past N have scale 0 and q = 0 (int8 byte 128, int4 byte 0x88), as do columns past K.

Activations (W8A8, as llama.cpp's ``ggml_vec_dot_q8_0_q8_0`` / ``q4_0_q8_0``): a linear over a
quantized weight quantizes each row of x per group of 32 columns, symmetrically to int8 with a
float32 scale, ``d_x = amax / 127``, ``q_x = clamp(round_half_even(x * (1 / d_x)), -127, 127)``
(0 where ``d_x`` is 0). The product is then exact integer dot products per group scaled by
``d_w * d_x``: ``y[m, n] = sum_g d_w[n, g] * d_x[m, g] * sum_k (q_w - z) * q_x`` (z = 0 for
int8, 8 for int4), summed in fp32 and rounded once to x's dtype. The op semantics *include*
this activation rounding, so every path (kernels, the model's eager reference) computes the
same thing; the integer dot runs 64 products per ``VPDPBUSD`` against 32 per ``VDPBF16PS``.

Weight quantizers (``quantize_weight``, also in C++ as ``mlafx::quantize_linear_weight``):
- int8: ``d = fp16(amax / 127)``, ``q = clamp(round(w / d), -127, 127)``: Q8_0's scale; each
  q is the nearest for that stored scale (Q8_0 rounds ``w * (1/d)`` with the unrounded d), so
  every weight's error is at most Q8_0's.
- int4: the scale is searched per group: candidates ``d = fp16(m / c)`` with m the group's
  value of largest magnitude and c in ``INT4_DIVISORS`` (c = -8 is Q4_0's own choice), each q
  the nearest for its d; the candidate with the least squared error wins (ties: the first).
  So every group's squared error is at most Q4_0's.
"""

from __future__ import annotations

import torch

GROUP = 32  # columns per scale
BLOCK_ROWS = 16  # rows per block (the 16 lanes of a 512-bit register of int32)
QUANT_BYTES = {8: GROUP * BLOCK_ROWS, 4: GROUP * BLOCK_ROWS // 2}  # per block and group
SCALE_BYTES = 2 * BLOCK_ROWS
BITS = {"int8": 8, "int4": 4}
# int4 scale candidates: d = m / c for the group's largest-magnitude value m (Q4_0: c = -8).
INT4_DIVISORS = (-8.0, -7.75, -7.5, -7.25, -7.0, -6.75, -6.5, 7.0, 6.75, 6.5, 6.25)


def group_bytes(bits: int) -> int:
    """Bytes per block and group: S, the last dim of a packed weight."""
    return QUANT_BYTES[bits] + SCALE_BYTES


def bits_of(packed: torch.Tensor) -> int:
    """The format of a packed weight, from its last dim."""
    for bits in QUANT_BYTES:
        if packed.shape[-1] == group_bytes(bits):
            return bits
    raise ValueError(f"not a packed int8/int4 weight: last dim {packed.shape[-1]}")


def packed_shape(out_features: int, in_features: int, bits: int) -> tuple[int, int, int]:
    return (-(-out_features // BLOCK_ROWS), -(-in_features // GROUP), group_bytes(bits))


def packed_nbytes(out_features: int, in_features: int, bits: int) -> int:
    blocks, groups, size = packed_shape(out_features, in_features, bits)
    return blocks * groups * size


# ---- weights: quantize / dequantize (vectorised torch; the C++ quantizer is the fast one) ---


def _padded_groups(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> fp32 [NB*16, G, 32], zero-padded."""
    n, k = weight.shape
    blocks, groups, _ = packed_shape(n, k, 8)
    padded = torch.zeros(blocks * BLOCK_ROWS, groups * GROUP, dtype=torch.float32)
    padded[:n, :k] = weight
    return padded.view(blocks * BLOCK_ROWS, groups, GROUP)


def quantize_groups(groups: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [..., 32] -> (q int16 [..., 32] in the format's range, d float16 [...]), by the
    quantizer of the module docstring."""
    if bits == 8:
        amax = groups.abs().amax(-1)
        d = (amax / 127).to(torch.float16)
        d32 = d.float().unsqueeze(-1)
        q = torch.where(d32 > 0, torch.round(groups / d32), 0.0).clamp(-127, 127)
        return q.to(torch.int16), d
    index = groups.abs().argmax(-1, keepdim=True)
    peak = groups.gather(-1, index)  # the value of largest magnitude, with its sign
    best: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    for c in INT4_DIVISORS:
        d = (peak / c).to(torch.float16).float()
        q = torch.where(d != 0, torch.round(groups / d), 0.0).clamp(-8, 7)
        err = ((groups - d * q) ** 2).sum(-1, keepdim=True)
        if best is None:
            best = q, d, err
            continue
        best_q, best_d, best_err = best
        better = err < best_err
        best_q = torch.where(better, q, best_q)
        best_d = torch.where(better, d, best_d)
        best = best_q, best_d, torch.where(better, err, best_err)
    assert best is not None  # INT4_DIVISORS is not empty
    best_q, best_d, _ = best
    return (best_q + 8).to(torch.int16), best_d.squeeze(-1).to(torch.float16)


def lay_out_quants(stored: torch.Tensor, bits: int) -> torch.Tensor:
    """Stored quants [..., 16 (rows i), 32 (columns k)] (int8: q + 128; int4: a nibble) ->
    the group's quant bytes uint8 [..., QUANT_BYTES[bits]], laid out for ``VPDPBUSD`` as the
    module docstring says (also the k8/k4 formats' regions: ``kquant_format``)."""
    lead = stored.shape[:-2]
    u = stored.to(torch.uint8)
    if bits == 8:
        lanes = u.reshape(*lead, BLOCK_ROWS, 8, 4)  # [..., i, s, j]
    else:
        nibbles = u[..., :16] | (u[..., 16:] << 4)  # columns k and k + 16
        lanes = nibbles.reshape(*lead, BLOCK_ROWS, 4, 4)
    return lanes.transpose(-3, -2).reshape(*lead, QUANT_BYTES[bits])  # [..., s, i, j]


def read_quants(quants: torch.Tensor, bits: int) -> torch.Tensor:
    """The inverse of ``lay_out_quants``: quant bytes [..., QUANT_BYTES[bits]] -> the stored
    quants int16 [..., 16, 32]."""
    lead = quants.shape[:-1]
    steps = 8 if bits == 8 else 4
    lanes = quants.reshape(*lead, steps, BLOCK_ROWS, 4).transpose(-3, -2)  # [..., i, s, j]
    lanes = lanes.reshape(*lead, BLOCK_ROWS, 4 * steps).to(torch.int16)
    return lanes if bits == 8 else torch.cat([lanes & 0xF, lanes >> 4], dim=-1)


def pack_groups(q: torch.Tensor, d: torch.Tensor, bits: int) -> torch.Tensor:
    """q int [NB*16, G, 32] (int8: -128..127, int4: 0..15), d float16 [NB*16, G] -> packed
    uint8 [NB, G, S] in the layout of the module docstring."""
    rows, groups, _ = q.shape
    blocks = rows // BLOCK_ROWS
    q = q.view(blocks, BLOCK_ROWS, groups, GROUP).permute(0, 2, 1, 3)  # [NB, G, 16, 32]
    quants = lay_out_quants(q.to(torch.int32) + 128 if bits == 8 else q, bits)
    scales = d.view(blocks, BLOCK_ROWS, groups).permute(0, 2, 1).contiguous()  # [NB, G, 16]
    scale_bytes = scales.view(torch.uint8)  # [NB, G, 32], little-endian float16
    return torch.cat([quants, scale_bytes], dim=-1).contiguous()


def quantize_weight_ref(weight: torch.Tensor, bits: int) -> torch.Tensor:
    """weight [N, K] (any float dtype) -> packed uint8 [ceil(N/16), ceil(K/32), S]: the
    reference of ``mlafx::quantize_linear_weight``."""
    groups = _padded_groups(weight)
    q, d = quantize_groups(groups, bits)
    return pack_groups(q, d, bits)


def unpack_groups(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """packed uint8 [NB, G, S] -> (signed q int16 [NB*16, G, 32] with z removed, i.e. w = d*q;
    d float16 [NB*16, G])."""
    bits = bits_of(packed)
    blocks, groups, _ = packed.shape
    scales = packed[..., QUANT_BYTES[bits] :].contiguous().view(torch.float16)  # [NB, G, 16]
    stored = read_quants(packed[..., : QUANT_BYTES[bits]], bits)  # [NB, G, 16, 32]
    q = stored.permute(0, 2, 1, 3) - (128 if bits == 8 else 8)  # [NB, 16, G, 32]
    d = scales.permute(0, 2, 1).reshape(blocks * BLOCK_ROWS, groups)
    return q.reshape(blocks * BLOCK_ROWS, groups, GROUP), d


def dequantize_weight(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """packed -> W [N, K] float32, exactly d * (q - z) (a float16 scale times a small integer
    is exact in float32); a k8/k4 weight by ``kquant_format``'s rule."""
    from mlafx.kernels import kquant_format  # it builds on this module

    if kquant_format.kquant_name(packed) is not None:
        return kquant_format.dequantize_kquant(packed, out_features)[:, :in_features]
    q, d = unpack_groups(packed)
    w = q.float() * d.float().unsqueeze(-1)
    return w.reshape(w.shape[0], -1)[:out_features, :in_features]


# ---- GGUF (llama.cpp) Q8_0 / Q4_0 / Q5_0 tensors -----------------------------------------
#
# A GGUF Q8_0 row is K/32 blocks of 34 bytes: float16 d, then 32 int8 q (w = d * q); a Q4_0
# row K/32 blocks of 18 bytes: float16 d, then 16 bytes whose low nibble is element j and high
# nibble element j + 16 (w = d * (q - 8)). Both are exactly our groups, re-laid out; so is
# Q5_0 (w = d * (q - 16), q < 32) as int8 groups.


def _ggml_groups(
    blocks: torch.Tensor, out_features: int, in_features: int, quant_bytes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [N, K/32 * (2 + quant_bytes)] -> (quant bytes [N, G, quant_bytes], d fp16 [N, G])."""
    if in_features % GROUP != 0:
        raise ValueError(f"GGUF blocks need in_features % {GROUP} == 0, got {in_features}")
    groups = in_features // GROUP
    if blocks.dtype != torch.uint8 or tuple(blocks.shape) != (
        out_features,
        groups * (2 + quant_bytes),
    ):
        raise ValueError(
            f"blocks must be uint8 [{out_features}, {groups * (2 + quant_bytes)}], got "
            f"{blocks.dtype} {tuple(blocks.shape)}"
        )
    raw = blocks.reshape(out_features, groups, 2 + quant_bytes)
    d = raw[..., :2].contiguous().view(torch.float16).squeeze(-1)  # [N, G]
    return raw[..., 2:], d


def _pack_padded(q: torch.Tensor, d: torch.Tensor, bits: int, pad_q: int) -> torch.Tensor:
    """q [N, G, 32], d fp16 [N, G] -> packed, rows past N with q = pad_q and d = 0."""
    n, groups, _ = q.shape
    rows = -(-n // BLOCK_ROWS) * BLOCK_ROWS
    q_padded = torch.full((rows, groups, GROUP), pad_q, dtype=torch.int16)
    q_padded[:n] = q
    d_padded = torch.zeros(rows, groups, dtype=torch.float16)
    d_padded[:n] = d
    return pack_groups(q_padded, d_padded, bits)


def repack_ggml_q8_0(blocks: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """GGUF Q8_0 data uint8 [N, K/32 * 34] -> packed int8 [ceil(N/16), K/32, 544], lossless."""
    quants, d = _ggml_groups(blocks, out_features, in_features, GROUP)
    return _pack_padded(quants.contiguous().view(torch.int8).to(torch.int16), d, 8, 0)


def _q4_0_values(blocks: torch.Tensor, out_features: int, in_features: int):
    quants, d = _ggml_groups(blocks, out_features, in_features, GROUP // 2)
    nibbles = quants.to(torch.int16)
    return torch.cat([nibbles & 0xF, nibbles >> 4], dim=-1), d  # elements j, then j + 16


def repack_ggml_q4_0(
    blocks: torch.Tensor, out_features: int, in_features: int, bits: int = 4
) -> torch.Tensor:
    """GGUF Q4_0 data uint8 [N, K/32 * 18] -> packed int4 [ceil(N/16), K/32, 288] (or, with
    ``bits=8``, int8 [.., 544]: q - 8 in [-8, 7] is an int8 value), lossless."""
    q, d = _q4_0_values(blocks, out_features, in_features)
    if bits == 8:
        return _pack_padded(q - 8, d, 8, 0)
    return _pack_padded(q, d, 4, 8)


def repack_ggml_q5_0(blocks: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """GGUF Q5_0 data uint8 [N, K/32 * 22] -> packed int8 [ceil(N/16), K/32, 544], lossless.

    A Q5_0 block is float16 d, a little-endian uint32 ``qh`` of fifth bits (bit j for element
    j), then 16 bytes of low nibbles as Q4_0's; w = d * (q - 16) with q in [0, 31], so q - 16
    is an int8 value under the same scale."""
    quants, d = _ggml_groups(blocks, out_features, in_features, 4 + GROUP // 2)
    qh = quants[..., :4].contiguous().view(torch.int32).to(torch.int64)  # [N, G, 1]
    bit = (qh >> torch.arange(GROUP, dtype=torch.int64)) & 1  # [N, G, 32]
    nibbles = quants[..., 4:].to(torch.int16)
    low = torch.cat([nibbles & 0xF, nibbles >> 4], dim=-1)
    return _pack_padded(low + (bit.to(torch.int16) << 4) - 16, d, 8, 0)


def stack_packed_rows(parts: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """Packed weights ``(packed, rows)`` of one format and in_features -> the packed weight of
    their rows stacked (a 16-row block may then hold rows of two parts), every group's quants
    and scale kept as they are: lossless."""
    bits = bits_of(parts[0][0])
    qs, ds = [], []
    for packed, rows in parts:
        q, d = unpack_groups(packed)
        qs.append(q[:rows])
        ds.append(d[:rows])
    q = torch.cat(qs)
    return _pack_padded(q + (8 if bits == 4 else 0), torch.cat(ds), bits, 8 if bits == 4 else 0)


# ---- compressed-tensors pack-quantized int4 -----------------------------------------------
#
# ``weight_packed`` int32 [N, ceil(K/8)]: element k of a row is the nibble at bits 4*(k % 8) of
# int32 k // 8, holding v + 8 for the signed value v in [-8, 7] (compressed-tensors'
# ``pack_to_int32``); so seen as little-endian bytes, byte j holds element 2j in its low nibble
# and 2j + 1 in its high one. ``weight_scale`` [N, ceil(K/g)] (g = group_size; [N, 1] per
# channel): w = scale * v. The stored nibble is our q (w = d * (q - 8)); a group of g >= 32
# columns is g / 32 of our groups sharing its scale, held exactly in float16 or refused.


def _compressed_nibbles(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """int32 [N, ceil(K/8)] -> the stored nibbles (v + 8) uint8 [N, K] (little-endian host)."""
    if packed.dtype != torch.int32 or packed.dim() != 2 or packed.shape[1] != -(-in_features // 8):
        raise ValueError(
            f"weight_packed must be int32 [N, {-(-in_features // 8)}], got {packed.dtype} "
            f"{tuple(packed.shape)}"
        )
    raw = packed.contiguous().view(torch.uint8)  # [N, 4 * ceil(K/8)]
    nibbles = torch.stack((raw & 0xF, raw >> 4), dim=-1).reshape(packed.shape[0], -1)
    return nibbles[:, :in_features]


def _compressed_scales(
    scale: torch.Tensor, in_features: int, group_size: int | None
) -> torch.Tensor:
    """weight_scale [N, ceil(K/g)] (or [N, 1]) -> one scale per column [N, K], its dtype."""
    if group_size is None:
        return scale[:, :1].expand(-1, in_features)
    return scale.repeat_interleave(group_size, dim=1)[:, :in_features]


def dequantize_compressed_int4(
    packed: torch.Tensor, scale: torch.Tensor, in_features: int, group_size: int | None
) -> torch.Tensor:
    """A pack-quantized int4 weight -> W [N, K] float32, exactly scale * v."""
    v = _compressed_nibbles(packed, in_features).to(torch.float32) - 8
    return v * _compressed_scales(scale, in_features, group_size).to(torch.float32)


def repack_compressed_int4(
    packed: torch.Tensor, scale: torch.Tensor, in_features: int, group_size: int | None
) -> torch.Tensor:
    """A pack-quantized int4 weight (``group_size`` a multiple of 32, or None per channel) ->
    packed int4 [ceil(N/16), ceil(K/32), 288], lossless; ``ValueError`` if a scale is not
    exactly a float16 (the layout's scale type)."""
    if group_size is not None and group_size % GROUP:
        raise ValueError(f"group_size {group_size} is not a multiple of {GROUP}")
    n, k = packed.shape[0], in_features
    groups = -(-k // GROUP)
    q = torch.full((n, groups * GROUP), 8, dtype=torch.int16)  # columns past K: w = 0
    q[:, :k] = _compressed_nibbles(packed, k)
    # one scale per group of 32 (a group of g >= 32 columns repeats its scale g / 32 times)
    if group_size is not None:
        wide = scale.repeat_interleave(group_size // GROUP, dim=1)[:, :groups]
    else:
        wide = scale[:, :1].expand(-1, groups)
    d = wide.to(torch.float16)
    exact = d.to(wide.dtype) == wide
    if not bool(exact.all()):
        row, group = (int(i) for i in (~exact).nonzero()[0])
        raise ValueError(
            f"scale {float(wide[row, group])!r} (row {row}, columns {group * GROUP}..) is not "
            "exactly a float16, the scale type of mlafx's int4 layout"
        )
    return _pack_padded(q.view(n, groups, GROUP), d, 4, 8)


# ---- activations and the product -----------------------------------------------------------


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q_x float32 [M, G, 32] holding integers in [-127, 127], d_x float32 [M, G]),
    zero-padded past K (the rule of the module docstring)."""
    m, k = x.shape
    groups = -(-k // GROUP)
    padded = torch.zeros(m, groups * GROUP, dtype=torch.float32)
    padded[:, :k] = x
    padded = padded.view(m, groups, GROUP)
    d = padded.abs().amax(-1) / 127
    inverse = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round(padded * inverse.unsqueeze(-1)).clamp(-127, 127)
    # A zero stays 0 when 1 / d overflows (amax below ~3.7e-37): 0 * inf would be NaN.
    q = torch.where(padded == 0, 0.0, q)
    q = torch.where(torch.isnan(padded), padded, q)  # NaN propagates, as through the kernels
    return q, d


def linear_quantized_reference(
    x: torch.Tensor,  # [M, K]
    packed: torch.Tensor,  # [ceil(N/16), ceil(K/32), S] uint8
    out_features: int,  # N
    bias: torch.Tensor | None = None,  # [N], x's dtype
) -> torch.Tensor:
    """``x @ W^T (+ bias)`` -> [M, N] in x's dtype, by the semantics of the module docstring:
    x quantized per row and group of 32, W dequantized, the product in float32 (the model's
    eager path; the kernels' integer dots give the same up to fp32 summation order)."""
    q_x, d_x = quantize_activations(x.reshape(-1, x.shape[-1]))
    x_deq = (q_x * d_x.unsqueeze(-1)).reshape(q_x.shape[0], -1)
    w = dequantize_weight(packed, out_features, x_deq.shape[1])
    out = (x_deq @ w.t()).to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], out_features)
