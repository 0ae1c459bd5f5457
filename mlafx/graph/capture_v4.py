"""Capture one DeepSeek-V4 decoder layer as a step function (``V4LayerStep``): the unit the
compiled V4 step (``compile/v4_compiled_step.py``) builds one AOTInductor package for per
layer kind and runs for every layer of that kind.

Its inputs are flat tensors: the residual streams, the token ids (hash MoE), the layer's
caches (``DeepseekV4Config.layer_cache_widths`` order, written in place) and the leaves of
the step's sparse metadata that the layer reads (``v4_layer_leaves``): the attention runs
on mlafx's ops (``V4Attention.sparse_attention``), never the dense reference. Dynamic
extents (named ``Dim``s):

    T   new tokens          x, input_ids, positions, slot_mapping, window, last_visible
    B   sequences           block_table, kv_lens, pool_lens; B+1 for query_start_loc
    M   token block-table columns;  MP  pool block-table columns
    N   pool entries closing        close_*
    E   visible pool entries (HCA)  visible
    NT  token cache blocks (the window rows' and compressor inputs' first dim)
    NB  pool cache blocks (the pools' first dim: the engine's block ids; with the token rows
        in blocks of their own, ``runtime/token_rows.py``, NT and NB differ)

As for MLA layers (``capture.py``), routed experts are recorded as one experts op
(``mlafx::moe_experts`` with the SwiGLU clamp; the quantized V4 modules already call theirs),
and each compressor's window close as ``mlafx::v4_compress_pool``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import cast

import torch
from torch import nn
from torch.export import Dim, ExportedProgram

from mlafx.config.deepseek_v4 import HCA, DeepseekV4Config, pool_rows_per_block
from mlafx.graph.capture import methods_replaced, size_oblivious
from mlafx.models.deepseek_v4.compressor import PoolCompressor
from mlafx.models.deepseek_v4.model import DeepseekV4ForCausalLM, V4DecoderLayer
from mlafx.models.deepseek_v4.moe import ClampedExperts
from mlafx.models.deepseek_v4.sparse_step import SparsePool, SparseStep
from mlafx.models.deepseek_v4.step import PoolStep, SequenceStep, V4StepMetadata, v4_step_metadata
from mlafx.models.rope import rope_cos_sin


def v4_layer_leaves(meta: V4StepMetadata, rate: int, kind: str) -> list[torch.Tensor]:
    """The metadata tensors a layer of compression rate ``rate`` (0: sliding) and type
    ``kind`` reads, in ``V4LayerStep``'s order: the step's (positions, slots, the token block
    table and lengths, window positions), then on a compressed layer its pool's (closing
    entries, paged table, lengths, last visible entries) and on an HCA layer every visible
    entry (made once per step: ``SparsePool.visible`` is cached)."""
    sparse = meta.sparse
    if sparse is None:
        raise ValueError("a compiled V4 layer runs on the sparse step metadata (sparse=True)")
    leaves = [
        meta.positions, meta.slot_mapping, sparse.query_start_loc, sparse.block_table,
        sparse.kv_lens, sparse.window,
    ]  # fmt: skip
    if rate:
        pool, paged = meta.pool(rate), sparse.pools[rate]
        leaves += [
            pool.close_slots, pool.close_sources, pool.close_has_previous, pool.close_positions,
            paged.table, paged.lens, paged.last_visible,
        ]  # fmt: skip
        if kind == HCA:
            leaves.append(paged.visible)
    return leaves


def _metadata(rate: int, leaves: Sequence[torch.Tensor]) -> V4StepMetadata:
    """``v4_layer_leaves``' inverse: the step metadata a layer's forward reads (the dense
    path's fields empty)."""
    positions, slot_mapping, query_start_loc, block_table, kv_lens, window = leaves[:6]
    none = positions.new_empty(0)
    pools: tuple[PoolStep, ...] = ()
    paged: dict[int, SparsePool] = {}
    if rate:
        slots, sources, has_previous, close_positions, table, lens, last_visible = leaves[6:13]
        pools = (PoolStep(rate, slots, sources, has_previous, close_positions, none, none, none),)
        paged = {rate: SparsePool(table, lens, last_visible)}
        if len(leaves) > 13:  # HCA: its visible entries, given (cached_property's slot)
            paged[rate].__dict__["visible"] = leaves[13]
    sparse = SparseStep(query_start_loc, block_table, kv_lens, window, paged)
    return V4StepMetadata(positions, slot_mapping, none, none, none, none, pools, sparse)


class V4LayerStep(nn.Module):
    """One V4 decoder layer as a step function:

        (x [T, hc_mult, D], input_ids [T], caches (mutated), v4_layer_leaves) -> x

    Its parameters are the layer's, named ``layer.*``."""

    def __init__(self, layer: V4DecoderLayer, cfg: DeepseekV4Config, index: int) -> None:
        super().__init__()
        self.layer = layer
        self.rate = cfg.compress_rate(index)

    def forward(
        self,
        x: torch.Tensor,
        input_ids: torch.Tensor,
        caches: list[torch.Tensor],
        leaves: list[torch.Tensor],
    ) -> torch.Tensor:
        return self.layer(x, input_ids, caches, _metadata(self.rate, leaves))


def layer_dynamic_shapes(cfg: DeepseekV4Config, index: int) -> dict[str, object]:
    """``V4LayerStep``'s dynamic extents for layer ``index`` (module docstring)."""
    rate, kind = cfg.compress_rate(index), cfg.layer_types[index]
    tokens, pools = cfg.layer_cache_widths(index)
    t, b, m, nt, nb = Dim("T"), Dim("B"), Dim("M"), Dim("NT"), Dim("NB")
    leaves: list[object] = [{0: t}, {0: t}, {0: b + 1}, {0: b, 1: m}, {0: b}, {0: t}]
    if rate:
        n, mp = Dim("N"), Dim("MP")
        leaves += [{0: n}, {0: n}, {0: n}, {0: n}, {0: b, 1: mp}, {0: b}, {0: t}]
        if kind == HCA:
            leaves.append({0: t, 1: Dim("E")})
    caches = [{0: nt}] * len(tokens) + [{0: nb}] * len(pools)
    return {"x": {0: t}, "input_ids": {0: t}, "caches": caches, "leaves": leaves}


def sample_sequences(cfg: DeepseekV4Config, block_size: int) -> list[SequenceStep]:
    """A sample step of three sequences: a prefill chunk after a context, a decode and a fresh
    prompt, long enough that every pool has entries closing and visible. Block ids are
    distinct and above 0 (``sample_blocks`` caches), and the token rows in blocks of their own
    (two more of them: the token caches' extent is not the pools')."""
    rate = max(cfg.compress_rates, default=1)
    spans = [(3 * rate + 1, 2 * rate + 3), (5 * rate + 2, 1), (0, 3 * rate + 1)]
    seqs, next_block = [], 1
    for context, new in spans:
        blocks = -(-(context + new) // block_size)
        ids = list(range(next_block, next_block + blocks))
        seqs.append(SequenceStep(context, new, ids, [b + 2 for b in ids]))
        next_block += blocks
    return seqs


def sample_blocks(seqs: Sequence[SequenceStep]) -> tuple[int, int]:
    """(token blocks, pool blocks) of the sample caches."""
    return 1 + max(max(s.token_blocks) for s in seqs), 1 + max(max(s.block_table) for s in seqs)


def sample_layer_args(model: DeepseekV4ForCausalLM, index: int, block_size: int) -> tuple:
    """``V4LayerStep``'s sample inputs for layer ``index``: the sample step, random streams
    and token ids, zeroed caches (model dtype)."""
    cfg = model.config
    seqs = sample_sequences(cfg, block_size)
    meta = v4_step_metadata(
        seqs, block_size, cfg.sliding_window, cfg.compress_rates, sparse=True,
        overlapping_rates=cfg.overlapping_rates,
    )  # fmt: skip
    tokens = int(meta.positions.shape[0])
    gen = torch.Generator().manual_seed(index)
    x = torch.randn(tokens, cfg.hc_mult, cfg.hidden_size, generator=gen).to(model.dtype)
    input_ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=gen)
    token_blocks, pool_blocks = sample_blocks(seqs)
    tokens_widths, pool_widths = cfg.layer_cache_widths(index)
    rate = cfg.compress_rate(index)
    caches = [torch.zeros(token_blocks, block_size, w, dtype=model.dtype) for w in tokens_widths]
    if pool_widths:
        rows = pool_rows_per_block(rate, block_size)
        caches += [torch.zeros(pool_blocks, rows, w, dtype=model.dtype) for w in pool_widths]
    leaves = v4_layer_leaves(meta, rate, cfg.layer_types[index])
    return (x, input_ids, caches, leaves)


def _clamped_experts_forward(self, x, topk_ids, topk_weights):  # type: ignore[no-untyped-def]
    return torch.ops.mlafx.moe_experts(
        x, topk_ids, topk_weights, self.gate_up_proj, self.down_proj, self.limit
    )


def _compressor_close(self, rows, pool_cache, pool, rope):  # type: ignore[no-untyped-def]
    cos, sin = rope_cos_sin(pool.close_positions, rope.inv_freq, rope.scale)
    torch.ops.mlafx.v4_compress_pool(
        rows, pool.close_sources, pool.close_has_previous, self.position_bias.float(),
        self.kv_norm.weight.float(), self.kv_norm.eps, cos, sin, self.overlap, pool_cache,
        pool.close_slots,
    )  # fmt: skip


@contextlib.contextmanager
def v4_kernels_as_custom_ops() -> Iterator[None]:
    """Within this block V4's routed experts (``ClampedExperts``: a data-dependent grouping
    that does not trace) run ``mlafx::moe_experts`` with the SwiGLU clamp, and its compressors
    close their windows with ``mlafx::v4_compress_pool`` (``PoolCompressor.close``'s
    arithmetic in one pass over the window's cached rows)."""
    import mlafx.kernels  # noqa: F401  (registers the ops and their fakes)

    with methods_replaced(
        (ClampedExperts, "forward", _clamped_experts_forward),
        (PoolCompressor, "close", _compressor_close),
    ):
        yield


def capture_v4_layer(
    model: DeepseekV4ForCausalLM, index: int, block_size: int
) -> tuple[ExportedProgram, tuple]:
    """Layer ``index`` of ``model`` as an ExportedProgram (dynamic extents), with the sample
    inputs it was traced with."""
    cfg = model.config
    step = V4LayerStep(cast(V4DecoderLayer, model.model.layers[index]), cfg, index)
    args = sample_layer_args(model, index, block_size)
    dynamic = layer_dynamic_shapes(cfg, index)
    with v4_kernels_as_custom_ops(), size_oblivious(), torch.no_grad():
        program = torch.export.export(step, args, dynamic_shapes=dynamic, strict=False)
    return program, args
