"""Golden test for the MLA families beyond DeepSeek/GLM: mlafx (float32, weights from a
``save_pretrained`` checkpoint) against transformers' own modelling code, on tiny random
configs with odd sizes, on the reference and the compiled path. Each engine serves the
prompts with a small token budget (the long prompt is chunked), then a prompt that extends an
earlier one (a prefix-cache hit), and every generation is compared token by token.

If this fails: run one family by hand (``pytest -k minicpm3 -s``); the printout shows each
prompt's first divergent position. MiniCPM3's suspects are its scalings (embedding, residual,
logits) and RoPE (NeoX halves, LongRoPE factors); Kimi K2.5's are the checkpoint's key
prefixes and the tie of lm_head.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import mlafx
from tests.greedy_compare import compare_greedy, transformers_greedy

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [3, 4], list(range(20, 61))]
# served after PROMPTS: its first 32 tokens are PROMPTS[2]'s, already in the prefix cache
PREFIX_HIT_PROMPT = list(range(20, 52)) + [7, 7, 3]
NEW_TOKENS = 12

_MINICPM3 = dict(
    vocab_size=157,
    hidden_size=60,
    intermediate_size=86,
    num_hidden_layers=3,
    num_attention_heads=3,
    num_key_value_heads=3,
    kv_lora_rank=20,
    qk_nope_head_dim=10,
    qk_rope_head_dim=6,
    max_position_embeddings=256,
    initializer_range=0.2,  # larger than usual: fewer near-ties, more varied tokens
    bos_token_id=None,
    eos_token_id=None,
)
_LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0, 1.7, 3.1],
    "long_factor": [1.0, 1.7, 3.1],
    "original_max_position_embeddings": 64,  # < max_position_embeddings: attention factor
}


def _kimi_k25() -> transformers.PretrainedConfig:
    text = transformers.DeepseekV3Config(
        vocab_size=163,
        hidden_size=48,
        intermediate_size=72,
        moe_intermediate_size=20,
        num_hidden_layers=2,
        num_attention_heads=3,
        num_key_value_heads=3,
        q_lora_rank=18,
        kv_lora_rank=22,
        qk_nope_head_dim=10,
        qk_rope_head_dim=6,
        v_head_dim=12,
        n_routed_experts=6,
        num_experts_per_tok=2,
        n_shared_experts=1,
        n_group=2,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.0,
        first_k_dense_replace=1,
        max_position_embeddings=256,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=None,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
    )
    vision = {
        "hidden_size": 16,
        "intermediate_size": 24,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "patch_size": 4,
        "pos_emb_height": 4,
        "pos_emb_width": 4,
        "pos_emb_time": 2,
    }
    return transformers.Kimi_K25Config(
        text_config=text.to_dict(),
        vision_config=vision,
        projection_hidden_size=16,
        tie_word_embeddings=False,
    )


CONFIGS = {
    # MiniCPM3-4B's shape, shrunk: q LoRA, NeoX-halves RoPE, P != V, dense MLPs, tied
    # embeddings, all three scalings (dim_model_base != hidden_size)
    "minicpm3": lambda: transformers.MiniCPM3Config(
        **_MINICPM3, q_lora_rank=18, v_head_dim=14, dim_model_base=15, scale_emb=12,
        scale_depth=1.4, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    # no q LoRA, LongRoPE factors and attention factor, v_head_dim from the default
    "minicpm3_longrope": lambda: transformers.MiniCPM3Config(
        **_MINICPM3, q_lora_rank=None, v_head_dim=None, dim_model_base=None, scale_emb=2.5,
        scale_depth=None, tie_word_embeddings=False, rope_parameters=_LONGROPE,
    ),
    # Kimi K2.5: a DeepSeek-V3 text model inside a multimodal checkpoint with a vision tower
    "kimi_k25": _kimi_k25,
}  # fmt: skip
MODEL_CLASSES = {
    transformers.MiniCPM3Config: transformers.MiniCPM3ForCausalLM,
    transformers.Kimi_K25Config: transformers.Kimi_K25ForConditionalGeneration,
}


def make_checkpoint(name: str, directory) -> torch.nn.Module:
    torch.manual_seed(4321)
    config = CONFIGS[name]()
    model = MODEL_CLASSES[type(config)](config).eval()
    with torch.no_grad():  # routers' correction biases start at 0: make them matter
        for module_name, buffer in model.named_buffers():
            if module_name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.3, 0.3)
    model.save_pretrained(directory)
    return model


@pytest.mark.parametrize("compiled", [False, True], ids=["reference", "compiled"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_tokens_and_logprobs_match_transformers(name, compiled, tmp_path):
    reference = make_checkpoint(name, tmp_path)
    llm = mlafx.LLM(
        str(tmp_path),
        dtype="float32",
        block_size=4,
        num_kv_blocks=96,
        max_num_batched_tokens=16,  # PROMPTS[2] (41 tokens) is served in chunks
        progress=False,
        compile=compiled,  # compiled steps are cached in the repo (tests/conftest.py)
    )
    params = mlafx.SamplingParams(max_tokens=NEW_TOKENS, logprobs=1)
    outputs = llm.generate(PROMPTS, params)
    (hit,) = llm.generate([PREFIX_HIT_PROMPT], params)
    assert hit.num_cached_tokens >= 28, f"no prefix-cache hit ({hit.num_cached_tokens} tokens)"
    compared = 0
    for prompt, output in zip([*PROMPTS, PREFIX_HIT_PROMPT], [*outputs, hit], strict=True):
        want, want_logprobs = transformers_greedy(reference, prompt, NEW_TOKENS)
        got = output.outputs[0].token_ids
        got_logprobs = [lp[t] for t, lp in zip(got, output.outputs[0].logprobs, strict=True)]
        result = compare_greedy(
            want, want_logprobs, got, got_logprobs, label=f"{name} len={len(prompt)}"
        )
        compared += result.compared
    # Ties may cut a comparison short, but most positions must have been compared.
    assert compared >= (len(PROMPTS) + 1) * NEW_TOKENS // 2, f"only {compared} compared"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_cli_run_serves_each_family(name, tmp_path, capsys):
    """``mlafx run --model DIR`` on a checkpoint as transformers saves it (Kimi K2.5's with its
    vision tower): the transformers model's own greedy tokens come out."""
    from mlafx.cli import main

    reference = make_checkpoint(name, tmp_path)
    want, logprobs = transformers_greedy(reference, [5, 6, 7], 4)
    top2 = logprobs.topk(2, dim=-1).values
    ties = ((top2[:, 0] - top2[:, 1]) <= 1e-4).nonzero()
    compared = len(want) if len(ties) == 0 else int(ties[0])  # from a near-tie on, may differ
    argv = ["run", "--model", str(tmp_path), "--dtype", "float32", "--no-compile"]
    argv += ["--prompt-token-ids", "5,6,7", "--max-tokens", "4", "--num-kv-blocks", "16"]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    got = report["outputs"][0]["token_ids"]
    assert len(got) == len(want) and got[:compared] == want[:compared]
