"""Small helpers shared by the passes: walking producers through layout-only ops, and the
one clean-up every pass ends with."""

from __future__ import annotations

import copy
import operator

import torch
from torch import fx

aten = torch.ops.aten

# Ops that change how a tensor is laid out or typed, never which values it holds per
# element (beyond a cast). Walking back through them finds the value's real producer.
LAYOUT_OPS = {
    aten.to.dtype,
    aten._to_copy.default,
    aten.clone.default,
    aten.contiguous.default,
    aten.transpose.int,
    aten.permute.default,
    aten.view.default,
    aten.reshape.default,
    aten._unsafe_view.default,
    aten.unsqueeze.default,
    aten.slice.Tensor,
}


def is_call(node: object, *targets: object) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets


def strip_layout(node: fx.Node) -> fx.Node:
    """The first producer of ``node`` that is not a layout-only op."""
    while is_call(node, *LAYOUT_OPS) and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def getitem_of(node: fx.Node, target: object) -> tuple[fx.Node, int] | None:
    """If ``node`` is ``op(...)[i]`` with ``op`` == target, return (op node, i)."""
    if node.op == "call_function" and node.target is operator.getitem:
        parent, index = node.args
        if is_call(parent, target):
            return parent, int(index)
    return None


def tensor_shape(node: fx.Node) -> tuple[object, ...] | None:
    val = node.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def copy_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` whose graph can be rewritten on its own, sharing ``gm``'s weights: a
    plain deep copy would copy every weight (a real MoE layer: gigabytes) once per copy."""
    memo: dict[int, object] = {id(t): t for t in (*gm.parameters(), *gm.buffers())}
    return copy.deepcopy(gm, memo)


def finish(gm: fx.GraphModule) -> None:
    """Every pass ends here: drop dead nodes, check the graph, regenerate the code."""
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
