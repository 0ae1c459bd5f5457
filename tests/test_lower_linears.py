"""The lower_linears pass: every linear over a graph weight becomes mlafx.linear_packed, which
reads the packed copy alone, and whose streaming (decode-sized) and chunked ATen (larger)
branches both reproduce the captured graph."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mlafx.graph.capture import capture_step, num_sample_blocks, sample_step_inputs
from mlafx.models.step import SequenceSpan, build_step_inputs
from mlafx.passes.derived_constants import packed_name, source_of
from mlafx.passes.pipeline import lower_step_graph
from mlafx.passes.verify import random_caches
from tests.tiny_models import tiny_llm

LINEAR = "aten.linear.default"
PACKED = "mlafx.linear_packed.default"


@pytest.fixture(scope="module")
def llm():
    return tiny_llm(num_kv_blocks=num_sample_blocks(4))  # MoE layer + dense first layer


@pytest.fixture(scope="module")
def lowered(llm):
    captured = capture_step(llm.model, llm.block_size).module()
    sample = sample_step_inputs(llm.block_size, llm.config.vocab_size)
    caches = [torch.zeros_like(c) for c in llm.kv_caches]
    return captured, lower_step_graph(captured, sample, caches)


def test_every_weight_linear_is_lowered_once(llm, lowered):
    _, result = lowered
    assert result.verify_error is None
    by_stage = {stage.name: stage for stage in result.stages}
    before, after = by_stage["lower_attention"].ops, by_stage["lower_linears"].ops
    # every one, the router's fp32 gate included (its weight is float32 itself)
    routers = sum(1 for m in llm.model.modules() if type(m).__name__ == "Router")
    assert routers == 1 and after[LINEAR] == 0
    assert after[PACKED] == before[LINEAR] == by_stage["lower_linears"].rewrites
    read = {n.target for n in result.graph.graph.nodes if n.op == "get_attr"}
    assert "lm_head.weight_packed" in read
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight_packed" in read
    assert "model.layers.1.mlp.gate.weight_packed" in read  # the router's, float32
    # one copy of each weight: the lowered step reads no weight that it reads a packed copy of
    packed = {name for name in read if name.endswith("_packed")}
    sources = {source_of(name) for name in packed}
    assert packed == {packed_name(source) for source in sources}
    assert not read & sources
    lower_attention_read = {
        n.target for n in by_stage["lower_attention"].graph.graph.nodes if n.op == "get_attr"
    }
    assert sources <= lower_attention_read
    for node in result.graph.graph.nodes:
        if node.target is torch.ops.mlafx.linear_packed.default:
            _, packed_weight, out_features, _ = node.args
            source = result.graph.get_parameter(source_of(packed_weight.target))
            assert out_features == source.shape[0]


# fp32: rows above 8 take the chunked path (the packed weight unpacked for ATen's mm)
@pytest.mark.parametrize("new_tokens", [1, 3, 8, 9, 20])
def test_both_branches_match_the_captured_graph(llm, lowered, new_tokens):
    captured, result = lowered
    spans = [
        SequenceSpan(
            [(3 * i) % 200 + 2 for i in range(new_tokens)], 2, 2 + new_tokens, [5, 6, 7, 9, 11, 12]
        )
    ]
    inputs = build_step_inputs(spans, llm.block_size)
    args = (inputs.input_ids, inputs.positions)
    want_caches = random_caches(llm.kv_caches, seed=3)
    got_caches = [c.clone() for c in want_caches]
    want = captured(*args, want_caches, inputs.meta, inputs.logits_indices)
    got = result.graph(*args, got_caches, inputs.meta, inputs.logits_indices)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


class _RowSlices(torch.nn.Module):
    """Linears over row slices of one weight: on block edges (lowered, the last one partial)
    and off them (kept)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(56, 24))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        return torch.cat([F.linear(x, w[0:16]), F.linear(x, w[16:45]), F.linear(x, w[40:56])], 1)


def test_row_slices_on_block_edges_read_their_packed_blocks():
    from mlafx.passes.graph_utils import finish
    from mlafx.passes.lower_linears import lower_linears

    module, x = _RowSlices(), torch.randn(3, 24)
    captured = torch.export.export(module, (x,), strict=False).module()
    assert lower_linears(captured) == 2  # w[0:16] and w[16:45]; w[40:56] starts mid-block
    finish(captured)
    ops = [str(n.target) for n in captured.graph.nodes if n.op == "call_function"]
    assert ops.count(PACKED) == 2 and ops.count(LINEAR) == 1
    torch.testing.assert_close(captured(x), module(x), atol=1e-5, rtol=1e-5)
