"""The AOTInductor package is code only: two models of one config share a package, and
each runs with its own weights — even tensors small enough for inductor to inline. It asks for
one copy of each linear weight: the packed one."""

from __future__ import annotations

import torch
import transformers

from mlafx.compile.compiled_step import compile_step, package_path
from mlafx.compile.layer_kinds import layer_kinds
from mlafx.graph.capture import sample_step
from mlafx.models.from_transformers import model_from_transformers
from mlafx.passes.derived_constants import source_of
from tests.test_parity_transformers import CONFIGS


def test_models_sharing_a_package_keep_their_own_small_weights():
    torch.manual_seed(7)
    hf = transformers.DeepseekV3ForCausalLM(CONFIGS["v3_noaux_tc"]()).eval()
    first = model_from_transformers(hf)
    second = model_from_transformers(hf)
    second.model.layers[1].mlp.gate.e_score_correction_bias = torch.linspace(-0.3, 0.3, 8)
    second.model.layers[2].mlp.gate.e_score_correction_bias = torch.linspace(0.3, -0.3, 8)
    assert first.model.layers[1].mlp.gate.e_score_correction_bias.numel() <= 8  # inlinable
    compile_step(first, 4)  # the suite's cache (test_from_transformers builds the same)
    step = compile_step(second, 4)
    kinds = layer_kinds(first)
    assert step.lowerings == {}
    assert [p.package for p in step.packages] == [package_path(first, k, 4) for k in kinds]
    for runner in step.layers:  # each linear's packed copy, derived at load, not its source
        wanted = set(runner.get_constant_fqns())
        packed = {name for name in wanted if name.endswith("_packed")}
        assert packed and not wanted & {source_of(name) for name in packed}
    sample, caches = sample_step(second, 4)
    args = (sample.input_ids, sample.positions)
    with torch.no_grad():
        want = second(*args, [c.clone() for c in caches], sample.meta, sample.logits_indices)
        wrong = first(*args, [c.clone() for c in caches], sample.meta, sample.logits_indices)
    got = step(*args, [c.clone() for c in caches], sample.meta, sample.logits_indices)
    assert (want - wrong).abs().max() > 1e-2  # the biases matter to the routing
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
