"""DeepSeek Sparse Attention decode (DeepSeek-V3.2 shapes): the indexer's top-k plus sparse
absorbed MLA against dense ``mla_attention_paged`` over the same latent cache.

Batch 8 decode, 16k and 64k cached tokens per sequence, block size 64, topk 2048; attention
H=128, Lkv=512, R=64 (bf16 latent cache, ~600 MB at 64k); indexer Hi=64 heads x Di=128
(bf16 index cache, 128 MB at 64k). Rows:
- ``dsa_indexer_topk``: bytes = the index cache rows read (+ q, weights), flops
  ``B*ctx*Hi*Di*2``; the summary line gives its bandwidth as a fraction of the roofline's
  read bandwidth (it streams the whole index cache once per step).
- ``mla_attention_sparse``: bytes = the selected rows, flops ``B*H*topk*(2*Lkv+R)*2``.
- ``dsa sparse step`` (indexer + sparse attention, as one decode step runs them): baseline
  *dense-paged* = ``mla_attention_paged`` over every cached token, so its speed-up column is
  the sparse step's gain (goal: >= 4x at 16k, >= 8x at 64k).
Peak RSS (``ru_maxrss``, the whole process so far) is printed after each context. The heavy
cases run at all threads only, with 3 repeats (the dense 64k step takes seconds on the
portable path). ``--quick``: 4k context, topk 512.
"""

from __future__ import annotations

import math
import resource
from functools import partial

import torch

import mlafx.kernels as K
from bench.kernel_cases.row import Row, make_row
from bench.roofline import Roofline, median_seconds

BATCH, H, LKV, R, HI, DI, BLOCK = 8, 128, 512, 64, 64, 128, 64
W = LKV + R
SCALE = 192**-0.5  # (P + R)^-0.5 with DeepSeek-V3's P = 128


def _decode_inputs(ctx: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    blocks = math.ceil(ctx / BLOCK)
    dtype = torch.bfloat16

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=dtype)

    return {
        "q": randn(BATCH, H, W),
        "kv_cache": randn(1 + BATCH * blocks, BLOCK, W),
        "q_idx": randn(BATCH, HI, DI),
        "weights": torch.rand(BATCH, HI, generator=gen) * HI**-0.5,
        "index_cache": randn(1 + BATCH * blocks, BLOCK, DI),
        "block_table": (1 + torch.randperm(BATCH * blocks, generator=gen))
        .view(BATCH, blocks)
        .to(torch.int32),
        "kv_lens": torch.full((BATCH,), ctx, dtype=torch.int32),
        "qsl": torch.arange(BATCH + 1, dtype=torch.int32),
        "positions": torch.full((BATCH,), ctx - 1, dtype=torch.int64),
    }


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def run(roofline: Roofline, *, quick: bool, threads: list[int]) -> list[Row]:
    contexts, topk = ([4096], 512) if quick else ([16384, 65536], 2048)
    repeats = {"repeats": 3, "warmup": 1}
    t = max(threads)
    torch.set_num_threads(t)
    gen = torch.Generator().manual_seed(0)
    rows: list[Row] = []
    with torch.inference_mode():
        for ctx in contexts:
            x = _decode_inputs(ctx, gen)
            paged = (x["block_table"], x["kv_lens"], x["qsl"])
            indexer = partial(
                K.dsa_indexer_topk, x["q_idx"], x["weights"], x["index_cache"], *paged,
                x["positions"], topk,
            )  # fmt: skip
            selected = indexer()
            sparse = partial(
                K.mla_attention_sparse, x["q"], x["kv_cache"], *paged, selected, SCALE, LKV
            )

            def step(indexer=indexer, x=x, paged=paged):
                chosen = indexer()
                return K.mla_attention_sparse(x["q"], x["kv_cache"], *paged, chosen, SCALE, LKV)

            dense = partial(
                K.mla_attention_paged, x["q"], x["kv_cache"], *paged, x["positions"], SCALE, LKV
            )
            t_index = median_seconds(indexer, **repeats)
            t_sparse = median_seconds(sparse, **repeats)
            t_step = median_seconds(step, **repeats)
            t_dense = median_seconds(dense, **repeats)
            elem = 2
            index_bytes = BATCH * ctx * DI * elem
            attn_bytes = BATCH * topk * W * elem + BATCH * H * (W + LKV) * elem
            case = f"decode B={BATCH} ctx={ctx} topk={topk}"
            common = {"dtype": torch.bfloat16, "threads": t}
            rows += [
                make_row(roofline, op="dsa_indexer_topk", case=case, seconds=t_index,
                         num_bytes=index_bytes + BATCH * HI * (DI * elem + 4),
                         flops=BATCH * ctx * HI * DI * 2, **common),
                make_row(roofline, op="mla_attention_sparse", case=case, seconds=t_sparse,
                         num_bytes=attn_bytes, flops=BATCH * H * topk * (2 * LKV + R) * 2,
                         **common),
                make_row(roofline, op="dsa sparse step", case=case, seconds=t_step,
                         num_bytes=index_bytes + attn_bytes,
                         flops=BATCH * (ctx * HI * DI + H * topk * (2 * LKV + R)) * 2,
                         baselines_s={"dense-paged": t_dense}, **common),
            ]  # fmt: skip
            print(
                f"dsa ctx={ctx}: sparse step {t_step * 1e3:.1f} ms (indexer "
                f"{t_index * 1e3:.1f} + attention {t_sparse * 1e3:.1f}) vs dense "
                f"{t_dense * 1e3:.1f} ms = {t_dense / t_step:.2f}x; indexer "
                f"{index_bytes / t_index / 1e9:.2f} GB/s over the index cache = "
                f"{index_bytes / t_index / 1e9 / roofline.read_gbps:.1%} of "
                f"{roofline.read_gbps:.1f} GB/s read; peak RSS {_peak_rss_mb():.0f} MB",
                flush=True,
            )
            del x, selected, indexer, sparse, step, dense
    return rows
