"""Capture and the MLA passes: exact op counts before and after, numerics, refusals."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from mlafx.compile.compiled_step import lower_layer
from mlafx.compile.layer_kinds import layer_kinds
from mlafx.graph.capture import capture_step, num_sample_blocks, sample_step_inputs
from mlafx.models.attention_path import AttentionPath
from mlafx.models.step import SequenceSpan, build_step_inputs
from mlafx.passes.find_mla_attention import find_mla_sites
from mlafx.passes.pipeline import lower_step_graph, op_histogram
from mlafx.passes.verify import VerificationError, random_caches, verify_rewrite
from tests.tiny_models import TINY_OVERRIDES, tiny_llm

DENSE = {**TINY_OVERRIDES, "n_routed_experts": 0}
SDPA = "aten.scaled_dot_product_attention.default"
WRITE = "mlafx.write_latent_cache.default"
PAGED = "mlafx.mla_attention_paged.default"
VARLEN = "mlafx.varlen_attention.default"
MERGE = "mlafx.merge_attn_states.default"
ATTENTION_OPS = (SDPA, "aten.index_copy_.default", WRITE, PAGED, VARLEN, MERGE)


@pytest.fixture(scope="module")
def llm():
    return tiny_llm(hf_overrides=DENSE, num_kv_blocks=num_sample_blocks(4))


@pytest.fixture(scope="module")
def captured(llm):
    return capture_step(llm.model, llm.block_size)


def sample_caches(llm):
    return [torch.zeros_like(c) for c in llm.kv_caches]


def test_capture_keeps_the_step_dynamic_down_to_one_token(llm, captured):
    ops = op_histogram(captured.graph_module)
    layers = llm.config.num_hidden_layers
    assert ops[SDPA] == layers and ops["aten.index_copy_.default"] == layers
    module = captured.module()
    steps = [
        [SequenceSpan([5], 0, 1, [3])],  # one token, one key row
        [SequenceSpan([7], 9, 10, [1, 2, 4])],  # a decode over context
        [SequenceSpan(list(range(2, 9)), 2, 9, [5, 6, 7]), SequenceSpan([4], 3, 4, [8])],
    ]
    # every path sub-batch empty once, and holding one or several rows/sequences
    for spans, threshold in itertools.product(steps, (None, 2.0)):
        inputs = build_step_inputs(spans, llm.block_size, threshold)
        args = (inputs.input_ids, inputs.positions)
        want_caches = random_caches(llm.kv_caches, seed=1)
        got_caches = [c.clone() for c in want_caches]
        want = llm.model(*args, want_caches, inputs.meta, inputs.logits_indices)
        got = module(*args, got_caches, inputs.meta, inputs.logits_indices)
        torch.testing.assert_close(got, want)
        for a, b in zip(got_caches, want_caches, strict=True):
            torch.testing.assert_close(a, b)


def test_find_one_site_per_layer(llm, captured):
    sites, refusals = find_mla_sites(captured.module())
    cfg = llm.config
    assert [s.layer for s in sites] == list(range(cfg.num_hidden_layers)) and refusals == []
    site = sites[0]
    assert (site.num_heads, site.kv_lora_rank, site.qk_rope_head_dim) == (4, 32, 8)
    assert (site.qk_nope_head_dim, site.v_head_dim) == (16, 16)
    assert site.scale == pytest.approx(cfg.softmax_scale)
    assert str(site.kv_b_weight.target) == "model.layers.0.self_attn.kv_b_proj.weight"


def test_lowering_op_counts_and_numerics(llm, captured):
    layers = llm.config.num_hidden_layers
    sample = sample_step_inputs(llm.block_size, llm.config.vocab_size)
    result = lower_step_graph(captured.module(), sample, sample_caches(llm))
    assert result.verify_error is None and result.verify.max_abs_output_diff < 1e-4
    # the sample step sends prefill rows with context down both paths
    assert result.verify.coverage == {
        "absorbed_decodes": 2,
        "absorbed_prefills_with_context": 1,
        "absorbed_fresh_prefills": 1,
        "split_prefills_with_context": 2,
        "split_fresh_prefills": 1,
    }
    before, after = result.stages[0].ops, result.stages[-1].ops
    assert [before[op] for op in ATTENTION_OPS] == [layers, layers, 0, 0, 0, 0]
    # per layer: one cache write; mla_attention_paged for the absorbed rows and for the split
    # rows' context half; varlen_attention for their new rows; merge_attn_states
    assert [after[op] for op in ATTENTION_OPS] == [0, 0, layers, 2 * layers, layers, layers]
    # the two absorbed passes each project q through W_UK and the output through W_UV^T
    assert after["mlafx.batched_matmul.default"] == 4 * layers
    assert after["aten.bmm.default"] == 0
    # no gather of cache rows is left: per layer 10 selections of sub-batch rows (q_nope and
    # q_pe of each of the three sub-batches, kv_c and k_pe of the split rows, the suffix's
    # output and LSE at the rows with context), 3 of sub-batch positions shared by all layers,
    # and lm_head's selection of the sampled rows
    assert after["aten.index_select.default"] == 10 * layers + 3 + 1
    # two scatters into token order and one of the merged rows into the split result
    assert after["aten.index_copy.default"] == 3 * layers
    context = ("mlafx::batched_matmul", "mlafx::mla_attention_paged", "mlafx::batched_matmul")
    assert [lo.split for lo in result.lowerings] == [
        ("mlafx::varlen_attention", *context, "mlafx::merge_attn_states")
    ] * layers
    # W_UK/W_UV are views of kv_b_proj.weight: no new constants
    assert not [n for n in result.graph.graph.nodes if n.op == "get_attr" and "absorb" in n.name]


def test_verify_rejects_a_wrong_rewrite(llm, captured):
    sample = sample_step_inputs(llm.block_size, llm.config.vocab_size)
    original = captured.module()

    def off_by_scale(*args):
        return original(*args) * 1.01

    with pytest.raises(VerificationError, match="output differs"):
        verify_rewrite(original, off_by_scale, sample, random_caches(sample_caches(llm)))


def test_verify_refuses_a_sample_that_leaves_a_path_unchecked(llm, captured):
    """A sample whose prefill rows with context are all absorbed never checks the split."""
    spans = [
        SequenceSpan([3, 4, 5], 2, 5, [1, 2], path=AttentionPath.ABSORBED),
        SequenceSpan([6, 7], 0, 2, [3], path=AttentionPath.SPLIT),
    ]
    sample = build_step_inputs(spans, llm.block_size)
    module = captured.module()
    with pytest.raises(VerificationError, match="no split prefills with context"):
        verify_rewrite(module, module, sample, random_caches(sample_caches(llm)))


class SoftCappedAttention(torch.nn.Module):
    """Attention a matcher must not rewrite: a tanh soft-cap on the scores."""

    def forward(self, q, k, v):
        scores = torch.tanh(q @ k.transpose(-1, -2) / 30.0) * 30.0
        return torch.softmax(scores, dim=-1) @ v


class CausalFlagAttention(torch.nn.Module):
    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize(
    ("module", "reason"),
    [(SoftCappedAttention(), "hand-written attention"), (CausalFlagAttention(), "is_causal")],
)
def test_refused_candidates_are_reported(module, reason):
    q = k = v = torch.randn(2, 5, 8)
    graph = torch.export.export(module, (q, k, v), strict=False).module()
    sites, refusals = find_mla_sites(graph)
    assert sites == [] and len(refusals) == 1 and reason in refusals[0].reason
    if reason == "hand-written attention":
        assert "tanh" in refusals[0].reason


def test_compiled_engine_matches_the_reference(llm):
    """AOTInductor-compiled lowered step vs the reference model, greedy tokens (fp32)."""
    import mlafx

    reference = tiny_llm(hf_overrides=DENSE)
    # the suite's cache (test_lowered_attention_paths compiles the same layer kind)
    compiled = tiny_llm(hf_overrides=DENSE, compile=True)
    # one layer kind (both layers dense): one graph, lowered onto two paged passes (lowered
    # again: the package may come from the cache)
    (kind,) = layer_kinds(reference.model)  # the compiled engine released its weights
    lowered = lower_layer(reference.model, kind, 4).lowering.graph  # tiny_llm's block size
    assert [p.kind for p in compiled.compiled.packages] == [kind]
    assert op_histogram(lowered)[PAGED] == 2
    prompts = [[5, 6, 7, 8, 9], [3], list(range(10, 50))]
    params = mlafx.SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1)
    want = reference.generate(prompts, params)
    got = compiled.generate(prompts, params)
    for a, b in zip(want, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert x.keys() == y.keys()
            assert max(abs(x[t] - y[t]) for t in x) < 1e-4
    # a second engine loads the cached package instead of recompiling
    again = tiny_llm(hf_overrides=DENSE, compile=True)
    assert again.compiled.lowerings == {}
    assert [p.package for p in again.compiled.packages] == [
        p.package for p in compiled.compiled.packages
    ]
    assert Counter(o.outputs[0].finish_reason for o in again.generate(prompts, params)) == {
        "length": 3
    }
