"""Golden test for the MLA families beyond DeepSeek/GLM: mlafx (float32, weights from a
``save_pretrained`` checkpoint) against transformers' own modelling code, on tiny random
configs with odd sizes, on the reference and the compiled path. Each engine serves the
prompts with a small token budget (the long prompt is chunked), then a prompt that extends an
earlier one (a prefix-cache hit), and every generation is compared token by token.

If this fails: run one family by hand (``pytest -k minicpm3 -s``); the printout shows each
prompt's first divergent position. MiniCPM3's suspects are its scalings (embedding, residual,
logits) and RoPE (NeoX halves, LongRoPE factors); Kimi K2.5's are the checkpoint's key
prefixes and the tie of lm_head; LongCat-Flash's its block order, its q / latent scalings and
the zero experts.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import mlafx
from tests.greedy_compare import compare_greedy, random_transformers_model, transformers_greedy

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


_LONGCAT = dict(
    vocab_size=151, hidden_size=48, num_layers=2, num_attention_heads=3, q_lora_rank=20,
    kv_lora_rank=24, qk_nope_head_dim=10, qk_rope_head_dim=6, v_head_dim=12, head_dim=6,
    ffn_hidden_size=64, expert_ffn_hidden_size=20, n_routed_experts=6, zero_expert_num=3,
    moe_topk=3, routed_scaling_factor=2.0, max_position_embeddings=256, initializer_range=0.2,
    bos_token_id=None, eos_token_id=None,
)  # fmt: skip


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
    # LongCat-Flash: two MLA blocks per layer (q and latent scalings), shortcut MoE with zero
    # experts (3 of 9 choices), per-expert checkpoint keys, its own RoPE theta
    "longcat_flash": lambda: transformers.LongcatFlashConfig(**_LONGCAT),
    # transformers runs these two with DeepSeek-V3's code; their configs differ in names and
    # defaults (Sarvam: num_experts, no q LoRA; Youtu: dense, tied)
    "sarvam_mla": lambda: transformers.SarvamMLAConfig(
        vocab_size=149, hidden_size=40, intermediate_size=56, moe_intermediate_size=20,
        num_hidden_layers=2, num_attention_heads=3, kv_lora_rank=18, qk_nope_head_dim=10,
        qk_rope_head_dim=6, v_head_dim=12, num_experts=5, num_shared_experts=1,
        num_experts_per_tok=2, routed_scaling_factor=2.5, max_position_embeddings=256,
        initializer_range=0.2, bos_token_id=None, eos_token_id=None,
    ),
    "youtu": lambda: transformers.YoutuConfig(
        vocab_size=149, hidden_size=40, intermediate_size=56, num_hidden_layers=2,
        num_attention_heads=3, num_key_value_heads=3, q_lora_rank=14, kv_lora_rank=18,
        qk_nope_head_dim=10, qk_rope_head_dim=6, v_head_dim=12, max_position_embeddings=256,
        initializer_range=0.2, bos_token_id=None, eos_token_id=None,
    ),
}  # fmt: skip
# the compiled path's parity runs for the structurally new families (the others compile to the
# DeepSeek graphs test_parity_transformers.py covers; test_every_mla_block_is_lowered checks
# that their blocks lower)
COMPILED = ["kimi_k25", "longcat_flash", "minicpm3"]
# Even head counts and widths, for tensor_parallel_size=2 (each rank loads and slices the
# weights; the LongCat one has zero experts, whose identity term every rank holds)
TP_CONFIGS = {
    "minicpm3_tp2": lambda: transformers.MiniCPM3Config(
        **{**_MINICPM3, "num_attention_heads": 4, "num_key_value_heads": 4},
        q_lora_rank=18, v_head_dim=14, dim_model_base=15,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    "longcat_flash_tp2": lambda: transformers.LongcatFlashConfig(
        **{**_LONGCAT, "num_attention_heads": 4}
    ),
}  # fmt: skip
MODEL_CLASSES = {
    transformers.MiniCPM3Config: transformers.MiniCPM3ForCausalLM,
    transformers.SarvamMLAConfig: transformers.DeepseekV3ForCausalLM,
    transformers.YoutuConfig: transformers.YoutuForCausalLM,
    transformers.Kimi_K25Config: transformers.Kimi_K25ForConditionalGeneration,
    transformers.LongcatFlashConfig: transformers.LongcatFlashForCausalLM,
}


def make_checkpoint(name: str, directory) -> torch.nn.Module:
    config = {**CONFIGS, **TP_CONFIGS}[name]()
    model = random_transformers_model(config, MODEL_CLASSES[type(config)], seed=4321)
    model.save_pretrained(directory)
    return model


@pytest.mark.parametrize(
    "name, compiled",
    [(name, False) for name in sorted(CONFIGS)] + [(name, True) for name in COMPILED],
    ids=[f"{n}-reference" for n in sorted(CONFIGS)] + [f"{n}-compiled" for n in COMPILED],
)
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
    assert_serves_like_transformers(llm, reference, name)


@pytest.mark.parametrize("name", sorted(TP_CONFIGS))
def test_tensor_parallel_ranks_match_transformers(name, tmp_path):
    reference = make_checkpoint(name, tmp_path)
    llm = mlafx.LLM(
        str(tmp_path),
        dtype="float32",
        block_size=4,
        num_kv_blocks=96,
        max_num_batched_tokens=16,
        progress=False,
        compile=False,
        tensor_parallel_size=2,
    )
    try:
        assert_serves_like_transformers(llm, reference, name)
    finally:
        llm.close()


def assert_serves_like_transformers(llm: mlafx.LLM, reference, name: str) -> None:
    """PROMPTS (the long one chunked), then PREFIX_HIT_PROMPT from the prefix cache: greedy
    tokens and logprobs as transformers' (near-ties end a comparison)."""
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


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_mla_block_is_lowered(name):
    """The matcher finds every MLA block of every layer kind (LongCat-Flash: two per layer),
    refuses nothing, and the lowered layer verifies against the captured one."""
    from mlafx.compile.layer_kinds import layer_kinds
    from mlafx.config import ModelConfig
    from mlafx.graph.capture import capture_layer, sample_layer
    from mlafx.models.loader import build_model
    from mlafx.passes.pipeline import lower_step_graph

    cfg = ModelConfig.from_hf_dict(CONFIGS[name]().to_dict())
    model = build_model(cfg, "float32", "dummy")
    assert cfg.attention_blocks == (2 if name == "longcat_flash" else 1)
    for kind in layer_kinds(model):
        sample = sample_layer(model, 4)
        captured = capture_layer(model, kind.layers[0], 4)
        result = lower_step_graph(captured.module(), sample, sample.caches)
        assert len(result.sites) == cfg.attention_blocks, kind.name
        assert result.refusals == [] and result.verify_error is None, kind.name
        sdpa = torch.ops.aten.scaled_dot_product_attention.default
        assert not any(n.target == sdpa for n in result.graph.graph.nodes), kind.name


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_memory_estimate_is_the_models_bytes(name):
    from mlafx.config import ModelConfig, weight_bytes
    from mlafx.models.loader import build_model

    cfg = ModelConfig.from_hf_dict(CONFIGS[name]().to_dict())
    model = build_model(cfg, "float32", "dummy")
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    tensors.pop(model.rope_inv_freq.data_ptr())  # derived, not a weight
    assert weight_bytes(cfg, "float32") == sum(t.nbytes for t in tensors.values())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_transformers_object_is_adopted_without_copies(name):
    """``LLM.from_transformers``'s model: every text-model tensor is the object's own (fp32:
    routers too), Kimi K2.5's vision tower left out; its logits are the object's."""
    from mlafx.models.from_transformers import model_from_transformers

    config = CONFIGS[name]()
    hf_model = random_transformers_model(config, MODEL_CLASSES[type(config)], seed=4321)
    model = model_from_transformers(hf_model)
    theirs = {t.data_ptr() for t in hf_model.parameters()}
    assert all(p.data_ptr() in theirs for p in model.parameters())
    want, _ = transformers_greedy(hf_model, PROMPTS[0], 4)
    llm = mlafx.LLM.from_transformers(hf_model, block_size=4, num_kv_blocks=16, compile=False)
    got = llm.generate([PROMPTS[0]], mlafx.SamplingParams(max_tokens=4))[0].outputs[0]
    assert got.token_ids[:1] == want[:1]


