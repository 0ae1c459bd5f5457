"""DeepSeek-V4-Flash decode attention (the indexer's top-k and ``mlafx.kernels.
v4_sparse_attention``: ``v4_attention``, one pass over the window rows and pool entries with the
sink) against DeepSeek-V3's dense latent attention (``mla_attention_paged``) at the same
context, and each V4 layer against the two-pass form (*two-pass*: a ``mla_attention_sparse``
pass per cache, ``merge_attn_states``, the sink as ``out * sigmoid(lse - sink)`` in torch).

V4-Flash's shapes are ``DeepseekV4Config``'s defaults (transformers' too): 43 layers, 20 CSA
and 23 HCA, 64 heads of one 512-wide K=V row, a window of 128 rows; CSA pools one entry per 4
tokens and its indexer (64 heads x 128) keeps the top 512; HCA pools one per 128 and reads them
all. V3: 61 layers, 128 heads over 576-wide latent rows. bf16, block size 64, batch 1 and 8,
16k and 128k cached tokens. Rows per layer kind, then per step (V4: 20 CSA + 23 HCA layer
times; baseline *v3-dense*: 61 V3 layer times), bytes being what each reads:
- ``v4 csa layer``: the indexer over ctx/4 entries (its 128-wide keys), 512 selected entries
  and the 128 window rows;
- ``v4 hca layer``: ctx/128 entries and the 128 window rows;
- ``v3 dense layer``: every cached 576-wide row.
Only the caches' read parts are real memory (the window's last blocks; the pools whole); the
block tables point every other window block at one shared block. The pools are laid out as
plain paged caches of 16 entries per block, as a compiled path would keep them. ``--quick``:
4k context, batch 1 and 2.
"""

from __future__ import annotations

import math
import resource
from functools import partial

import torch

import mlafx.kernels as K
from bench.kernel_cases.row import Row, make_row
from bench.roofline import Roofline, median_seconds
from mlafx.config.deepseek_v4 import CSA, HCA, DeepseekV4Config
from mlafx.kernels.v4_attention import v4_sparse_attention

BLOCK, POOL_BLOCK = 64, 16
V3_LAYERS, V3_HEADS, V3_LKV, V3_R = 61, 128, 512, 64
ELEM = 2  # bf16


def _two_pass(q, qsl, window_cache, window_table, window_lens, window_selected, sinks, scale,
              pool):  # fmt: skip
    """The baseline: the window and pool as two sparse passes, merged, the sink in torch."""
    width = q.shape[-1]
    out, lse = K.mla_attention_sparse(q, window_cache, window_table, window_lens, qsl,
                                      window_selected, scale, width)  # fmt: skip
    pool_out, pool_lse = K.mla_attention_sparse(q, pool[0], pool[1], pool[2], qsl, pool[3],
                                                scale, width)  # fmt: skip
    out, lse = K.merge_attn_states(pool_out, pool_lse, out, lse)
    keep = torch.sigmoid(lse - sinks[:, None])
    return (out.float() * keep.T[..., None]).to(q.dtype)


def _paged(batch: int, entries: int, width: int, block: int, gen: torch.Generator):
    """A cache holding ``entries`` random rows per sequence, its block table and lengths."""
    blocks = max(1, math.ceil(entries / block))
    cache = torch.randn(1 + batch * blocks, block, width, generator=gen, dtype=torch.bfloat16)
    table = (1 + torch.randperm(batch * blocks, generator=gen)).view(batch, blocks)
    return cache, table.to(torch.int32), torch.full((batch,), entries, dtype=torch.int32)


def _window(batch: int, ctx: int, width: int, window: int, gen: torch.Generator):
    """A token cache of ``ctx`` rows per sequence whose last ``window`` rows are real."""
    blocks, tail = math.ceil(ctx / BLOCK), math.ceil(window / BLOCK) + 1
    cache = torch.randn(1 + batch * tail, BLOCK, width, generator=gen, dtype=torch.bfloat16)
    table = torch.zeros(batch, blocks, dtype=torch.int32)
    for b in range(batch):
        table[b, blocks - tail :] = torch.arange(1 + b * tail, 1 + (b + 1) * tail)
    selected = torch.arange(ctx - window, ctx).expand(batch, window).contiguous()
    return cache, table, torch.full((batch,), ctx, dtype=torch.int32), selected


