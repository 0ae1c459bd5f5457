"""mlafx's super-block formats ``k4`` and ``k8``: llama.cpp's K-quants (Q4_K, Q5_K, Q6_K)
repacked without loss into the lane-along-rows layout of ``quant_format`` (one place for the
repacking, the kernels and the loader to agree on).

A K-quant row is cut into super-blocks of 256 columns, each with a float16 ``d`` (Q4_K, Q5_K:
also a float16 ``dmin``) and small integer scales per sub-block of 32 (Q6_K: of 16) columns:

    Q4_K  w = d * sc * q - dmin * m    q in [0, 15], sc, m in [0, 63] per 32   4.5 bits/weight
    Q5_K  the same with q in [0, 31]                                           5.5
    Q6_K  w = d * sc * (q - 32)        q in [0, 63], sc in [-128, 127] per 16  6.5625

One rule holds all three, per row i and group of 32 columns (the activations' groups):

    w[i, k] = d_i * (a_{h,i} * v[i, k]) - dmin_i * m_i       h = k // 16 (the group's half)

with ``v`` and the two half scales ``a_0, a_1`` small integers: Q4_K / Q5_K ``v = q``,
``a_0 = a_1 = sc``; Q6_K ``v = q - 32``, ``a_h`` its sub-blocks' scales, ``m = 0``,
``dmin = 0``. Every product is exact in float32 (a float16 times an integer below 2^13), so
``dequantize_kquant`` equals ``gguf.quants.dequantize`` bit for bit.

Layout, ``packed`` uint8 [NB = ceil(N/16), G = K/256, S]: block b, super-block g holds rows
16b..16b+15 and columns 256g..256g+255 as 8 regions of R bytes (group t: columns 32t..32t+31
of the super-block), then a header:
- region t: the quants, ``QUANT_BYTES[bits]`` bytes laid out exactly as ``quant_format``'s
  int4 (``k4``: byte ``64s + 4i + j`` = v[i, 4s+j] | v[i, 16+4s+j] << 4, v in [0, 15], no
  offset) or int8 (``k8``: byte ``64s + 4i + j`` = v[i, 4s+j] + 128); then ``a_0`` [16] int8,
  ``a_1`` [16] int8, ``m`` [16] uint8 (row i at byte i of each);
- header: ``d`` [16] float16, ``dmin`` [16] float16 (little-endian, row i at bytes 2i).
So ``k4`` takes 4.875 bits per weight (Q4_K), ``k8`` 8.875 (Q5_K, Q6_K). Rows past N are
all zeros (w = 0). K must be a multiple of 256 (as in GGUF).

The product (``linear_quantized`` / ``moe_experts_quantized`` on a K-format weight, W8A8 as
for the int formats): per row m of x quantized per group of 32 (``quantize_activations``:
``q_x``, ``d_x``, ``qsum`` = sum of q_x), per weight row i and group, in group order,

    isum_h = sum_{k in half h} v[i, k] * q_x[k]            (exact int32)
    I = a_0 * isum_0 + a_1 * isum_1,  J = m * qsum          (exact int32)
    acc += (d * float(I) - dmin * float(J)) * d_x           (each operation rounded to fp32)

then ``acc`` rounded once to x's dtype. Every kernel path computes exactly this (bit-identical);
the eager reference dequantizes and multiplies in float32 (equal up to summation order).
"""

from __future__ import annotations

import torch

from mlafx.kernels.quant_format import BLOCK_ROWS, GROUP, QUANT_BYTES, lay_out_quants, read_quants

SUPER = 256  # columns per super-block
SUB_GROUPS = SUPER // GROUP  # groups of 32 per super-block
TRAILER_BYTES = 3 * BLOCK_ROWS  # a_0, a_1, m per region
HEADER_BYTES = 4 * BLOCK_ROWS  # d, dmin per super-block
KQUANT_BITS = {"k4": 4, "k8": 8}
# GGUF K-quant types -> the bytes of one 256-column block (which format takes which type:
# kernels/ggml_repack.py)
GGML_KQUANT_BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def region_bytes(bits: int) -> int:
    return QUANT_BYTES[bits] + TRAILER_BYTES


def kquant_group_bytes(bits: int) -> int:
    """Bytes per block and super-block: S, the last dim of a packed k4 (2496) / k8 (4544)."""
    return SUB_GROUPS * region_bytes(bits) + HEADER_BYTES


KQUANT_GROUP_BYTES = {kquant_group_bytes(bits): name for name, bits in KQUANT_BITS.items()}


