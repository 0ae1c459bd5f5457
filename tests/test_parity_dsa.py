"""Golden test for DSA sparse attention (DeepSeek-V3.2, GLM-5): mlafx (float32, a
``save_pretrained`` checkpoint) against transformers' own modelling code, on tiny random
configs whose ``index_topk`` (16) is smaller than most prompts, so the indexer's selection
decides what each query sees. Each engine serves prompts of 7..300 tokens with a small token
budget (long prompts are chunked), then a prompt extending an earlier one (a prefix-cache
hit); every generation is compared token by token, tie-aware.

If this fails: ``pytest -k glm -s`` prints each prompt's first divergent position. Suspects:
the indexer's RoPE layout (NeoX halves in V3.2, interleaved in GLM-5), its fp32 head weights,
the selection's visibility (causal, own sequence) and GLM-5's shared layers.
"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import mlafx
from mlafx.config import ModelConfig
from tests.greedy_compare import compare_greedy, random_transformers_model, transformers_greedy

TOPK = 16
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [(7 * i + 3) % 150 for i in range(300)], list(range(20, 61))]
# served after PROMPTS: its first 36 tokens are PROMPTS[2]'s, already in the prefix cache
PREFIX_HIT_PROMPT = list(range(20, 56)) + [7, 7, 3]
NEW_TOKENS = 10

_DSA = dict(
    vocab_size=151, hidden_size=48, intermediate_size=64, moe_intermediate_size=20,
    num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=3, q_lora_rank=20,
    kv_lora_rank=24, qk_nope_head_dim=10, qk_rope_head_dim=6, v_head_dim=12,
    n_routed_experts=6, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
    norm_topk_prob=True, routed_scaling_factor=2.0, first_k_dense_replace=1,
    index_topk=TOPK, index_head_dim=16, index_n_heads=16, max_position_embeddings=512,
    initializer_range=0.2, bos_token_id=None, eos_token_id=None, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)  # fmt: skip

CONFIGS = {
    # every layer runs its indexer (RoPE in NeoX halves on the indexer's first R dims)
    "deepseek_v32": lambda: transformers.DeepseekV32Config(**_DSA),
    # layer 1 reuses layer 0's selection, layer 2 runs its own (interleaved indexer RoPE)
    "glm_moe_dsa": lambda: transformers.GlmMoeDsaConfig(
        **_DSA, indexer_types=["full", "shared", "full"]
    ),
}
MODEL_CLASSES = {
    "deepseek_v32": transformers.DeepseekV32ForCausalLM,
    "glm_moe_dsa": transformers.GlmMoeDsaForCausalLM,
}


def make_checkpoint(name: str, directory, **overrides) -> torch.nn.Module:
    config = CONFIGS[name]()
    for key, value in overrides.items():
        setattr(config, key, value)
    model = random_transformers_model(config, MODEL_CLASSES[name], seed=4321)
    model.save_pretrained(directory)
    return model


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_reads_the_indexer(name, tmp_path):
    make_checkpoint(name, tmp_path)
    cfg = ModelConfig.from_model(tmp_path)
    assert (cfg.index_topk, cfg.index_n_heads, cfg.index_head_dim) == (TOPK, 16, 16)
    assert cfg.rope_interleave and cfg.indexer_rope_interleave == (name == "glm_moe_dsa")
    full = [True, name != "glm_moe_dsa", True]
    assert [cfg.runs_indexer(i) for i in range(3)] == full
    # a latent cache per layer, an indexer cache per layer that runs its indexer
    assert cfg.cache_widths == tuple(w for f in full for w in ((30, 16) if f else (30,)))


def selection_margins(monkeypatch) -> list[float]:
    """Record, for every indexer selection mlafx's reference makes, the smallest gap between a
    query's k-th and (k+1)-th best visible score. transformers picks with ``torch.topk``, whose
    ties are arbitrary: both select the same keys only where the gap exceeds their rounding
    differences, which the test asserts rather than assumes."""
    from mlafx.models import dsa

    margins: list[float] = []
    select = dsa.top_positions

    def recording(scores, mask, key_positions, topk):
        visible = scores.masked_fill(~mask, float("-inf"))
        crowded = mask.sum(1) > topk  # rows where the selection leaves keys out
        if crowded.any():
            best = visible[crowded].topk(topk + 1, dim=1).values
            margins.append(float((best[:, topk - 1] - best[:, topk]).min()))
        return select(scores, mask, key_positions, topk)

    monkeypatch.setattr(dsa, "top_positions", recording)
    return margins


# The compiled variants: every layer MoE, so the layer kinds to compile are V3.2's one and
# GLM-5's full and shared ones (a dense first layer would add another of the same attention)
COMPILED_OVERRIDES = {"mlp_layer_types": ["sparse"] * 3}


@pytest.mark.parametrize(
    "name, tensor_parallel_size, compiled",
    [(name, 1, False) for name in sorted(CONFIGS)]
    + [("glm_moe_dsa", 2, False)]
    + [(name, 1, True) for name in sorted(CONFIGS)],
    ids=[*sorted(CONFIGS), "glm_moe_dsa-tp2", *(f"{n}-compiled" for n in sorted(CONFIGS))],
)
def test_greedy_tokens_and_logprobs_match_transformers(
    name, tensor_parallel_size, compiled, tmp_path, monkeypatch
):
    """Chunked prefills, decodes and a prefix hit; with two tensor-parallel ranks (heads split,
    the indexer replicated: each rank selects the same keys) too; and compiled (the indexer
    and the attention lowered onto ``dsa_indexer_topk`` and ``mla_attention_sparse``)."""
    overrides = {"num_attention_heads": 4, "num_key_value_heads": 4}
    overrides = overrides if tensor_parallel_size > 1 else {}
    reference = make_checkpoint(name, tmp_path, **(COMPILED_OVERRIDES if compiled else overrides))
    margins = selection_margins(monkeypatch)
    llm = mlafx.LLM(
        str(tmp_path),
        dtype="float32",
        block_size=4,
        num_kv_blocks=256,
        max_num_batched_tokens=64,  # the long prompts are served in chunks
        progress=False,
        compile=compiled,
        tensor_parallel_size=tensor_parallel_size,
    )
    try:
        assert_serves_like_transformers(llm, reference, name)
    finally:
        llm.close()
    if compiled:  # the engine's selections were made by the op: check the reference's
        margins = reference_selection_margins(tmp_path, monkeypatch)
    if tensor_parallel_size == 1:  # the ranks' selections are made in their own processes
        assert margins, "the indexer never left a key out: the test does not exercise selection"
        assert min(margins) > 1e-5, (
            f"a selection tie (score gap {min(margins):.2g}) at the top-k boundary: "
            "transformers' torch.topk may keep either key; choose another seed"
        )


def assert_serves_like_transformers(llm: mlafx.LLM, reference, name: str) -> None:
    params = mlafx.SamplingParams(max_tokens=NEW_TOKENS, logprobs=1)
    outputs = llm.generate(PROMPTS, params)
    (hit,) = llm.generate([PREFIX_HIT_PROMPT], params)
    assert hit.num_cached_tokens >= 32, f"no prefix-cache hit ({hit.num_cached_tokens} tokens)"
    compared = 0
    for prompt, output in zip([*PROMPTS, PREFIX_HIT_PROMPT], [*outputs, hit], strict=True):
        want, want_logprobs = transformers_greedy(reference, prompt, NEW_TOKENS)
        got = output.outputs[0].token_ids
        got_logprobs = [lp[t] for t, lp in zip(got, output.outputs[0].logprobs, strict=True)]
        result = compare_greedy(
            want, want_logprobs, got, got_logprobs, label=f"{name} len={len(prompt)}"
        )
        compared += result.compared
    assert compared >= (len(PROMPTS) + 1) * NEW_TOKENS // 2, f"only {compared} compared"


def test_a_kv_store_reload_carries_the_indexer_cache(tmp_path):
    """A second engine loads the 300-token prompt's latent and indexer rows from a disk KV
    store written by the first (256-token chunks) and still serves transformers' tokens."""
    reference = make_checkpoint("glm_moe_dsa", tmp_path / "checkpoint")
    prompt = PROMPTS[1]
    options = dict(dtype="float32", block_size=4, num_kv_blocks=160, progress=False,
                   compile=False)  # fmt: skip
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
    compare_greedy(want, want_logprobs, got.token_ids, got_logprobs, label="dsa store")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_memory_estimate_is_the_models_bytes(name):
    """Indexer weights counted (weights_proj in float32 whatever the model dtype), and each
    token's cache bytes: a latent row per layer plus an indexer row per full layer."""
    from mlafx.config import weight_bytes
    from mlafx.config.memory import kv_bytes_per_token
    from mlafx.models.loader import build_model

    cfg = ModelConfig.from_hf_dict(CONFIGS[name]().to_dict())
    model = build_model(cfg, "bfloat16", "dummy")
    assert model.model.layers[0].self_attn.indexer.weights_proj.weight.dtype == torch.float32
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}
    tensors.pop(model.rope_inv_freq.data_ptr())  # derived, not a weight
    assert weight_bytes(cfg, "bfloat16") == sum(t.nbytes for t in tensors.values())
    indexers = 2 if name == "glm_moe_dsa" else 3
    assert kv_bytes_per_token(cfg, "bfloat16") == 2 * (3 * 30 + indexers * 16)


