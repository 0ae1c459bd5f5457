"""Quantized models (``models/quantized.py``): what is quantized, quantize-on-load from
checkpoints and dummy weights, the memory estimate, and the compiled step against the
reference path over the same quantized weights."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mlafx.compile.compiled_step import lower_layer
from mlafx.compile.layer_kinds import layer_kinds
from mlafx.config import ModelConfig, weight_bytes
from mlafx.config.memory import check_fits_in_memory
from mlafx.config.model_config import ConfigError
from mlafx.kernels.quant_format import dequantize_weight, packed_shape, quantize_weight_ref
from mlafx.models.loader import build_model
from mlafx.models.quantized import QuantizedExperts, QuantizedLinear, Quantizer
from tests.engine_compare import assert_same_greedy, greedy_params, random_prompts, reference_alone
from tests.tiny_models import TINY_OVERRIDES, tiny_llm, write_tiny_checkpoint

BITS = {"int8": 8, "int4": 4}
# one layer kind (MoE, whose shared experts are a SwiGLU): one package to compile per format
MOE_ONLY = {**TINY_OVERRIDES, "first_k_dense_replace": 0}


def _tiny_config_of(overrides: dict) -> ModelConfig:
    return ModelConfig.from_model("deepseek-v2-lite", overrides)


def _tiny_config() -> ModelConfig:
    return _tiny_config_of(TINY_OVERRIDES)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_every_linear_but_kv_b_and_every_expert_stack_is_quantized(quantization):
    cfg = _tiny_config()
    model = build_model(cfg, "bfloat16", "dummy", quantization=quantization, progress=False)
    full = build_model(cfg, "bfloat16", "dummy", progress=False)
    bits = BITS[quantization]
    plain = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    assert plain and all(n.endswith("kv_b_proj") for n in plain)
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            source = full.get_submodule(name).weight
            assert module.qweight.dtype == torch.uint8
            assert module.qweight.shape == packed_shape(*source.shape, bits)
            # streamed dummy weights are the same draws, quantized by the same rule
            assert torch.equal(module.qweight, quantize_weight_ref(source, bits))
        elif isinstance(module, QuantizedExperts):
            source = full.get_submodule(name)
            for expert in range(cfg.n_routed_experts):
                want = quantize_weight_ref(source.down_proj[expert], bits)
                assert torch.equal(module.down_qweight[expert], want)
    assert model.dtype == torch.bfloat16
    assert model.model.layers[1].mlp.gate.weight.dtype == torch.float32  # the router stays


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_quantize_on_load_from_a_checkpoint_equals_quantizing_the_loaded_model(tmp_path, tie):
    cfg = write_tiny_checkpoint(tmp_path / "ckpt", "bfloat16", seed=3, tie_word_embeddings=tie)
    loaded = build_model(cfg, "bfloat16", "auto", tmp_path / "ckpt", quantization="int4",
                         progress=False)  # fmt: skip
    assert isinstance(loaded.lm_head, QuantizedLinear)  # tied or not; the embedding stays
    assert loaded.model.embed_tokens.weight.dtype == torch.bfloat16
    quantized = build_model(cfg, "bfloat16", "dummy", seed=3, progress=False)
    quantizer = Quantizer(quantized, "int4")
    for name, tensor in list(quantized.state_dict(keep_vars=True).items()):
        quantizer.finish([name], tensor)  # (a tied lm_head comes by its own name too)
    quantizer.check_done()
    got, want = loaded.state_dict(), quantized.state_dict()
    assert got.keys() == want.keys()
    for name in got:
        assert torch.equal(got[name], want[name]), name


def test_quantized_reference_is_close_to_the_full_precision_model():
    """Sanity of the whole eager path: int8 logits track bf16 closely, int4 less so."""
    prompts = random_prompts(2, 8, 12, seed=5)
    logits = {}
    for quantization in (None, "int8", "int4"):
        llm = tiny_llm(quantization=quantization)
        (out,) = llm.generate(prompts[:1], greedy_params(1, logprobs=256))
        top = out.outputs[0].logprobs[0]
        logits[quantization] = torch.tensor([top[i] for i in range(256)])
    p = logits[None].exp()
    kl = {q: float((p * (logits[None] - logits[q])).sum()) for q in ("int8", "int4")}
    assert 0 <= kl["int8"] < kl["int4"] < 0.05, kl


def test_memory_estimate_counts_the_quantized_bytes():
    cfg = ModelConfig.from_model("deepseek-v2-lite")
    bf16 = weight_bytes(cfg, "bfloat16")
    int8, int4 = weight_bytes(cfg, "bfloat16", "int8"), weight_bytes(cfg, "bfloat16", "int4")
    assert 29 * 2**30 < bf16 < 30 * 2**30
    assert 0.5 < int8 / bf16 < 0.56 and 0.27 < int4 / bf16 < 0.33
    with pytest.raises(ConfigError, match="int4-quantized weights"):
        deep = ModelConfig.from_model("deepseek-v2-lite", {"num_hidden_layers": 300})  # ~90 GiB
        check_fits_in_memory(deep, "bfloat16", 16, "int4")


def test_dequantized_weights_are_what_the_reference_multiplies():
    w = torch.randn(20, 70) * 0.05
    for bits in (8, 4):
        deq = dequantize_weight(quantize_weight_ref(w, bits), 20, 70)
        step = w.abs().amax() / (127 if bits == 8 else 7)
        assert deq.shape == w.shape and float((deq - w).abs().max()) <= float(step)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_compiled_quantized_engine_matches_its_reference_path(quantization):
    """Same quantized bytes, the compiled kernels against the plain-PyTorch reference."""
    prompts = random_prompts(4, 3, 20, seed=11)
    options = dict(quantization=quantization, hf_overrides=MOE_ONLY, block_size=4)
    refs = reference_alone(prompts, 8, **options)
    llm = tiny_llm(compile=True, **options)
    outputs = llm.generate(prompts, greedy_params(8))
    assert_same_greedy(refs, outputs, f"compiled {quantization}")
    # what the package was lowered to (lowered again: the package may come from the cache)
    model = build_model(_tiny_config_of(MOE_ONLY), "float32", "dummy", progress=False,
                        quantization=quantization)  # fmt: skip
    (kind,) = layer_kinds(model)
    ops = lower_layer(model, kind, 4).lowering.stages[-1].ops
    assert ops["mlafx.moe_experts_quantized.default"] == 1
    # q, kv_a, o and the shared experts' three; kv_b_proj stays in the model dtype
    assert ops["mlafx.linear_quantized.default"] == 6
    assert ops["mlafx.linear_packed.default"] == 2  # kv_b_proj and the fp32 router
    assert ops.get("aten.linear.default", 0) == 0


def test_refusals_are_clear():
    with pytest.raises(ValueError, match="quantization 'int3' is not supported"):
        tiny_llm(quantization="int3")
    import mlafx

    with pytest.raises(ValueError, match="ONNX export of a quantized model"):
        mlafx.export("deepseek-v2-lite", "/nonexistent", "onnx", load_format="dummy",
                     dtype="float32", quantization="int8")  # fmt: skip


def test_quantized_aoti_artifact_ships_the_quantized_bytes_and_serves_the_same_tokens(tmp_path):
    import mlafx

    options = dict(load_format="dummy", hf_overrides=MOE_ONLY, dtype="float32",
                   block_size=4, progress=False)  # fmt: skip
    manifest = mlafx.export("deepseek-v2-lite", tmp_path / "int4", "aoti", quantization="int4",
                            **options)  # fmt: skip
    int4_bytes = manifest.files["weights.safetensors"]["bytes"]
    cfg = ModelConfig.from_model("deepseek-v2-lite", MOE_ONLY)
    estimate = weight_bytes(cfg, "float32", "int4")  # kv_b_proj, norms, embedding in fp32
    assert estimate <= int4_bytes < 1.15 * estimate  # + padding to 16 rows, 32 columns
    assert int4_bytes < 0.4 * weight_bytes(cfg, "float32")
    prompts = random_prompts(3, 3, 12, seed=2)
    served = mlafx.LLM.from_artifact(tmp_path / "int4", num_kv_blocks=64)
    compiled = tiny_llm(compile=True, quantization="int4", hf_overrides=MOE_ONLY, block_size=4)
    got = served.generate(prompts, greedy_params(6))
    want = compiled.generate(prompts, greedy_params(6))
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
