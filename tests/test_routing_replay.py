"""``verify`` holds expert routing fixed: a flipped expert choice is no rewrite error, a wrong
value still is."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
from torch import fx

from mlafx.graph.capture import capture_step, num_sample_blocks, sample_step
from mlafx.passes.routing_replay import with_fixed_routing
from mlafx.passes.verify import VerificationError, random_caches, verify_rewrite
from tests.tiny_models import tiny_llm

MOE = torch.ops.mlafx.moe_experts.default


@pytest.fixture(scope="module")
def moe_graph():
    """The tiny MoE model's captured step (layer 1 routes to 4 experts, top 2)."""
    llm = tiny_llm(num_kv_blocks=num_sample_blocks(4))
    sample, caches = sample_step(llm.model, llm.block_size)
    gm = capture_step(llm.model, llm.block_size).module()
    assert sum(n.target is MOE for n in gm.graph.nodes) == 1
    return gm, sample, random_caches(caches)


def edited(gm: fx.GraphModule, edit) -> fx.GraphModule:  # type: ignore[no-untyped-def]
    copied = copy.deepcopy(gm)
    edit(copied.graph)
    copied.recompile()
    return copied


def reroute(graph: fx.Graph) -> None:
    """Send every token to the next expert over (a different but valid routing)."""
    (node,) = [n for n in graph.nodes if n.target is MOE]
    with graph.inserting_before(node):
        shifted = graph.call_function(torch.ops.aten.add.Tensor, (node.args[1], 1))
        wrapped = graph.call_function(torch.ops.aten.remainder.Scalar, (shifted, 4))
    node.update_arg(1, wrapped)


def scale_logits(graph: fx.Graph) -> None:
    output = next(n for n in graph.nodes if n.op == "output")
    logits = output.args[0][0]
    with graph.inserting_before(output):
        scaled = graph.call_function(operator.mul, (logits, 1.01))
    output.update_arg(0, (scaled, *output.args[0][1:]))


def run(fn, sample, caches):  # type: ignore[no-untyped-def]
    with torch.no_grad():
        own = [c.clone() for c in caches]
        return fn(sample.input_ids, sample.positions, own, sample.meta, sample.logits_indices)


def test_a_different_expert_choice_passes_with_the_routing_replayed(moe_graph):
    gm, sample, caches = moe_graph
    rerouted = edited(gm, reroute)
    # run as they are, the two graphs disagree: the check below is not vacuous
    assert (run(gm, sample, caches) - run(rerouted, sample, caches)).abs().max() > 1e-2
    report = verify_rewrite(gm, rerouted, sample, caches)
    assert report.max_abs_output_diff == 0.0


def test_a_wrong_value_fails_with_the_routing_replayed(moe_graph):
    gm, sample, caches = moe_graph
    with pytest.raises(VerificationError, match="output differs"):
        verify_rewrite(gm, edited(gm, scale_logits), sample, caches)


def test_replay_refuses_graphs_with_other_expert_nodes(moe_graph):
    gm, _, _ = moe_graph

    def rename(graph: fx.Graph) -> None:
        (node,) = [n for n in graph.nodes if n.target is MOE]
        node.name = "renamed_experts"

    with pytest.raises(ValueError, match="expert nodes are not the original's"):
        with_fixed_routing(gm, edited(gm, rename))