def test_a_transformers_object_is_adopted_without_copies():
    from mlafx.models.from_transformers import model_from_transformers

    hf_model = random_transformers_model(
        CONFIGS["deepseek_v32"](), MODEL_CLASSES["deepseek_v32"], 1
    )
    model = model_from_transformers(hf_model)
    theirs = {t.data_ptr() for t in hf_model.parameters()}
    assert all(p.data_ptr() in theirs for p in model.parameters())
    want, _ = transformers_greedy(hf_model, PROMPTS[2], 4)
    llm = mlafx.LLM.from_transformers(hf_model, block_size=4, num_kv_blocks=32, compile=False)
    got = llm.generate([PROMPTS[2]], mlafx.SamplingParams(max_tokens=4))[0].outputs[0]
    assert got.token_ids[:1] == want[:1]


def reference_selection_margins(checkpoint, monkeypatch) -> list[float]:
    """``selection_margins`` of mlafx's reference model serving the test's prompts."""
    margins = selection_margins(monkeypatch)
    llm = mlafx.LLM(str(checkpoint), dtype="float32", block_size=4, num_kv_blocks=256,
                    progress=False, compile=False)  # fmt: skip
    llm.generate([*PROMPTS, PREFIX_HIT_PROMPT], mlafx.SamplingParams(max_tokens=NEW_TOKENS))
    return margins


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_dsa_block_is_lowered(name):
    """Each layer kind's MLA site is found with its selection (the layer's own indexer op, or
    a shared layer's input), lowered onto the sparse ops, and verifies against the captured
    layer; ``index_topk`` 4 so that the sample's queries (up to 11 keys) do leave keys out."""
    from mlafx.compile.compiled_step import lower_layer
    from mlafx.compile.layer_kinds import layer_kinds
    from mlafx.models.loader import build_model

    cfg = ModelConfig.from_hf_dict(CONFIGS[name]().to_dict(), {"index_topk": 4})
    model = build_model(cfg, "float32", "dummy")
    kinds = layer_kinds(model)
    assert len(kinds) == (3 if name == "glm_moe_dsa" else 2)  # dense, MoE (shared, full)
    for kind in kinds:
        result = lower_layer(model, kind, block_size=4).lowering
        assert result.refusals == [] and result.verify_error is None, kind.name
        (site,) = result.sites
        own = cfg.runs_indexer(kind.layers[0])
        assert site.selected.name == ("dsa_indexer_topk" if own else "selected"), kind.name
        (lowering,) = result.lowerings
        assert lowering.absorbed.count("mlafx::mla_attention_sparse") == 1 and not lowering.split
        ops = {str(n.target) for n in result.graph.graph.nodes}
        assert ("mlafx.dsa_indexer_topk.default" in ops) == own
        assert "aten.scaled_dot_product_attention.default" not in ops


