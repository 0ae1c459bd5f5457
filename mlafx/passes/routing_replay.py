"""Hold the routed experts' choices fixed across two runs of a step graph (for ``verify``).

Expert routing is a discontinuous function of the hidden state: two exact attention paths
that differ by one bf16 rounding can flip a near-tie top-k choice, and the flipped token's
output (and everything downstream of it) then differs by far more than any tolerance, though
neither run is wrong. Verifying an attention rewrite therefore records, per
``mlafx::moe_experts`` node, the expert ids and weights the original graph chose, and replays
them in the rewritten graph. An attention error still shows: the experts' inputs, the
residual stream and the logits all carry it. (A pass that rewrote the routing itself would
need its own check.)
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import fx

import mlafx.kernels  # noqa: F401  (registers mlafx::moe_experts)
from mlafx.passes.graph_utils import copy_graph

Routing = dict[str, tuple[torch.Tensor, torch.Tensor]]  # node name -> (topk_ids, topk_weights)
_MOE = torch.ops.mlafx.moe_experts.default


def _moe_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _MOE]


def _retarget(gm: fx.GraphModule, make: Callable[[str], Callable[..., torch.Tensor]]):
    copied = copy_graph(gm)  # shares the weights
    for node in _moe_nodes(copied):
        node.target = make(node.name)
    copied.recompile()
    return copied


def recording(gm: fx.GraphModule, routing: Routing) -> fx.GraphModule:
    """A copy of ``gm`` that stores each expert node's choices in ``routing`` as it runs."""

    def make(name: str) -> Callable[..., torch.Tensor]:
        def moe_experts(x, topk_ids, topk_weights, w13, w2):  # type: ignore[no-untyped-def]
            routing[name] = (topk_ids, topk_weights)
            return _MOE(x, topk_ids, topk_weights, w13, w2)

        return moe_experts

    return _retarget(gm, make)


def replaying(gm: fx.GraphModule, routing: Routing) -> fx.GraphModule:
    """A copy of ``gm`` whose expert nodes use the choices ``routing`` recorded (by name)."""

    def make(name: str) -> Callable[..., torch.Tensor]:
        def moe_experts(x, topk_ids, topk_weights, w13, w2):  # type: ignore[no-untyped-def]
            if name not in routing:
                raise ValueError(f"no recorded routing for expert node {name}")
            ids, weights = routing[name]
            return _MOE(x, ids, weights, w13, w2)

        return moe_experts

    return _retarget(gm, make)


def with_fixed_routing(
    original: Callable[..., torch.Tensor], rewritten: Callable[..., torch.Tensor]
) -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    """The two step functions to compare: when both are graphs with expert nodes, the
    original records its routing and the rewritten one replays it (run the original first)."""
    if not (isinstance(original, fx.GraphModule) and isinstance(rewritten, fx.GraphModule)):
        return original, rewritten
    names = [n.name for n in _moe_nodes(original)]
    if not names:
        return original, rewritten
    if sorted(n.name for n in _moe_nodes(rewritten)) != sorted(names):
        raise ValueError("the rewritten graph's expert nodes are not the original's")
    routing: Routing = {}
    return recording(original, routing), replaying(rewritten, routing)
