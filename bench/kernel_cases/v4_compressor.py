"""DeepSeek-V4's compressor at a window close (``mlafx.kernels.v4_compress_pool``) against the
model's ``PoolCompressor.close`` run eagerly and compiled by inductor (``torch.compile``: what
a compiled V4 layer ran before the op).

V4-Flash's shapes (``DeepseekV4Config``'s defaults): the CSA pool (512 wide, windows of 4, two
overlapping series: rows of 2048), the CSA indexer's keys (128 wide, same windows) and the HCA
pool (512 wide, windows of 128: rows of 1024); bf16, block size 64. Cases: the entries one
512-token prefill chunk closes (128, 128 and 4) and a decode step's single entry. Bytes: the
window rows each entry reads (the half of each row its series uses) and the entries written.
"""

from __future__ import annotations

import functools

import torch

from bench.kernel_cases.row import Row, make_row
from bench.roofline import Roofline, median_seconds
from mlafx.config.deepseek_v4 import DeepseekV4Config
from mlafx.kernels import v4_compress_pool
from mlafx.models.deepseek_v4.compressor import PoolCompressor
from mlafx.models.deepseek_v4.rope import V4RotaryEmbedding
from mlafx.models.deepseek_v4.step import PoolStep
from mlafx.models.rope import rope_cos_sin

BLOCK, ELEM = 64, 2


def _pool_step(entries: int, rate: int, gen: torch.Generator) -> PoolStep:
    first = 5  # windows 5 .. 5 + entries - 1: every one has a window before it
    tokens = torch.arange((first - 1) * rate, (first + entries) * rate)
    slots = tokens + BLOCK  # block 0 unused
    sources = torch.stack(
        [torch.cat([slots[w * rate : (w + 1) * rate], slots[(w + 1) * rate : (w + 2) * rate]])
         for w in range(entries)]
    )  # fmt: skip
    empty = torch.zeros(0, dtype=torch.int64)
    return PoolStep(
        rate, torch.randperm(entries, generator=gen), sources,
        torch.ones(entries, dtype=torch.bool),
        (first + torch.arange(entries)) * rate, empty, empty, empty,
    )  # fmt: skip


def _op(comp, rows, pool, step, rope) -> None:  # type: ignore[no-untyped-def]
    cos, sin = rope_cos_sin(step.close_positions, rope.inv_freq, rope.scale)
    v4_compress_pool(
        rows, step.close_sources, step.close_has_previous, comp.position_bias.detach().float(),
        comp.kv_norm.weight.detach(), comp.kv_norm.eps, cos, sin, comp.overlap, pool,
        step.close_slots,
    )  # fmt: skip


def _cases(cfg: DeepseekV4Config) -> list[tuple[str, int, int, bool]]:
    """(name, width c, rate, overlap) of V4-Flash's three compressors."""
    return [
        ("csa pool", cfg.head_dim, cfg.csa_compress_rate, True),
        ("csa indexer keys", cfg.index_head_dim, cfg.csa_compress_rate, True),
        ("hca pool", cfg.head_dim, cfg.hca_compress_rate, False),
    ]


def run(roofline: Roofline, *, quick: bool, threads: list[int]) -> list[Row]:
    cfg = DeepseekV4Config.from_hf_dict({"model_type": "deepseek_v4"})  # V4-Flash's shapes
    t = max(threads)
    torch.set_num_threads(t)
    gen = torch.Generator().manual_seed(0)
    rope = V4RotaryEmbedding(cfg.compress_rope, cfg.qk_rope_head_dim)
    rows_out: list[Row] = []
    chunk = 128 if quick else 512
    for name, c, rate, overlap in _cases(cfg):
        comp = PoolCompressor(cfg, c, rate, overlap).to(torch.bfloat16)
        with torch.no_grad():
            comp.position_bias.copy_(torch.randn(comp.position_bias.shape, generator=gen))
        comp.kv_norm.weight.data = comp.kv_norm.weight.data.float()
        compiled_close = torch.compile(comp.close, dynamic=True)
        for entries in (max(1, chunk // rate), 1):
            step = _pool_step(entries, rate, gen)
            tokens = int(step.close_sources.max()) + 1
            rows = torch.randn(-(-tokens // BLOCK), BLOCK, comp.input_width, generator=gen,
                               dtype=torch.bfloat16)  # fmt: skip
            pool = torch.zeros(entries, 1, c, dtype=torch.bfloat16)
            calls = {
                "op": functools.partial(_op, comp, rows, pool, step, rope),
                "eager": functools.partial(comp.close, rows, pool, step, rope),
                "inductor": functools.partial(compiled_close, rows, pool, step, rope),
            }
            with torch.no_grad():
                seconds = {k: median_seconds(f, repeats=5) for k, f in calls.items()}
            slots = 2 * rate if overlap else rate
            num_bytes = entries * (slots * 2 * c * ELEM + c * ELEM)  # kv + gate halves, entry
            flops = entries * slots * c * 6  # bias add, exp, weight, product, sum (approx.)
            rows_out.append(
                make_row(
                    roofline,
                    op=f"v4 compress {name}",
                    case=f"{entries} entries m={rate}",
                    dtype=torch.bfloat16,
                    threads=t,
                    seconds=seconds.pop("op"),
                    num_bytes=num_bytes,
                    flops=flops,
                    baselines_s=seconds,
                )  # fmt: skip
            )
    return rows_out
