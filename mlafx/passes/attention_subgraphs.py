"""Graph fragments the ``lower_attention`` pass emits for one MLA site: the absorbed pass over
the paged cache and the split (decompressed suffix + absorbed context, merged) path.

Symbols as in ``mlafx.models.attention``: H heads, Lkv latent width, R rope width, P/V the
nope/value head widths; ``W_UK`` [H, P, Lkv], ``W_UV^T`` [H, Lkv, V] (``absorb_weights``).
Every helper inserts nodes at the graph's current insertion point and returns the node(s)
holding its result; shape comments give the values' shapes.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch import fx

import mlafx.kernels  # noqa: F401  (registers the mlafx ops and their fakes)
from mlafx.passes.absorb_weights import AbsorbedWeights
from mlafx.passes.mla_site import MLASite

aten = torch.ops.aten
mlafx_ops = torch.ops.mlafx


@dataclass(frozen=True)
class Emitter:
    """Inserts the nodes of one site's lowering."""

    graph: fx.Graph
    site: MLASite
    weights: AbsorbedWeights

    def __call__(self, target: object, *args: object, **kwargs: object) -> fx.Node:
        return self.graph.call_function(target, args, kwargs)  # type: ignore[arg-type]

    def rows(self, tensor: fx.Node, index: fx.Node, dim: int = 0) -> fx.Node:
        """``tensor`` at host-built indices along ``dim`` (a sub-batch's rows)."""
        return self(aten.index_select.default, tensor, dim, index)

    def contiguous(self, tensor: fx.Node) -> fx.Node:
        # An explicit copy: views and reshapes of strided values would make export
        # specialise on extents of 1 (a decode-only step has one absorbed row).
        return self(aten.clone.default, tensor, memory_format=torch.contiguous_format)


def absorbed_attention(
    emit: Emitter,
    q_nope: fx.Node,  # [N, H, P]
    q_pe: fx.Node,  # [N, H, R]
    positions: fx.Node,  # [N] int64
    block_table: fx.Node,  # [B, M] int32
    kv_lens: fx.Node,  # [B] int32
    query_start_loc: fx.Node,  # [B + 1] int32
) -> tuple[fx.Node, fx.Node]:  # out [N, H, V], lse [H, N] fp32
    """q_lat = [q_nope W_UK | q_pe]; mla_attention_paged; out = out_lat W_UV^T."""
    site = emit.site
    attn = emit(
        mlafx_ops.mla_attention_paged.default,
        _absorbed_query(emit, q_nope, q_pe),  # [N, H, Lkv + R]
        site.cache,
        block_table,
        kv_lens,
        query_start_loc,
        positions,
        site.scale,
        site.kv_lora_rank,
    )
    return _values_out(emit, attn), emit(operator.getitem, attn, 1)


def sparse_attention(
    emit: Emitter,
    q_nope: fx.Node,  # [T, H, P]
    q_pe: fx.Node,  # [T, H, R]
    selected: fx.Node,  # [T, topk] int64 positions, -1 = none
    block_table: fx.Node,  # [B, M] int32
    kv_lens: fx.Node,  # [B] int32
    query_start_loc: fx.Node,  # [B + 1] int32
) -> tuple[fx.Node, fx.Node]:  # out [T, H, V], lse [H, T] fp32
    """DSA: q_lat as ``absorbed_attention``'s; mla_attention_sparse over each query's selected
    positions; out = out_lat W_UV^T."""
    site = emit.site
    attn = emit(
        mlafx_ops.mla_attention_sparse.default,
        _absorbed_query(emit, q_nope, q_pe),
        site.cache,
        block_table,
        kv_lens,
        query_start_loc,
        selected,
        site.scale,
        site.kv_lora_rank,
    )
    return _values_out(emit, attn), emit(operator.getitem, attn, 1)


def _absorbed_query(emit: Emitter, q_nope: fx.Node, q_pe: fx.Node) -> fx.Node:
    """[q_nope W_UK | q_pe] [N, H, Lkv + R]."""
    q_nope_h = emit(aten.transpose.int, q_nope, 0, 1)  # [H, N, P]
    q_lat = emit(mlafx_ops.batched_matmul.default, q_nope_h, emit.weights.w_uk)  # [H, N, Lkv]
    return emit(aten.cat.default, [emit(aten.transpose.int, q_lat, 0, 1), q_pe], -1)


def _values_out(emit: Emitter, attn: fx.Node) -> fx.Node:
    """The attention op's latent output [N, H, Lkv] times W_UV^T: [N, H, V], contiguous."""
    out_lat_h = emit(aten.transpose.int, emit(operator.getitem, attn, 0), 0, 1)  # [H, N, Lkv]
    out = emit(mlafx_ops.batched_matmul.default, out_lat_h, emit.weights.w_uv_t)  # [H, N, V]
    return emit.contiguous(emit(aten.transpose.int, out, 0, 1))


def decompressed_suffix(
    emit: Emitter,
    q_nope: fx.Node,  # [N, H, P]
    q_pe: fx.Node,  # [N, H, R]
    kv_c: fx.Node,  # [N, Lkv]  the same tokens' new latent rows
    k_pe: fx.Node,  # [N, R]
    cu_seqlens: fx.Node,  # [B + 1] int32, queries and keys alike
) -> tuple[fx.Node, fx.Node]:  # out [N, H, V], lse [H, N] fp32
    """k_nope | v = kv_b_proj(kv_c); causal varlen_attention of the new rows over themselves."""
    site = emit.site
    h, p, v = site.num_heads, site.qk_nope_head_dim, site.v_head_dim
    num_rows = emit(aten.sym_size.int, kv_c, 0)
    kv = emit(aten.linear.default, kv_c, site.kv_b_weight)  # [N, H*(P+V)]
    kv = emit(aten.view.default, kv, [num_rows, h, p + v])
    parts = emit(aten.split_with_sizes.default, kv, [p, v], -1)
    k_nope, value = emit(operator.getitem, parts, 0), emit(operator.getitem, parts, 1)
    query = emit(aten.cat.default, [q_nope, q_pe], -1)  # [N, H, P + R]
    attn = emit(
        mlafx_ops.varlen_attention.default,
        query,
        k_nope,  # [N, H, P] (strided: last dim contiguous)
        k_pe,
        value,  # [N, H, V] (strided: last dim contiguous)
        cu_seqlens,
        cu_seqlens,
        site.scale,
        True,  # causal: the new rows see each other up to themselves
    )
    return emit(operator.getitem, attn, 0), emit(operator.getitem, attn, 1)


def merged_with_context(
    emit: Emitter,
    suffix_out: fx.Node,  # [N, H, V]
    suffix_lse: fx.Node,  # [H, N]
    rows: fx.Node,  # [NC] int64: the suffix rows whose sequence has context
    context_out: fx.Node,  # [NC, H, V]
    context_lse: fx.Node,  # [H, NC]
) -> fx.Node:  # [N, H, V]
    """The suffix result with the rows that have context replaced by the LSE merge."""
    merged = emit(
        mlafx_ops.merge_attn_states.default,
        context_out,
        context_lse,
        emit.rows(suffix_out, rows),
        emit.rows(suffix_lse, rows, dim=1),
    )
    return emit(aten.index_copy.default, suffix_out, 0, rows, emit(operator.getitem, merged, 0))
