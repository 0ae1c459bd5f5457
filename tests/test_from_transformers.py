"""`mlafx.LLM.from_transformers`: serve a transformers model object (its tensors adopted,
not copied) through the compiled engine; and how far the MLA matcher gets on transformers'
own captured forward."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

import mlafx
from mlafx.models.from_transformers import model_from_transformers
from mlafx.passes.find_mla_attention import find_mla_sites
from tests.greedy_compare import compare_greedy, transformers_greedy
from tests.test_parity_transformers import CONFIGS, NEW_TOKENS, PROMPTS


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(1234)
    return transformers.DeepseekV3ForCausalLM(CONFIGS["v3_noaux_tc"]()).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weights_are_shared_not_copied(hf_model, dtype):
    source = copy.deepcopy(hf_model).to(dtype)
    model = model_from_transformers(source)
    ours = dict(model.named_parameters())
    theirs = dict(source.named_parameters())
    copied = sorted(n for n in theirs if ours[n].data_ptr() != theirs[n].data_ptr())
    routers = sorted(n for n in theirs if n.endswith("mlp.gate.weight"))
    # only the routers are copied, into fp32, and only when the model is not fp32 already
    assert routers and copied == (routers if dtype != torch.float32 else [])
    assert all(ours[n].dtype == torch.float32 for n in routers)
    assert model.lm_head.weight.dtype == dtype


def test_compiled_engine_serves_the_object(hf_model):
    llm = mlafx.LLM.from_transformers(hf_model, block_size=4, num_kv_blocks=64)
    assert llm.compiled is not None
    outputs = llm.generate(PROMPTS, mlafx.SamplingParams(max_tokens=NEW_TOKENS, logprobs=1))
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        want, want_logprobs = transformers_greedy(hf_model, prompt, NEW_TOKENS)
        got = output.outputs[0].token_ids
        got_logprobs = [lp[t] for t, lp in zip(got, output.outputs[0].logprobs, strict=True)]
        compare_greedy(want, want_logprobs, got, got_logprobs, label=f"len={len(prompt)}")


def test_the_matcher_refuses_transformers_own_graph_with_its_reason(hf_model):
    """transformers' attention builds the key with new_empty + slice copies (no concat) and
    keeps its cache outside the graph: every SDPA anchor is found and refused, by name."""
    with torch.no_grad():
        program = torch.export.export(
            hf_model, (torch.arange(2, 9)[None],), kwargs={"use_cache": False}, strict=False
        )
    sites, refusals = find_mla_sites(program.module())
    assert sites == [] and len(refusals) == hf_model.config.num_hidden_layers
    assert all("key is not a concatenation" in r.reason for r in refusals)


def test_rejects_what_is_not_a_transformers_model():
    with pytest.raises(TypeError, match="transformers model with a .config"):
        model_from_transformers(torch.nn.Linear(2, 2))
