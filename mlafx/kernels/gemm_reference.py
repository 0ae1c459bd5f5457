"""Slow, obviously correct references for ``mlafx::pack_linear_weight``,
``mlafx::unpack_linear_weight``, ``mlafx::linear_decode`` and ``mlafx::linear_packed`` (tests
compare the C++ kernels with these)."""

from __future__ import annotations

import torch

PACKED_BLOCK_ROWS = 16  # rows of the weight per block of the packed layout


def pack_linear_weight_ref(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> packed [ceil(N/16), ceil(K/2), 32] with
    ``packed[b, p, 2*i + j] = weight[16*b + i, 2*p + j]`` (0 where out of range)."""
    n, k = weight.shape
    blocks, pairs = -(-n // PACKED_BLOCK_ROWS), -(-k // 2)
    packed = torch.zeros(blocks, pairs, 2 * PACKED_BLOCK_ROWS, dtype=weight.dtype)
    for row in range(n):
        b, i = divmod(row, PACKED_BLOCK_ROWS)
        for col in range(k):
            p, j = divmod(col, 2)
            packed[b, p, 2 * i + j] = weight[row, col]
    return packed


def unpack_linear_weight_ref(
    packed: torch.Tensor, out_features: int, in_features: int
) -> torch.Tensor:
    """The inverse of :func:`pack_linear_weight_ref`: packed -> weight [N, K] with
    ``weight[r, c] = packed[r // 16, c // 2, 2 * (r % 16) + c % 2]`` (one gather)."""
    rows = torch.arange(out_features).view(-1, 1)
    cols = torch.arange(in_features).view(1, -1)
    block, i = rows // PACKED_BLOCK_ROWS, rows % PACKED_BLOCK_ROWS
    pair, j = cols // 2, cols % 2
    return packed[block, pair, 2 * i + j]


def linear_decode_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T -> [M, N] in x's dtype, products summed in float64 and
    rounded once (the kernel sums in fp32: tests allow for that)."""
    return (x.double() @ weight.double().t()).to(x.dtype)


def linear_packed_ref(
    x: torch.Tensor,  # [M, K]
    packed: torch.Tensor,  # pack_linear_weight(weight [N, K])
    out_features: int,  # N
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with the weight unpacked, in float64, rounded once to
    x's dtype (the kernel rounds the product, then adds the bias: tests allow for that)."""
    weight = unpack_linear_weight_ref(packed, out_features, x.shape[1]).double()
    out = x.double() @ weight.t()
    if bias is not None:
        out = out + bias.double()
    return out.to(x.dtype)
