"""Typed wrapper and fake of ``mlafx::v4_compress_pool`` (schema and CPU kernel:
``csrc/v4_compressor.cpp``): DeepSeek-V4's compressor at a window close.

The reference is the model's ``PoolCompressor.close`` (``models/deepseek_v4/compressor.py``);
``v4_compress_pool_f64`` below is the same arithmetic in float64, one entry at a time.
"""

from __future__ import annotations

import torch

from mlafx.kernels.extension import load_extension

load_extension()  # the schemas must be registered before fakes can attach to them


@torch.library.register_fake("mlafx::v4_compress_pool")
def _v4_compress_pool_fake(
    rows: torch.Tensor,
    sources: torch.Tensor,
    has_previous: torch.Tensor,
    position_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    overlap: bool,
    pool: torch.Tensor,
    slots: torch.Tensor,
) -> None:
    torch._check(rows.dim() == 3 and pool.dim() == 3 and pool.dtype == rows.dtype)
    torch._check(sources.dtype == torch.int64 and slots.dtype == torch.int64)
    torch._check(has_previous.dtype == torch.bool)
    torch._check(sources.shape[1] == 2 * position_bias.shape[0])
    torch._check(position_bias.shape[1] == (2 if overlap else 1) * pool.shape[2])
    torch._check(rows.shape[2] == 2 * position_bias.shape[1])


def v4_compress_pool(
    rows: torch.Tensor,  # [NB, BS, 2 * sw] token rows: kv | gate
    sources: torch.Tensor,  # [N, 2m] int64 token slots: window w-1's, then window w's
    has_previous: torch.Tensor,  # [N] bool
    position_bias: torch.Tensor,  # [m, sw] float32
    norm_weight: torch.Tensor,  # [c] float32
    eps: float,
    cos: torch.Tensor,  # [N, R/2] float32
    sin: torch.Tensor,  # [N, R/2] float32
    overlap: bool,  # CSA: two series over 2m slots; HCA: window w's m
    pool: torch.Tensor,  # [NB', P, c], written in place
    slots: torch.Tensor,  # [N] int64 pool slots
) -> None:
    """Write the N closing entries: per channel the softmax over the window's slots of gate +
    position bias weights the kv rows, the sum is RMS-normed (``norm_weight``) and its last
    R dims roped (interleaved pairs), rounding to the rows' dtype where the model does."""
    torch.ops.mlafx.v4_compress_pool(
        rows, sources, has_previous, position_bias, norm_weight, eps, cos, sin, overlap, pool,
        slots,
    )  # fmt: skip


def v4_compress_pool_f64(
    rows: torch.Tensor,
    sources: torch.Tensor,
    has_previous: torch.Tensor,
    position_bias: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    overlap: bool,
) -> torch.Tensor:
    """The entries [N, c] in float64 (no intermediate rounding), one at a time."""
    m, sw = position_bias.shape
    c = sw // (2 if overlap else 1)
    flat = rows.reshape(-1, rows.shape[-1]).double()
    out = []
    for n in range(sources.shape[0]):
        src = flat[sources[n]]  # [2m, 2 sw]
        kv, gate = src[:, :sw], src[:, sw:] + position_bias.double().repeat(2, 1)
        if overlap:
            kv = torch.cat([kv[:m, :c], kv[m:, c:]])
            gate = torch.cat([gate[:m, :c], gate[m:, c:]])
            if not bool(has_previous[n]):
                gate[:m] = float("-inf")
        else:
            kv, gate = kv[m:], gate[m:]
        entry = (kv * gate.softmax(dim=0)).sum(dim=0)
        entry = norm_weight.double() * entry / (entry.square().mean() + eps).sqrt()
        half = cos.shape[1]
        pairs = entry[c - 2 * half :].view(-1, 2)
        cs, sn = cos[n].double(), sin[n].double()
        rotated = torch.stack(
            [pairs[:, 0] * cs - pairs[:, 1] * sn, pairs[:, 1] * cs + pairs[:, 0] * sn], dim=-1
        )
        out.append(torch.cat([entry[: c - 2 * half], rotated.flatten()]))
    return torch.stack(out) if out else torch.zeros(0, c, dtype=torch.float64)
