"""Typed wrappers and fakes of the block FP8 ops (schemas: ``csrc/fp8_*.cpp``).

The format and semantics are defined in ``fp8_format.py``: the weights stay as the checkpoint
stores them (e4m3 bytes and a float32 scale per block) and are widened in registers.
References: ``fp8_format.linear_fp8_reference`` (the model's eager path) and
``fp8_reference.py`` (float64).
"""

from __future__ import annotations

import torch

from mlafx.kernels.extension import load_extension
from mlafx.kernels.fp8_format import K_STEP

load_extension()  # the schemas must be registered before fakes can attach to them

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_weight(
    w: torch.Tensor, scale: torch.Tensor, rows: int, cols: int, block_n: int, block_k: int,
    lead: tuple[int, ...] = (), scale_rows: int | None = None,
) -> None:  # fmt: skip
    torch._check(block_n > 0 and block_k > 0 and block_k % K_STEP == 0,
                 lambda: f"block [{block_n}, {block_k}] unsupported")  # fmt: skip
    torch._check(w.dtype == torch.float8_e4m3fn, lambda: f"weight dtype {w.dtype} != e4m3")
    torch._check(scale.dtype == torch.float32, lambda: f"scale dtype {scale.dtype} != float32")
    torch._check(tuple(w.shape) == (*lead, rows, cols), lambda: f"weight shape {tuple(w.shape)}")
    srows = -(-rows // block_n) if scale_rows is None else scale_rows
    want = (*lead, srows, -(-cols // block_k))
    torch._check(tuple(scale.shape) == want, lambda: f"scale shape {tuple(scale.shape)} != {want}")


@torch.library.register_fake("mlafx::linear_fp8")
def _linear_fp8_fake(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    block_n: int,
    block_k: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    torch._check(x.dtype in _FLOAT_DTYPES, lambda: f"x dtype {x.dtype} unsupported")
    torch._check(x.dim() == 2 and weight.dim() == 2, lambda: "x and weight must be 2-D")
    n = weight.shape[0]
    _check_weight(weight, weight_scale, n, x.shape[1], block_n, block_k)
    if bias is not None:
        torch._check(bias.dim() == 1 and bias.shape[0] == n, lambda: "bias must be [N]")
        torch._check(bias.dtype == x.dtype, lambda: f"bias dtype {bias.dtype} != x's {x.dtype}")
    return x.new_empty((x.shape[0], n))


@torch.library.register_fake("mlafx::moe_experts_fp8")
def _moe_experts_fp8_fake(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    block_n: int,
    block_k: int,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    # Shapes and dtypes only; expert ids are data, checked when the kernel runs.
    torch._check(x.dtype in _FLOAT_DTYPES, lambda: f"x dtype {x.dtype} unsupported")
    torch._check(topk_ids.dtype == torch.int64, lambda: "topk_ids must be int64")
    torch._check(topk_weights.dtype == torch.float32, lambda: "topk_weights must be float32")
    torch._check(x.dim() == 2 and topk_ids.dim() == 2 and w13.dim() == 3 and w2.dim() == 3)
    torch._check(topk_ids.shape[0] == x.shape[0] and topk_weights.shape == topk_ids.shape)
    e, d, inter = w2.shape[0], x.shape[1], w2.shape[2]
    gate_rows = 2 * -(-inter // block_n)
    _check_weight(w13, w13_scale, 2 * inter, d, block_n, block_k, (e,), gate_rows)
    _check_weight(w2, w2_scale, d, inter, block_n, block_k, (e,))
    return x.new_empty(x.shape)


def linear_fp8(
    x: torch.Tensor,  # [M, K], last dim contiguous
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor,  # [ceil(N/bn), ceil(K/bk)] float32
    block: tuple[int, int],  # (bn, bk), bk a multiple of 32
    bias: torch.Tensor | None = None,  # [N], x's dtype
) -> torch.Tensor:
    """``x @ w^T (+ bias)`` -> [M, N] in x's dtype, ``w`` the dequantized block FP8 weight:
    exact products, fp32 sums per block scaled once, rounded once (``fp8_format``)."""
    return torch.ops.mlafx.linear_fp8(x, weight, weight_scale, block[0], block[1], bias)


def moe_experts_fp8(
    x: torch.Tensor,  # [T, D]
    topk_ids: torch.Tensor,  # [T, k] int64
    topk_weights: torch.Tensor,  # [T, k] float32
    w13: torch.Tensor,  # [E, 2I, D] float8_e4m3fn: gate rows, then up rows
    w13_scale: torch.Tensor,  # [E, 2 ceil(I/bn), ceil(D/bk)]: gate's blocks, then up's
    w2: torch.Tensor,  # [E, D, I] float8_e4m3fn
    w2_scale: torch.Tensor,  # [E, ceil(D/bn), ceil(I/bk)]
    block: tuple[int, int],
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """Routed experts over block FP8 weights -> [T, D] in x's dtype, as
    ``moe_experts_quantized`` with each product ``linear_fp8``
    (``models.fp8.moe_experts_fp8_reference``); with ``swiglu_limit`` the SwiGLU's inputs
    clamped as DeepSeek-V4's (``moe_reference.clamped_swiglu``). An id outside ``[0, E)`` raises
    ``IndexError``."""
    return torch.ops.mlafx.moe_experts_fp8(
        x, topk_ids, topk_weights, w13, w13_scale, w2, w2_scale, block[0], block[1], swiglu_limit
    )


def fp8_cpu_isa() -> str:
    """``"avx512_amx"``, ``"avx512_vbmi"``, ``"avx512_bf16"``, ``"avx2"`` or ``"portable"``:
    the kernels the block FP8 ops take in this process. ``avx512_amx``: bf16 rows of x from 4
    on go to AMX-BF16 tiles (every row count; a block_k that is not a multiple of 64 takes the
    ``avx512_vbmi`` kernels), fewer rows to the VBMI byte-table decoding.
    ``MLAFX_DISABLE_AMX=1``: ``avx512_vbmi``, with the pairs GEMM from 9 bf16 rows;
    ``MLAFX_DISABLE_VBMI=1``: the AVX-512 arithmetic decoding;
    ``MLAFX_DISABLE_AVX512=1``: portable; ``MLAFX_DISABLE_AVX2=1``: the AVX2 tier off alone;
    ``MLAFX_AVX2_ONLY=1``: ``avx2`` on a CPU that has AVX-512 too (e4m3 widened through fp16
    by F16C, fp32 FMAs). The paths differ only in fp32 summation order."""
    return torch.ops.mlafx.fp8_cpu_isa()


__all__ = ["fp8_cpu_isa", "linear_fp8", "moe_experts_fp8"]