def kquant_shape(out_features: int, in_features: int, bits: int) -> tuple[int, int, int]:
    if in_features % SUPER:
        raise ValueError(f"K-quant weights need in_features % {SUPER} == 0, got {in_features}")
    return (-(-out_features // BLOCK_ROWS), in_features // SUPER, kquant_group_bytes(bits))


def kquant_name(packed: torch.Tensor) -> str | None:
    """ "k4" / "k8" for a packed K-format weight (by its last dim), else None."""
    return KQUANT_GROUP_BYTES.get(int(packed.shape[-1]))


# ---- the parts of a K-format weight ---------------------------------------------------------
# v int16 [R, G, 8, 32], a int16 [R, G, 8, 2], m int16 [R, G, 8], d / dmin float16 [R, G]
# for R rows (a multiple of 16 when packed).
KParts = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def pack_kquant(parts: KParts, bits: int) -> torch.Tensor:
    """Parts of R rows (any R) -> packed uint8 [ceil(R/16), G, S], rows past R zero."""
    v, a, m, d, dmin = parts
    rows, groups = d.shape
    padded = -(-rows // BLOCK_ROWS) * BLOCK_ROWS

    def pad(t: torch.Tensor) -> torch.Tensor:
        out = t.new_zeros((padded, *t.shape[1:]))
        out[:rows] = t
        return out

    v, a, m, d, dmin = (pad(t) for t in (v, a, m, d, dmin))
    blocks = padded // BLOCK_ROWS
    # [NB, G, 8(t), 16(i), 32(k)]
    v = v.view(blocks, BLOCK_ROWS, groups, SUB_GROUPS, GROUP).permute(0, 2, 3, 1, 4)
    quants = lay_out_quants(v.to(torch.int32) + 128 if bits == 8 else v, bits)

    def per_row(t: torch.Tensor) -> torch.Tensor:  # [padded, G, 8] -> uint8 [NB, G, 8, 16]
        t = t.view(blocks, BLOCK_ROWS, groups, SUB_GROUPS).permute(0, 2, 3, 1)
        return t.to(torch.int16).to(torch.uint8)  # int8 two's complement for a

    trailer = torch.cat([per_row(a[..., 0]), per_row(a[..., 1]), per_row(m)], dim=-1)
    regions = torch.cat([quants, trailer], dim=-1).reshape(blocks, groups, -1)

    def header(t: torch.Tensor) -> torch.Tensor:  # float16 [padded, G] -> uint8 [NB, G, 32]
        t = t.view(blocks, BLOCK_ROWS, groups).permute(0, 2, 1).contiguous()
        return t.view(torch.uint8)

    return torch.cat([regions, header(d), header(dmin)], dim=-1).contiguous()


def unpack_kquant(packed: torch.Tensor) -> KParts:
    """packed uint8 [NB, G, S] -> the parts of its NB*16 rows (inverse of ``pack_kquant``)."""
    name = kquant_name(packed)
    if name is None:
        raise ValueError(f"not a packed k4/k8 weight: last dim {packed.shape[-1]}")
    bits = KQUANT_BITS[name]
    blocks, groups, _ = packed.shape
    rows = blocks * BLOCK_ROWS
    body = packed[..., : SUB_GROUPS * region_bytes(bits)]
    regions = body.reshape(blocks, groups, SUB_GROUPS, region_bytes(bits))
    stored = read_quants(regions[..., : QUANT_BYTES[bits]], bits)  # [NB, G, 8, 16, 32]
    v = stored.permute(0, 3, 1, 2, 4).reshape(rows, groups, SUB_GROUPS, GROUP)
    v = v - 128 if bits == 8 else v
    trailer = regions[..., QUANT_BYTES[bits] :].reshape(blocks, groups, SUB_GROUPS, 3, BLOCK_ROWS)
    trailer = trailer.permute(0, 4, 1, 2, 3).reshape(rows, groups, SUB_GROUPS, 3)
    a = trailer[..., :2].contiguous().view(torch.int8).to(torch.int16)
    m = trailer[..., 2].to(torch.int16)
    head = packed[..., SUB_GROUPS * region_bytes(bits) :].contiguous()
    head = head.view(torch.float16).reshape(blocks, groups, 2, BLOCK_ROWS)
    d = head[..., 0, :].permute(0, 2, 1).reshape(rows, groups)
    dmin = head[..., 1, :].permute(0, 2, 1).reshape(rows, groups)
    return v, a, m, d, dmin


def dequantize_kquant(packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """packed -> W [N, K] float32 by the rule of the module docstring (exact)."""
    v, a, m, d, dmin = unpack_kquant(packed)
    rows, groups = d.shape
    halves = v.view(rows, groups, SUB_GROUPS, 2, 16) * a.unsqueeze(-1)  # exact in int16
    scaled = halves.float() * d.float().view(rows, groups, 1, 1, 1)
    offset = m.float() * dmin.float().view(rows, groups, 1)
    w = scaled - offset.view(rows, groups, SUB_GROUPS, 1, 1)
    return w.reshape(rows, groups * SUPER)[:out_features]


def stack_kquant_rows(parts: list[tuple[torch.Tensor, int]], bits: int) -> torch.Tensor:
    """Packed K-format weights ``(packed, rows)`` of one in_features -> the packed weight (in
    ``bits``: k4 parts may go into k8, never the reverse) of their rows stacked, lossless."""
    if bits == 4 and any(kquant_name(packed) != "k4" for packed, _ in parts):
        raise ValueError("a k8 weight does not fit k4 without loss")
    pieces = [unpack_kquant(packed) for packed, _ in parts]
    stacked = [
        torch.cat([piece[j][:rows] for piece, (_, rows) in zip(pieces, parts, strict=True)])
        for j in range(5)
    ]
    return pack_kquant((stacked[0], stacked[1], stacked[2], stacked[3], stacked[4]), bits)


# ---- GGUF K-quant blocks --------------------------------------------------------------------


def _ggml_superblocks(type_name: str, data: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """raw uint8 [N, K/256 * block bytes] -> [N, K/256, block bytes]."""
    size = GGML_KQUANT_BLOCK_BYTES[type_name]
    if k % SUPER:
        raise ValueError(f"GGUF {type_name} needs in_features % {SUPER} == 0, got {k}")
    if data.dtype != torch.uint8 or tuple(data.shape) != (n, k // SUPER * size):
        raise ValueError(
            f"{type_name} data must be uint8 [{n}, {k // SUPER * size}], got {data.dtype} "
            f"{tuple(data.shape)}"
        )
    return data.reshape(n, k // SUPER, size)


def _fp16(raw: torch.Tensor) -> torch.Tensor:
    return raw.contiguous().view(torch.float16).squeeze(-1)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 packed bytes [.., 12] -> 6-bit sc, m [.., 8] (llama.cpp's
    ``get_scale_min_k4``)."""
    s = scales.to(torch.int16)
    lo, hi, mix = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([lo & 0x3F, (mix & 0x0F) | ((lo >> 2) & 0x30)], dim=-1)
    m = torch.cat([hi & 0x3F, (mix >> 4) | ((hi >> 2) & 0x30)], dim=-1)
    return sc, m


def _low_nibble_pairs(qs: torch.Tensor) -> torch.Tensor:
    """128 bytes [.., 128] -> [.., 8, 32]: sub-block 2p the low nibbles of bytes 32p.., 2p+1
    the high ones."""
    q = qs.to(torch.int16).reshape(*qs.shape[:-1], 4, 1, 32)
    q = torch.cat([q & 0xF, q >> 4], dim=-2)  # [.., 4, 2, 32]
    return q.reshape(*qs.shape[:-1], SUB_GROUPS, GROUP)


def kquant_parts_from_ggml(type_name: str, data: torch.Tensor, n: int, k: int) -> KParts:
    """A GGUF Q4_K / Q5_K / Q6_K weight [N, K] (raw uint8 rows) -> its parts (exact)."""
    raw = _ggml_superblocks(type_name, data, n, k)
    if type_name in ("Q4_K", "Q5_K"):
        d, dmin = _fp16(raw[..., 0:2]), _fp16(raw[..., 2:4])
        sc, m = _scale_min_k4(raw[..., 4:16])
        if type_name == "Q4_K":
            v = _low_nibble_pairs(raw[..., 16:144])
        else:
            qh = raw[..., 16:48].to(torch.int16).unsqueeze(-2)  # [N, G, 1, 32]
            fifth = (qh >> torch.arange(SUB_GROUPS, dtype=torch.int16).view(-1, 1)) & 1
            v = _low_nibble_pairs(raw[..., 48:176]) | (fifth << 4)
        a = torch.stack([sc, sc], dim=-1)
        return v, a, m, d, dmin
    if type_name != "Q6_K":
        raise ValueError(f"not a K-quant type: {type_name}")
    ql = raw[..., 0:128].to(torch.int16).reshape(n, -1, 2, 1, 64)
    ql = torch.cat([ql & 0xF, ql >> 4], dim=-2).reshape(n, -1, SUB_GROUPS, GROUP)
    qh = raw[..., 128:192].to(torch.int16).reshape(n, -1, 2, 1, 32)
    qh = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.int16).view(4, 1)) & 3
    v = (ql | (qh.reshape(n, -1, SUB_GROUPS, GROUP) << 4)) - 32
    sc = raw[..., 192:208].contiguous().view(torch.int8).to(torch.int16)  # [N, G, 16]
    d = _fp16(raw[..., 208:210])
    zeros = torch.zeros(n, d.shape[1], SUB_GROUPS, dtype=torch.int16)
    return v, sc.reshape(n, -1, SUB_GROUPS, 2), zeros, d, torch.zeros_like(d)


def repack_ggml_kquant(
    type_name: str, data: torch.Tensor, out_features: int, in_features: int, bits: int
) -> torch.Tensor:
    """A GGUF K-quant weight -> packed ``k{bits}`` [ceil(N/16), K/256, S], lossless for the
    types ``ggml_repack.GGML_LOSSLESS_FORMATS`` gives that format (Q4_K into k4 or k8; Q5_K
    and Q6_K into k8), which ``ggml_repack.repack_ggml_weight`` checks first."""
    return pack_kquant(kquant_parts_from_ggml(type_name, data, out_features, in_features), bits)
