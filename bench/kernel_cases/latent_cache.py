"""write_latent_cache: T new latent rows cast and scattered into the paged cache.

Bytes: the rows read (input dtype) plus the rows written (cache dtype); no flops.
Baseline: ``cat`` + ``.to`` + ``index_copy_`` in eager PyTorch.
"""

from __future__ import annotations

from functools import partial

import torch

import mlafx.kernels as K
from bench.kernel_cases.row import Row, make_row
from bench.roofline import Roofline, median_seconds


def _eager_write(kv_c, k_pe, flat_cache, slots):
    flat_cache.index_copy_(0, slots, torch.cat([kv_c, k_pe], -1).to(flat_cache.dtype))


def run(roofline: Roofline, *, quick: bool, threads: list[int]) -> list[Row]:
    rows = []
    lkv, r, block_size = 512, 64, 16
    num_tokens = 256 if quick else 4096
    for in_dtype in (torch.float32, torch.bfloat16):
        kv_c = torch.randn(num_tokens, lkv).to(in_dtype)
        k_pe = torch.randn(num_tokens, r).to(in_dtype)
        num_blocks = num_tokens // block_size * 2
        cache = torch.zeros(num_blocks, block_size, lkv + r, dtype=torch.bfloat16)
        slots = torch.randperm(num_blocks * block_size)[:num_tokens]
        flat = cache.view(-1, lkv + r)
        for t in threads:
            torch.set_num_threads(t)
            ours = median_seconds(partial(K.write_latent_cache, kv_c, k_pe, cache, slots))
            naive = median_seconds(partial(_eager_write, kv_c, k_pe, flat, slots))
            moved = num_tokens * (lkv + r) * (kv_c.element_size() + cache.element_size())
            rows.append(
                make_row(
                    roofline,
                    op="write_latent_cache",
                    case=f"T={num_tokens} -> bf16 bs={block_size}",
                    dtype=in_dtype,
                    threads=t,
                    seconds=ours,
                    num_bytes=moved,
                    flops=0,
                    baselines_s={"eager": naive},
                )
            )
    return rows
