"""Block-scaled FP8, as DeepSeek-V3/V3.1/V3.2/R1 and Kimi K2 publish their weights: what the
bytes mean, for the loader, the kernels (``csrc/fp8*.cpp``) and the tests to agree on.

A weight W [N, K] is stored as ``weight`` float8_e4m3fn [N, K] (row-major, as in the file)
and ``weight_scale_inv`` float32 [ceil(N/bn), ceil(K/bk)], one scale per block of bn rows and
bk columns (``weight_block_size = [bn, bk]``, [128, 128] in every published checkpoint; edge
blocks are partial). The dequantized weight is

    w[n, k] = e4m3(W[n, k]) * scale[n // bn, k // bk]

(the name ``scale_inv`` is DeepSeek's: the inverse of the quantizer's scale, i.e. the factor
that dequantizes). e4m3fn has no infinities; its NaN is 0x7F / 0xFF; its largest value is 448.

The ops (``linear_fp8``, ``moe_experts_fp8``) keep these bytes and widen them in registers:
every e4m3 value is exact in bfloat16, so ``x[m, k] * e4m3(W[n, k])`` is exact in fp32 for
bf16, fp16 and fp32 x. Per k block the products are summed in fp32 and the sum is scaled
once; the blocks' fp32 sum is rounded once to x's dtype. From 64 rows of x the kernels
instead dequantize a tile of weight rows to fp32 (``w * s`` rounded once: 2^-24 relative) and
run an fp32 GEMM, the model's eager arithmetic. No activation rounding: the only differences
from the float64 product of the dequantized weight are fp32 rounding and summation and the
final rounding (``fp8_reference.py``).

Expert stacks (``moe_experts_fp8``): ``w13`` [E, 2I, D] is each expert's gate rows then up
rows, ``w13_scale`` [E, 2 ceil(I/bn), ceil(D/bk)] the gate's blocks then the up's (each part
keeps its own blocks, as in the checkpoint, so I need not be a multiple of bn); ``w2``
[E, D, I], ``w2_scale`` [E, ceil(D/bn), ceil(I/bk)].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

E4M3_MAX = 448.0
K_STEP = 32  # block_k must be a multiple of this (the AVX-512 kernels' chunk of K)


def scale_shape(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    """The ``weight_scale_inv`` shape of a [rows, cols] weight."""
    return -(-rows // block[0]), -(-cols // block[1])


def check_block(block: tuple[int, int]) -> None:
    """A clear error for a block the kernels cannot take."""
    bn, bk = block
    if bn <= 0 or bk <= 0 or bk % K_STEP:
        raise ValueError(
            f"FP8 weight_block_size {list(block)} is not supported: the kernels take [rows > 0, "
            f"cols a positive multiple of {K_STEP}] (published checkpoints use [128, 128])"
        )


def expand_scale(scale: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """scale [..., ceil(rows/bn), ceil(cols/bk)] -> [..., rows, cols], each block's value
    repeated over its block."""
    bn, bk = block
    full = scale.repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)
    return full[..., :rows, :cols]


def dequantize_fp8(
    weight: torch.Tensor,  # [..., N, K] float8_e4m3fn
    scale: torch.Tensor,  # [..., ceil(N/bn), ceil(K/bk)] float32
    block: tuple[int, int],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The dequantized weight in ``dtype`` (float64: exact; float32: w * s rounded once)."""
    n, k = weight.shape[-2:]
    return weight.to(dtype) * expand_scale(scale.to(dtype), n, k, block)


def dequantize_gate_up(
    w13: torch.Tensor,  # [E, 2I, D]
    scale: torch.Tensor,  # [E, 2 ceil(I/bn), ceil(D/bk)]
    block: tuple[int, int],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """An expert stack's gate and up rows, each with its own blocks -> [E, 2I, D]."""
    inter = w13.shape[-2] // 2
    gate_s, up_s = scale.chunk(2, dim=-2)
    return torch.cat(
        [
            dequantize_fp8(w13[..., :inter, :], gate_s, block, dtype),
            dequantize_fp8(w13[..., inter:, :], up_s, block, dtype),
        ],
        dim=-2,
    )


def quantize_fp8(
    weight: torch.Tensor, block: tuple[int, int] = (128, 128)
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] (float) -> (float8_e4m3fn [N, K], float32 scale [ceil(N/bn),
    ceil(K/bk)]) as DeepSeek's quantizer: per block ``scale = amax / 448`` (1 for an all-zero
    block), ``q = e4m3(w / scale)`` (round to nearest even)."""
    check_block(block)
    n, k = weight.shape
    w = weight.float()
    bn, bk = block
    rows, cols = scale_shape(n, k, block)
    padded = F.pad(w.abs(), (0, cols * bk - k, 0, rows * bn - n))
    amax = padded.reshape(rows, bn, cols, bk).amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    q = (w / expand_scale(scale, n, k, block)).clamp(-E4M3_MAX, E4M3_MAX)
    return q.to(torch.float8_e4m3fn), scale


def linear_fp8_reference(
    x: torch.Tensor,  # [..., K]
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # [ceil(N/bn), ceil(K/bk)] float32
    block: tuple[int, int],
) -> torch.Tensor:
    """``x @ w^T`` in fp32 over the dequantized weight, rounded once to x's dtype: the
    semantics of ``mlafx::linear_fp8`` up to fp32 summation order (the model's eager path)."""
    w = dequantize_fp8(weight, scale, block)
    return F.linear(x.float(), w).to(x.dtype)
