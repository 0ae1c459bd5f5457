"""The attention ops on DeepSeek-V2-Lite shapes (H=16, Lkv=512, R=64, P=V=128).

- ``mla_attention_paged`` decode (one query per sequence): flops counted as
  ``B*H*L*(2*Lkv+R)*2`` (q.k over Lkv+R, P.V over Lkv), bytes = the cache rows read + q + out.
  Baselines: *absorbed eager* (gather the rows through host-built slots, bmm, fp32 softmax,
  bmm) and *decompressed SDPA* (``F.scaled_dot_product_attention`` over K/V already
  decompressed per head: the attention alone, decompression not charged to it; skipped when
  the expanded K/V would exceed ~1.5 GB); and the op itself in batch-invariant mode (keys
  split at fixed positions, always merged: its cost).
- ``merge_attn_states`` T=4096, H=16, D=128: bytes = both inputs + output (+ LSEs); judged
  against memory bandwidth. Baseline: the same formula in eager PyTorch.
- ``varlen_attention`` causal prefill of one 1024-token sequence (P+R=192, V=128): flops over
  the causal pairs only, ``H*T*(T+1)/2*(P+R+V)*2``. Baselines: torch SDPA with the rope key
  expanded (math kernel, V=128) and with V zero-padded to 192 (flash kernel).

- the absorbed path of a causal prefill of one 1024-token sequence (what batch-invariant mode
  runs for every span): ``mla_attention_paged`` (flops over the causal pairs,
  ``H*T*(T+1)/2*(2*Lkv+R)*2``) and the two ``batched_matmul`` per-head products, each also in
  batch-invariant mode (its cost).

fp32 runs on the portable (scalar) path of the attention core, so fp32 cases are a subset.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F

import mlafx.kernels as K
from bench.kernel_cases.row import Row, make_row
from bench.roofline import Roofline, median_seconds

H, LKV, R, P, V = 16, 512, 64, 128, 128
W = LKV + R
SCALE = (P + R) ** -0.5
_MAX_BASELINE_BYTES = 1.5e9
sdpa = F.scaled_dot_product_attention


def _paged_decode(batch: int, ctx: int, block_size: int, dtype: torch.dtype):
    blocks = math.ceil(ctx / block_size)
    num_blocks = 1 + batch * blocks
    cache = torch.randn(num_blocks, block_size, W).to(dtype)
    table = (1 + torch.randperm(batch * blocks)).view(batch, blocks).to(torch.int32)
    q = torch.randn(batch, H, W).to(dtype)
    kv_lens = torch.full((batch,), ctx, dtype=torch.int32)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    positions = torch.full((batch,), ctx - 1, dtype=torch.int64)
    j = torch.arange(ctx)
    slots = table[:, j // block_size].long() * block_size + j % block_size  # [B, ctx]
    return q, cache, table, kv_lens, qsl, positions, slots


def _absorbed_eager(q, cache, slots):
    rows = cache.view(-1, W)[slots]  # [B, L, W]
    scores = torch.bmm(q, rows.transpose(1, 2)).float() * SCALE  # [B, H, L]
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.bmm(probs, rows[..., :LKV])


def decode_rows(roofline, quick, threads) -> list[Row]:
    rows = []
    if quick:
        grid = [(torch.bfloat16, 16, 8, 4096), (torch.bfloat16, 16, 1, 128),
                (torch.bfloat16, 64, 1, 16384), (torch.float32, 16, 1, 512)]  # fmt: skip
    else:
        grid = [
            (dtype, bs, b, ctx)
            for dtype in (torch.bfloat16, torch.float32)
            for bs in (16, 64)
            for b in (1, 8, 32)
            for ctx in (128, 512, 4096, 16384)
            if dtype == torch.bfloat16 or (bs == 16 and b <= 8 and ctx <= 4096)
            if ctx != 128 or b == 1
        ]
    for dtype, bs, b, ctx in grid:
        q, cache, table, kv_lens, qsl, positions, slots = _paged_decode(b, ctx, bs, dtype)
        elem = cache.element_size()
        num_bytes = b * ctx * W * elem + b * H * (W + LKV) * elem
        flops = b * H * ctx * (2 * LKV + R) * 2
        sdpa = None
        if b * H * ctx * (P + R + V) * elem < _MAX_BASELINE_BYTES and not quick:
            k = torch.randn(b, H, ctx, P + R).to(dtype)
            v = torch.randn(b, H, ctx, V).to(dtype)
            qd = torch.randn(b, H, 1, P + R).to(dtype)
            sdpa = (qd, k, v)
        for t in threads:
            torch.set_num_threads(t)
            attend = partial(
                K.mla_attention_paged, q, cache, table, kv_lens, qsl, positions, SCALE, LKV
            )
            ours = median_seconds(attend)
            with K.batch_invariant_mode(True):
                invariant = median_seconds(attend)
            baselines = {
                "absorbed-eager": median_seconds(partial(_absorbed_eager, q, cache, slots)),
                "batch-invariant": invariant,
            }
            if sdpa is not None:
                baselines["sdpa-decomp"] = median_seconds(
                    partial(F.scaled_dot_product_attention, *sdpa, scale=SCALE)
                )
            rows.append(
                make_row(
                    roofline,
                    op="mla_attention_paged",
                    case=f"decode B={b} ctx={ctx} bs={bs}",
                    dtype=dtype,
                    threads=t,
                    seconds=ours,
                    num_bytes=num_bytes,
                    flops=flops,
                    baselines_s=baselines,
                )
            )
    return rows


def merge_rows(roofline, quick, threads) -> list[Row]:
    rows = []
    t_len, d = (1024 if quick else 4096), 128
    for dtype in (torch.bfloat16, torch.float32):
        po, so = torch.randn(t_len, H, d).to(dtype), torch.randn(t_len, H, d).to(dtype)
        pl, sl = torch.randn(H, t_len), torch.randn(H, t_len)

        def eager(po=po, so=so, pl=pl, sl=sl):
            m = torch.maximum(pl, sl)
            wp, ws = torch.exp(pl - m), torch.exp(sl - m)
            s = wp + ws
            out = po * (wp / s).T[..., None] + so * (ws / s).T[..., None]
            return out.to(po.dtype), m + torch.log(s)

        num_bytes = 3 * t_len * H * d * po.element_size() + 3 * H * t_len * 4
        for t in threads:
            torch.set_num_threads(t)
            ours = median_seconds(
                lambda po=po, so=so, pl=pl, sl=sl: K.merge_attn_states(po, pl, so, sl)
            )
            rows.append(
                make_row(
                    roofline,
                    op="merge_attn_states",
                    case=f"T={t_len} H={H} D={d}",
                    dtype=dtype,
                    threads=t,
                    seconds=ours,
                    num_bytes=num_bytes,
                    flops=0,
                    baselines_s={"eager": median_seconds(eager)},
                )
            )
    return rows


def varlen_rows(roofline, quick, threads) -> list[Row]:
    rows = []
    n = 256 if quick else 1024
    for dtype in (torch.bfloat16, torch.float32):
        if quick and dtype == torch.float32:
            continue
        q = torch.randn(n, H, P + R).to(dtype)
        k_nope = torch.randn(n, H, P).to(dtype)
        k_pe = torch.randn(n, R).to(dtype)
        v = torch.randn(n, H, V).to(dtype)
        cu = torch.tensor([0, n], dtype=torch.int32)
        qh = q.transpose(0, 1)[None]
        kh = torch.cat([k_nope, k_pe[:, None].expand(n, H, R)], -1).transpose(0, 1)[None]
        vh = v.transpose(0, 1)[None]
        vpad = F.pad(vh, (0, P + R - V))
        pairs = n * (n + 1) // 2
        flops = H * pairs * (P + R + V) * 2
        num_bytes = (
            q.numel() + k_nope.numel() + k_pe.numel() + v.numel() + n * H * V
        ) * q.element_size()
        for t in threads:
            torch.set_num_threads(t)
            ours = median_seconds(
                partial(K.varlen_attention, q, k_nope, k_pe, v, cu, cu, SCALE, True)
            )
            baselines = {
                "sdpa-math": median_seconds(partial(sdpa, qh, kh, vh, is_causal=True, scale=SCALE)),
                "sdpa-padV": median_seconds(
                    partial(sdpa, qh, kh, vpad, is_causal=True, scale=SCALE)
                ),
            }
            rows.append(
                make_row(
                    roofline,
                    op="varlen_attention",
                    case=f"causal prefill T={n}",
                    dtype=dtype,
                    threads=t,
                    seconds=ours,
                    num_bytes=num_bytes,
                    flops=flops,
                    baselines_s=baselines,
                )
            )
    return rows


def absorbed_prefill_rows(roofline, quick, threads) -> list[Row]:
    """The absorbed path of a whole prefill, which batch-invariant mode gives every span: the
    per-head product q_nope W_UK, ``mla_attention_paged`` over the causal pairs and out W_UV^T,
    each in the default mode and in batch-invariant mode (its cost)."""
    rows = []
    n = 256 if quick else 1024
    dtype = torch.bfloat16
    blocks = n // 16
    cache = torch.randn(1 + blocks, 16, W).to(dtype)
    table = (1 + torch.arange(blocks, dtype=torch.int32))[None]
    q = torch.randn(n, H, W).to(dtype)
    kv_lens = torch.tensor([n], dtype=torch.int32)
    qsl = torch.tensor([0, n], dtype=torch.int32)
    positions = torch.arange(n)
    pairs = n * (n + 1) // 2
    products = {  # name -> (x [H, n, K], w [H, K, N])
        f"batched_matmul q_nope W_UK T={n}": (torch.randn(H, n, P), torch.randn(H, P, LKV)),
        f"batched_matmul out W_UV^T T={n}": (torch.randn(H, n, LKV), torch.randn(H, LKV, V)),
    }
    for t in threads:
        torch.set_num_threads(t)
        attend = partial(
            K.mla_attention_paged, q, cache, table, kv_lens, qsl, positions, SCALE, LKV
        )
        cases = [("mla_attention_paged", f"absorbed causal prefill T={n}", attend,
                  n * W * 2 + n * H * (W + LKV) * 2, H * pairs * (2 * LKV + R) * 2)]  # fmt: skip
        for case, (x, w) in products.items():
            x, w = x.to(dtype), w.to(dtype)
            num_bytes = (x.numel() + w.numel() + H * n * w.shape[2]) * 2
            flops = 2 * H * n * x.shape[2] * w.shape[2]
            cases.append(("batched_matmul", case.split(" ", 1)[1], partial(K.batched_matmul, x, w),
                          num_bytes, flops))  # fmt: skip
        for op, case, call, num_bytes, flops in cases:
            ours = median_seconds(call)
            with K.batch_invariant_mode(True):
                invariant = median_seconds(call)
            rows.append(
                make_row(
                    roofline,
                    op=op,
                    case=case,
                    dtype=dtype,
                    threads=t,
                    seconds=ours,
                    num_bytes=num_bytes,
                    flops=flops,
                    baselines_s={"batch-invariant": invariant},
                )
            )
    return rows


def run(roofline: Roofline, *, quick: bool, threads: list[int]) -> list[Row]:
    with torch.inference_mode():
        return (
            decode_rows(roofline, quick, threads)
            + merge_rows(roofline, quick, threads)
            + varlen_rows(roofline, quick, threads)
            + absorbed_prefill_rows(roofline, quick, threads)
        )
