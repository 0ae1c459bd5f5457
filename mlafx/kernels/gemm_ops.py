"""Typed wrappers and fakes of the linear ops on packed weights (schemas: ``csrc/gemm.cpp``).

The weight of a linear is packed once, at load time, with :func:`pack_linear_weight` and kept
as a named weight in place of the checkpoint's: :func:`linear_decode` streams it at memory
bandwidth for a few rows of x (decode: lm_head, projections, shared experts);
:func:`linear_packed` picks that or, for more rows, ATen's matmul on the weight unpacked a
chunk of rows at a time. :func:`unpack_linear_weight` is the inverse of the packing.
:func:`batched_matmul` is ``torch.bmm`` for the absorbed attention's per-head products, in
fixed row tiles in batch-invariant mode. References: ``gemm_reference.py``.
"""

from __future__ import annotations

import torch

from mlafx.kernels.extension import load_extension

load_extension()  # the schemas must be registered before fakes can attach to them

_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
PACKED_BLOCK_ROWS = 16


@torch.library.register_fake("mlafx::pack_linear_weight")
def _pack_linear_weight_fake(weight: torch.Tensor) -> torch.Tensor:
    torch._check(weight.dtype in _FLOAT_DTYPES, lambda: f"weight dtype {weight.dtype} unsupported")
    torch._check(weight.dim() == 2, lambda: f"weight must be 2-D, got {tuple(weight.shape)}")
    n, k = weight.shape
    blocks = (n + PACKED_BLOCK_ROWS - 1) // PACKED_BLOCK_ROWS
    return weight.new_empty((blocks, (k + 1) // 2, 2 * PACKED_BLOCK_ROWS))


def _check_packed(packed_weight: torch.Tensor, out_features: int) -> None:
    torch._check(
        packed_weight.dtype in _FLOAT_DTYPES,
        lambda: f"packed_weight dtype {packed_weight.dtype} unsupported",
    )
    torch._check(packed_weight.dim() == 3 and packed_weight.shape[2] == 2 * PACKED_BLOCK_ROWS)
    torch._check(
        (out_features + PACKED_BLOCK_ROWS - 1) // PACKED_BLOCK_ROWS == packed_weight.shape[0]
    )


@torch.library.register_fake("mlafx::unpack_linear_weight")
def _unpack_linear_weight_fake(
    packed_weight: torch.Tensor, out_features: int, in_features: int
) -> torch.Tensor:
    _check_packed(packed_weight, out_features)
    torch._check((in_features + 1) // 2 == packed_weight.shape[1])
    return packed_weight.new_empty((out_features, in_features))


@torch.library.register_fake("mlafx::linear_decode")
def _linear_decode_fake(
    x: torch.Tensor, packed_weight: torch.Tensor, out_features: int
) -> torch.Tensor:
    _check_packed(packed_weight, out_features)
    torch._check(x.dtype in _FLOAT_DTYPES, lambda: f"x dtype {x.dtype} unsupported")
    torch._check(
        packed_weight.dtype == x.dtype,
        lambda: f"packed_weight dtype {packed_weight.dtype} must equal x's {x.dtype}",
    )
    torch._check(x.dim() == 2, lambda: f"x must be 2-D, got {tuple(x.shape)}")
    torch._check((x.shape[1] + 1) // 2 == packed_weight.shape[1])
    return x.new_empty((x.shape[0], out_features))


@torch.library.register_fake("mlafx::linear_packed")
def _linear_packed_fake(
    x: torch.Tensor,
    packed_weight: torch.Tensor,
    out_features: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    if bias is not None:
        torch._check(
            bias.dim() == 1 and bias.shape[0] == out_features,
            lambda: f"bias must be [{out_features}], got {tuple(bias.shape)}",
        )
        torch._check(bias.dtype == x.dtype, lambda: f"bias dtype {bias.dtype} != x's {x.dtype}")
    return _linear_decode_fake(x, packed_weight, out_features)


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] (an ``nn.Linear`` weight) -> packed [ceil(N/16), ceil(K/2), 32], same
    dtype: blocks of 16 rows, each column pair of the 16 rows side by side, zero-padded."""
    return torch.ops.mlafx.pack_linear_weight(weight)


def linear_decode(
    x: torch.Tensor,  # [M, K], M <= 32 or so (any M works; larger M is compute-bound)
    packed_weight: torch.Tensor,  # from pack_linear_weight(weight [N, K])
    out_features: int,  # N
) -> torch.Tensor:
    """``x @ weight^T`` -> [M, N] in x's dtype (fp32 accumulation, one rounding)."""
    return torch.ops.mlafx.linear_decode(x, packed_weight, out_features)


def unpack_linear_weight(
    packed_weight: torch.Tensor,  # from pack_linear_weight(weight [N, K])
    out_features: int,  # N
    in_features: int,  # K
) -> torch.Tensor:
    """The inverse of :func:`pack_linear_weight`: packed -> weight [N, K], same dtype."""
    return torch.ops.mlafx.unpack_linear_weight(packed_weight, out_features, in_features)


def linear_packed(
    x: torch.Tensor,  # [M, K], last dim contiguous
    packed_weight: torch.Tensor,  # pack_linear_weight(weight [N, K])
    out_features: int,  # N
    bias: torch.Tensor | None = None,  # [N], x's dtype
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` from the packed weight alone, choosing the kernel by the
    number of rows at run time: the streaming kernel for decode-sized ``x`` (bf16: at most 32
    rows with AMX, 256 on an AVX-512 BF16 CPU without it; else 8), above that ATen's matmul
    (oneDNN) on the weight unpacked a chunk of output rows at a time. What the compiler
    lowers a model's linears to, so one graph serves decode and prefill steps with one copy
    of each weight."""
    return torch.ops.mlafx.linear_packed(x, packed_weight, out_features, bias)


@torch.library.register_fake("mlafx::batched_matmul")
def _batched_matmul_fake(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    torch._check(x.dim() == 3 and w.dim() == 3, lambda: "x and w must be 3-D")
    torch._check(x.shape[0] == w.shape[0] and x.shape[2] == w.shape[1])
    torch._check(x.dtype == w.dtype, lambda: f"w dtype {w.dtype} must equal x's {x.dtype}")
    return x.new_empty((x.shape[0], x.shape[1], w.shape[2]))


def batched_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [B, M, K] @ w [B, K, N] -> [B, M, N] (``torch.bmm``); in batch-invariant mode
    (``set_batch_invariant``) computed as fixed 16-row tiles, so a row's result never depends
    on M."""
    return torch.ops.mlafx.batched_matmul(x, w)
