"""Lower the model's linears to ``mlafx.linear_packed``, which reads only a packed copy of the
weight: decode-sized steps stream it at memory bandwidth, larger ones unpack it a chunk of
rows at a time for ATen's GEMM. The packed copy replaces the checkpoint's weight in the step.

Pattern: ``aten.linear(x, W)`` or ``aten.linear(x, W, b)`` where ``W`` is a 2-D weight of the
graph (a ``get_attr``: q/kv/o projections, shared experts, dense MLPs, lm_head, and the
split attention path's ``kv_b_proj`` decompression, the fp32 router's gate) or a slice of its
rows starting at a multiple of the packed block (16 rows; DeepSeek-V4's grouped ``o_a_proj``,
a slice per group), and ``x`` is 2-D. Other weights computed in the graph do not match.
Replacement: ``mlafx.linear_packed(x, W_packed, N, b)``, where ``W_packed`` =
``pack_linear_weight(W)`` is a derived constant named ``<W's name>_packed`` next to ``W`` and
``N`` is ``W``'s number of rows; for a row slice ``[r0, r1)`` the slice of the packed blocks
that hold those rows, and ``N = r1 - r0``.
Requires: nothing beyond the pattern; run after ``lower_attention`` (whose absorbed
weights are derived constants of ``kv_b_proj.weight``, not linears).
Ensures: no ``aten.linear`` over a graph weight remains; each weight is packed once however
many linears share it; the rewritten linears no longer read ``W`` (the clean-up drops its
``get_attr`` unless something else, such as a tied embedding, still reads it), so a compiled
graph asks for ``W_packed`` alone. Packed constants are not checkpoint weights: whoever loads
the compiled graph derives them again from ``W`` (``passes/derived_constants.py``).
"""

from __future__ import annotations

import logging

import torch
from torch import fx

import mlafx.kernels  # noqa: F401  (registers the mlafx ops and their fakes)
from mlafx.kernels.gemm_ops import PACKED_BLOCK_ROWS
from mlafx.passes.derived_constants import derived_attr, packed_name
from mlafx.passes.graph_utils import tensor_shape

log = logging.getLogger(__name__)
aten = torch.ops.aten


def _rank(linear: fx.Node) -> int | None:
    """Rank of a linear's input: from shape metadata where the capture left it, else walked
    back through row selections (an earlier rewrite's nodes carry no metadata)."""
    for node in (linear, linear.args[0]):
        while isinstance(node, fx.Node):
            shape = tensor_shape(node)
            if shape is not None:
                return len(shape)
            if node.op != "call_function" or node.target not in _RANK_PRESERVING:
                break
            node = node.args[0]
    return None


_RANK_PRESERVING = {aten.index_select.default, aten.contiguous.default, aten.clone.default}


def _row_slice(weight: object) -> tuple[int, int] | None:
    """``(r0, r1)`` if ``weight`` is ``W[r0:r1]`` of a graph weight ``W`` with ``r0`` on a
    packed block's first row, else None."""
    if not (
        isinstance(weight, fx.Node)
        and weight.op == "call_function"
        and weight.target is aten.slice.Tensor
        and isinstance(weight.args[0], fx.Node)
        and weight.args[0].op == "get_attr"
    ):
        return None
    args = weight.args[1:]
    dim, start, end = (
        args[i] if len(args) > i else default for i, default in enumerate((0, 0, None))
    )
    step = args[3] if len(args) > 3 else 1
    if not (dim == 0 and step == 1 and isinstance(start, int) and isinstance(end, int)):
        return None
    return (start, end) if start % PACKED_BLOCK_ROWS == 0 and end > start else None


def lower_linears(gm: fx.GraphModule) -> int:
    """Rewrite every matching linear in place; returns how many were rewritten."""
    graph = gm.graph
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.linear.default:
            continue
        x, weight = node.args[0], node.args[1]
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        rows = _row_slice(weight)
        if rows is not None:
            weight = weight.args[0]
        if not (isinstance(weight, fx.Node) and weight.op == "get_attr"):
            log.info("lower_linears: %s keeps aten.linear (its weight is computed)", node.name)
            continue
        x_rank, weight_shape = _rank(node), tensor_shape(weight)
        if x_rank != 2 or weight_shape is None or len(weight_shape) != 2:
            log.info(
                "lower_linears: %s keeps aten.linear (x rank %s, weight %s)",
                node.name,
                x_rank,
                weight_shape,
            )
            continue
        with graph.inserting_before(node):
            packed = derived_attr(gm, packed_name(weight.target))
            out_features = int(weight_shape[0])
            if rows is not None:
                start, end = rows[0], min(rows[1], out_features)
                blocks = (start // PACKED_BLOCK_ROWS, -(-end // PACKED_BLOCK_ROWS))
                packed = graph.call_function(aten.slice.Tensor, (packed, 0, *blocks))
                out_features = end - start
            lowered = graph.call_function(
                torch.ops.mlafx.linear_packed.default, (x, packed, out_features, bias)
            )
        lowered.meta = dict(node.meta)
        node.replace_all_uses_with(lowered)
        graph.erase_node(node)
        rewritten += 1
    log.info("lower_linears: %d linear(s) -> mlafx.linear_packed", rewritten)
    return rewritten