def _cases(cfg: DeepseekV4Config, batch: int, ctx: int, gen: torch.Generator):
    """Zero-argument calls: one V4 CSA layer, one V4 HCA layer, one V3 layer."""
    h, c, w = cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    q = torch.randn(batch, h, c, generator=gen, dtype=torch.bfloat16)
    sinks = torch.randn(h, generator=gen)
    window = _window(batch, ctx, c, w, gen)
    scale = c**-0.5
    csa_entries, hca_entries = ctx // cfg.csa_compress_rate, ctx // cfg.hca_compress_rate
    csa_pool = _paged(batch, csa_entries, c, POOL_BLOCK, gen)
    index_pool = _paged(batch, csa_entries, cfg.index_head_dim, POOL_BLOCK, gen)
    q_idx = torch.randn(batch, cfg.index_n_heads, cfg.index_head_dim, generator=gen,
                        dtype=torch.bfloat16)  # fmt: skip
    weights = torch.rand(batch, cfg.index_n_heads, generator=gen) * cfg.index_n_heads**-0.5
    last_entry = torch.full((batch,), csa_entries - 1, dtype=torch.int64)
    hca_pool = _paged(batch, hca_entries, c, POOL_BLOCK, gen)
    every_entry = torch.arange(hca_entries).expand(batch, hca_entries).contiguous()

    def csa(attend=v4_sparse_attention) -> torch.Tensor:
        chosen = K.dsa_indexer_topk(q_idx, weights, index_pool[0], index_pool[1], index_pool[2],
                                    qsl, last_entry, cfg.index_topk)  # fmt: skip
        return attend(q, qsl, *window, sinks, scale, (*csa_pool, chosen))

    def hca(attend=v4_sparse_attention) -> torch.Tensor:
        return attend(q, qsl, *window, sinks, scale, (*hca_pool, every_entry))

    v3_q = torch.randn(batch, V3_HEADS, V3_LKV + V3_R, generator=gen, dtype=torch.bfloat16)
    latent = _paged(batch, ctx, V3_LKV + V3_R, BLOCK, gen)
    positions = torch.full((batch,), ctx - 1, dtype=torch.int64)

    def v3() -> tuple[torch.Tensor, torch.Tensor]:
        return K.mla_attention_paged(v3_q, *latent, qsl, positions, (V3_LKV + V3_R) ** -0.5,
                                     V3_LKV)  # fmt: skip

    return csa, hca, v3


def run(roofline: Roofline, *, quick: bool, threads: list[int]) -> list[Row]:
    cfg = DeepseekV4Config.from_hf_dict({"model_type": "deepseek_v4"})  # V4-Flash's shapes
    num_csa, num_hca = cfg.layer_types.count(CSA), cfg.layer_types.count(HCA)
    h, c, w = cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window
    contexts, batches = ([4096], [1, 2]) if quick else ([16384, 131072], [1, 8])
    t = max(threads)
    torch.set_num_threads(t)
    gen = torch.Generator().manual_seed(0)
    rows: list[Row] = []
    common = {"dtype": torch.bfloat16, "threads": t}
    with torch.inference_mode():
        for ctx in contexts:
            for batch in batches:
                csa, hca, v3 = _cases(cfg, batch, ctx, gen)
                # V4's layers take 0.1-7 ms: the median of 15 runs each (the V3 layer's of 3)
                t_csa, t_csa2, t_hca, t_hca2 = (
                    median_seconds(f, repeats=15, warmup=2)
                    for f in (csa, partial(csa, _two_pass), hca, partial(hca, _two_pass))
                )
                t_v3 = median_seconds(v3, repeats=3, warmup=1)
                window_bytes = batch * w * c * ELEM
                csa_entries = ctx // cfg.csa_compress_rate
                csa_bytes = window_bytes + batch * ELEM * (
                    csa_entries * cfg.index_head_dim + cfg.index_topk * c
                )
                hca_bytes = window_bytes + batch * ctx // cfg.hca_compress_rate * c * ELEM
                v3_bytes = batch * ctx * (V3_LKV + V3_R) * ELEM
                attn_flops = 2 * 2 * batch * h * c  # q.k and p.v per key
                csa_flops = (
                    attn_flops * (w + cfg.index_topk)
                    + 2 * batch * csa_entries * cfg.index_n_heads * cfg.index_head_dim
                )
                hca_flops = attn_flops * (w + ctx // cfg.hca_compress_rate)
                v3_flops = 2 * batch * V3_HEADS * ctx * (2 * V3_LKV + V3_R)
                case = f"decode B={batch} ctx={ctx}"
                v4_step = num_csa * t_csa + num_hca * t_hca
                v4_bytes = num_csa * csa_bytes + num_hca * hca_bytes
                v3_step = V3_LAYERS * t_v3
                rows += [
                    make_row(roofline, op="v4 csa layer", case=case, seconds=t_csa,
                             num_bytes=csa_bytes, flops=csa_flops,
                             baselines_s={"two-pass": t_csa2}, **common),
                    make_row(roofline, op="v4 hca layer", case=case, seconds=t_hca,
                             num_bytes=hca_bytes, flops=hca_flops,
                             baselines_s={"two-pass": t_hca2}, **common),
                    make_row(roofline, op="v3 dense layer", case=case, seconds=t_v3,
                             num_bytes=v3_bytes, flops=v3_flops, **common),
                    make_row(roofline, op="v4-flash step attention", case=case,
                             seconds=v4_step, num_bytes=v4_bytes,
                             flops=num_csa * csa_flops + num_hca * hca_flops,
                             baselines_s={"v3-dense": v3_step}, **common),
                ]  # fmt: skip
                peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
                print(
                    f"v4 B={batch} ctx={ctx}: a step's attention {v4_step * 1e3:.1f} ms "
                    f"({num_csa} CSA x {t_csa * 1e3:.2f} + {num_hca} HCA x {t_hca * 1e3:.2f}) "
                    f"vs V3's {v3_step * 1e3:.1f} ms ({V3_LAYERS} x {t_v3 * 1e3:.2f}) = "
                    f"{v3_step / v4_step:.1f}x; reads {v4_bytes / 1e6:.1f} vs "
                    f"{V3_LAYERS * v3_bytes / 1e6:.0f} MB; two-pass layers {t_csa2 * 1e3:.2f} / "
                    f"{t_hca2 * 1e3:.2f} ms; peak RSS {peak:.0f} MB",
                    flush=True,
                )
                del csa, hca, v3
    return rows
