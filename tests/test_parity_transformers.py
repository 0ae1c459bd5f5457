"""Golden test: mlafx (float32, weights via load_format="auto") against transformers' own
DeepSeek-V2/V3 and GLM-4.7-Flash modelling code, on tiny random checkpoints written with
``save_pretrained``.

If this fails: run one config by hand (``pytest -k v3 -s``); the printout shows each prompt's
first divergent position. Compare a single prefill step's logits first (attention, RoPE or
the router are the usual suspects), then decode steps (cache slots, positions).
"""

from __future__ import annotations

import pytest
import torch
import transformers

import mlafx
from tests.greedy_compare import compare_greedy, random_transformers_model, transformers_greedy

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], list(range(20, 61))]
NEW_TOKENS = 16

_COMMON = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    kv_lora_rank=32,
    qk_rope_head_dim=8,
    max_position_embeddings=256,
    initializer_range=0.2,  # larger than usual: fewer near-ties, more varied tokens
    bos_token_id=None,
    eos_token_id=None,
)
_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
}

CONFIGS = {
    # DeepSeek-V2(-Lite) shape: no q LoRA, YaRN, softmax greedy routing.
    "v2_yarn": lambda: transformers.DeepseekV2Config(
        **_COMMON,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        rope_parameters=_YARN,
    ),
    # DeepSeek-V2 full-size routing: group-limited greedy with a routed scale.
    "v2_group_limited": lambda: transformers.DeepseekV2Config(
        **_COMMON,
        q_lora_rank=None,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=2,
        n_group=4,
        topk_group=2,
        topk_method="group_limited_greedy",
        routed_scaling_factor=1.5,
        first_k_dense_replace=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    # DeepSeek-V3 / Kimi K2 shape: q LoRA, sigmoid noaux_tc routing with groups, YaRN.
    "v3_noaux_tc": lambda: transformers.DeepseekV3Config(
        **_COMMON,
        q_lora_rank=24,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        first_k_dense_replace=1,
        rope_parameters=_YARN,
    ),
    # A V3 config with rope_interleave=false: NeoX-style halves instead of pairs.
    "v3_neox_rope": lambda: transformers.DeepseekV3Config(
        **_COMMON,
        q_lora_rank=24,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        norm_topk_prob=False,
        first_k_dense_replace=2,
        rope_interleave=False,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0},
    ),
    # GLM-4.7-Flash shape: P != V, q LoRA, mlp_layer_types.
    "glm4_moe_lite": lambda: transformers.Glm4MoeLiteConfig(
        **_COMMON,
        q_lora_rank=16,
        qk_nope_head_dim=24,
        v_head_dim=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.8,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
}
MODEL_CLASSES = {
    transformers.DeepseekV2Config: transformers.DeepseekV2ForCausalLM,
    transformers.DeepseekV3Config: transformers.DeepseekV3ForCausalLM,
    transformers.Glm4MoeLiteConfig: transformers.Glm4MoeLiteForCausalLM,
}


def make_checkpoint(name: str, directory) -> torch.nn.Module:
    config = CONFIGS[name]()
    model = random_transformers_model(config, MODEL_CLASSES[type(config)], seed=1234)
    model.save_pretrained(directory)
    return model


@pytest.mark.parametrize("compiled", [False, True], ids=["reference", "compiled"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_tokens_and_logprobs_match_transformers(name, compiled, tmp_path):
    """Both engine paths: the plain reference model, and the captured, MLA-lowered and
    AOTInductor-compiled step."""
    reference = make_checkpoint(name, tmp_path)
    llm = mlafx.LLM(
        str(tmp_path),
        dtype="float32",
        block_size=4,
        num_kv_blocks=64,
        progress=False,
        compile=compiled,  # compiled steps are cached in the repo (tests/conftest.py)
    )
    outputs = llm.generate(PROMPTS, mlafx.SamplingParams(max_tokens=NEW_TOKENS, logprobs=1))
    compared = 0
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        want, want_logprobs = transformers_greedy(reference, prompt, NEW_TOKENS)
        got = output.outputs[0].token_ids
        got_logprobs = [lp[t] for t, lp in zip(got, output.outputs[0].logprobs, strict=True)]
        result = compare_greedy(
            want, want_logprobs, got, got_logprobs, label=f"{name} len={len(prompt)}"
        )
        compared += result.compared
    # Ties may cut a comparison short, but most positions must have been compared.
    assert compared >= len(PROMPTS) * NEW_TOKENS // 2, f"only {compared} positions compared"