def test_onnx_export_of_a_dsa_model_is_refused(tmp_path):
    make_checkpoint("glm_moe_dsa", tmp_path / "checkpoint")
    with pytest.raises(ValueError, match="aoti or pt2"):
        mlafx.export(str(tmp_path / "checkpoint"), tmp_path / "onnx", "onnx", dtype="float32")


def test_inspect_shows_the_indexer_and_the_sparse_attention(tmp_path, capsys):
    """``mlafx inspect`` of a GLM-5 checkpoint: the captured step holds an indexer op per full
    layer, and every site (the shared layer's too) is lowered onto the sparse attention."""
    from mlafx.cli import main

    make_checkpoint("glm_moe_dsa", tmp_path)
    argv = ["inspect", "--model", str(tmp_path), "--dtype", "float32", "--block-size", "4"]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [s["layer"] for s in report["sites"]] == [0, 1, 2]
    for site in report["sites"]:
        assert site["paths"]["absorbed"] == [
            "mlafx::batched_matmul", "mlafx::mla_attention_sparse", "mlafx::batched_matmul",
        ] and site["paths"]["split"] == []  # fmt: skip
    assert report["verify"]["ok"] and report["refused"] == []
    captured = report["stages"][0]["ops"]
    assert captured["mlafx.dsa_indexer_topk.default"] == 2  # layers 0 and 2 run an indexer
