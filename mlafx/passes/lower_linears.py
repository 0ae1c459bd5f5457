"""Lower the model's linears to ``mlafx.linear_packed``: decode-sized steps stream a packed
copy of the weight at memory bandwidth, larger ones keep ATen's GEMM.

Pattern: ``aten.linear(x, W)`` or ``aten.linear(x, W, b)`` where ``W`` is a 2-D weight of the
graph (a ``get_attr``: q/kv/o projections, shared experts, dense MLPs, lm_head) and the
output (hence ``x``) is 2-D. Weights computed in the graph (the fp32 router's cast weight) do not match.
Replacement: ``mlafx.linear_packed(x, W, W_packed, b)``, where ``W_packed`` =
``pack_linear_weight(W)`` is a new constant named ``<W's name>_packed`` next to ``W``.
Requires: nothing beyond the pattern; run after ``lower_attention`` (whose absorbed
weights are views of ``kv_b_proj.weight``, not linears).
Ensures: no ``aten.linear`` over a graph weight remains; each weight is packed once however
many linears share it. Packed constants are not checkpoint weights: whoever loads the
compiled graph derives them again from ``W`` (:func:`packed_constant_source`).
"""

from __future__ import annotations

import logging

import torch
from torch import fx

import mlafx.kernels  # noqa: F401  (registers the mlafx ops and their fakes)
from mlafx.kernels.gemm_ops import pack_linear_weight
from mlafx.passes.graph_utils import tensor_shape

log = logging.getLogger(__name__)
aten = torch.ops.aten
PACKED_SUFFIX = "_packed"


def packed_constant_source(name: str) -> str | None:
    """The weight a packed constant is derived from (``a.b.weight_packed`` -> ``a.b.weight``),
    or None when ``name`` is not a packed constant."""
    return name[: -len(PACKED_SUFFIX)] if name.endswith(PACKED_SUFFIX) else None


def _packed_attr(gm: fx.GraphModule, weight_name: str) -> str:
    owner_path, _, attr = weight_name.rpartition(".")
    owner = gm.get_submodule(owner_path) if owner_path else gm
    packed_attr = attr + PACKED_SUFFIX
    if not hasattr(owner, packed_attr):
        with torch.no_grad():
            packed = pack_linear_weight(getattr(owner, attr).detach())
        owner.register_buffer(packed_attr, packed, persistent=False)
    return f"{owner_path}.{packed_attr}" if owner_path else packed_attr


def lower_linears(gm: fx.GraphModule) -> int:
    """Rewrite every matching linear in place; returns how many were rewritten."""
    graph = gm.graph
    rewritten = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.linear.default:
            continue
        x, weight = node.args[0], node.args[1]
        bias = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        if not (isinstance(weight, fx.Node) and weight.op == "get_attr"):
            log.info("lower_linears: %s keeps aten.linear (its weight is computed)", node.name)
            continue
        # the output's rank is x's (x may come from an earlier rewrite without shape meta)
        shapes = tensor_shape(node), tensor_shape(weight)
        if shapes[0] is None or len(shapes[0]) != 2 or shapes[1] is None or len(shapes[1]) != 2:
            log.info("lower_linears: %s keeps aten.linear (not 2-D: %s)", node.name, shapes)
            continue
        packed_name = _packed_attr(gm, weight.target)
        with graph.inserting_before(node):
            packed = graph.get_attr(packed_name)
            lowered = graph.call_function(
                torch.ops.mlafx.linear_packed.default, (x, weight, packed, bias)
            )
        lowered.meta = dict(node.meta)
        node.replace_all_uses_with(lowered)
        graph.erase_node(node)
        rewritten += 1
    log.info("lower_linears: %d linear(s) -> mlafx.linear_packed", rewritten)
    return rewritten