@pytest.mark.parametrize(
    "name, format",
    [("minicpm3", "aoti"), ("longcat_flash", "aoti"), ("longcat_flash", "onnx")],
)
def test_artifacts_serve_the_compiled_engines_tokens(name, format, tmp_path):
    """aoti (the compiled layers, MiniCPM3's host-side scalings) and ONNX (the functional
    whole step: LongCat-Flash's two cache writes per layer) artifacts of the new families."""
    make_checkpoint(name, tmp_path / "checkpoint")
    options = dict(dtype="float32", block_size=4, progress=False)
    params = mlafx.SamplingParams(max_tokens=6, logprobs=0)
    compiled = mlafx.LLM(str(tmp_path / "checkpoint"), num_kv_blocks=96, compile=True, **options)
    want = compiled.generate(PROMPTS, params)
    mlafx.export(str(tmp_path / "checkpoint"), tmp_path / format, format, **options)
    artifact = mlafx.LLM.from_artifact(tmp_path / format, num_kv_blocks=96)
    for a, b in zip(want, artifact.generate(PROMPTS, params), strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        tokens = a.outputs[0].token_ids
        diffs = [
            abs(x[t] - y[t])
            for t, x, y in zip(tokens, a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True)
        ]
        assert max(diffs) <= (0.0 if format == "aoti" else 1e-4)


def test_a_kv_store_reload_serves_longcat_flash_like_transformers(tmp_path):
    """A second engine loads a prompt's two caches per layer from a disk KV store written by
    the first (256-token chunks: the prompt is longer), and still serves transformers' tokens."""
    reference = make_checkpoint("longcat_flash", tmp_path / "checkpoint")
    prompt = [(7 * i + 3) % 151 for i in range(270)]
    options = dict(dtype="float32", block_size=4, num_kv_blocks=160, progress=False,
                   compile=False, hf_overrides={"max_position_embeddings": 512})  # fmt: skip
    store = f"disk:{tmp_path / 'store'}"
    params = mlafx.SamplingParams(max_tokens=NEW_TOKENS, logprobs=1)
    writer = mlafx.LLM(str(tmp_path / "checkpoint"), kv_connector=store, **options)
    writer.generate([prompt], params)
    reader = mlafx.LLM(str(tmp_path / "checkpoint"), kv_connector=store, **options)
    (out,) = reader.generate([prompt], params)
    assert reader.get_metrics()["external_hit_tokens"] >= 256
    want, want_logprobs = transformers_greedy(reference, prompt, NEW_TOKENS)
    got = out.outputs[0]
    got_logprobs = [lp[t] for t, lp in zip(got.token_ids, got.logprobs, strict=True)]
    compare_greedy(want, want_logprobs, got.token_ids, got_logprobs, label="longcat store")
