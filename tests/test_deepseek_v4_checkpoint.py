"""DeepSeek-V4 checkpoints as DeepSeek ships them (``models/deepseek_v4/checkpoint.py``):
DeepSeek's names, dense linears in block FP8 with ue8m0 scales, routed experts in FP4.

The references are transformers': its own loader (conversion mapping) reads the tests'
unquantized checkpoint, and its own dequantizer (``Fp8Dequantize``) gives the weights of the
quantized one; mlafx reads the bytes and must compute the same function."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from v4_cases import PagedRun, reference_logprobs, transformers_v4
from v4_checkpoints import WIDTHS, write_deepseek_checkpoint, write_dequantized_copy

from mlafx.models.deepseek_v4.attention import GroupedLinear
from mlafx.models.deepseek_v4.checkpoint import load_deepseek_v4
from mlafx.models.deepseek_v4.quantized import Fp8GroupedLinear, StoredExperts
from mlafx.models.fp8 import Fp8Linear
from mlafx.models.weights import WeightLoadError

TOL = 1e-4


@pytest.fixture(scope="module")
def source():
    return transformers_v4(seed=1, **WIDTHS)


def _transformers_load(path: Path):
    from transformers import DeepseekV4ForCausalLM

    model, info = DeepseekV4ForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info  # every key of DeepSeek's layout has its place
    return model.eval()


def _compare(model, reference, seed: int) -> None:
    ids = torch.randint(0, 97, (60,), generator=torch.Generator().manual_seed(seed)).tolist()
    got = PagedRun(model, 16).run(ids, [30, 1, 29])
    err = float((got - reference_logprobs(reference, ids)).abs().max())
    assert err < TOL, f"log-probabilities off by {err:.3g}"


def test_unquantized_checkpoint_in_deepseeks_names(source, tmp_path):
    written = write_deepseek_checkpoint(source, tmp_path, quantized=False)
    assert "layers.1.attn.indexer.compressor.wkv.weight" in written  # DeepSeek's names
    reference = _transformers_load(tmp_path)
    model = load_deepseek_v4(tmp_path, torch.float32)
    _compare(model, reference, seed=0)


def test_fp8_and_fp4_checkpoint_matches_transformers_dequantized(source, tmp_path):
    written = write_deepseek_checkpoint(source, tmp_path / "fp8", quantized=True)
    assert written["layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert written["layers.0.attn.wq_a.scale"].dtype == torch.float8_e8m0fnu
    assert written["layers.0.ffn.experts.0.w1.weight"].dtype == torch.int8
    write_dequantized_copy(written, tmp_path / "fp8", tmp_path / "ref")

    model = load_deepseek_v4(tmp_path / "fp8", torch.float32)
    attn = model.model.layers[1].self_attn
    assert (
        isinstance(attn.q_a_proj, Fp8Linear) and attn.q_a_proj.weight.dtype == torch.float8_e4m3fn
    )
    assert isinstance(attn.o_a_proj, Fp8GroupedLinear)
    assert not isinstance(attn.compressor.kv_proj, Fp8Linear)  # DeepSeek ships it bf16
    experts = model.model.layers[1].mlp.experts
    assert isinstance(experts, StoredExperts) and experts.fmt == "fp4"
    assert experts.gate_up_weight.dtype == torch.int8
    _compare(model, _transformers_load(tmp_path / "ref"), seed=1)


def test_every_problem_is_reported_at_once(source, tmp_path):
    written = write_deepseek_checkpoint(source, tmp_path, quantized=True)
    del written["layers.2.ffn.experts.3.w2.weight"], written["layers.2.ffn.experts.3.w2.scale"]
    written["layers.0.attn.wq_b.scale"] = written["layers.0.attn.wq_b.scale"][:1].contiguous()
    written["layers.0.attn.mystery.weight"] = torch.zeros(2)
    save_file(written, tmp_path / "model.safetensors")
    with pytest.raises(WeightLoadError) as caught:
        load_deepseek_v4(tmp_path, torch.float32)
    problems = "\n".join(caught.value.problems)
    assert "model.layers.2.mlp.experts.3.down: routed expert part missing" in problems
    assert "model.layers.0.self_attn.q_b_proj.weight: scale shape" in problems
    assert "model.layers.0.self_attn.mystery.weight: no tensor of the model" in problems


def test_a_bf16_load_keeps_transformers_float32_parts(source, tmp_path):
    write_deepseek_checkpoint(source, tmp_path, quantized=True)
    model = load_deepseek_v4(tmp_path, torch.bfloat16)
    layer = model.model.layers[1]
    assert layer.self_attn.sinks.dtype == torch.float32
    assert layer.attn_hc.fn.dtype == torch.float32
    assert layer.self_attn.compressor.position_bias.dtype == torch.float32
    assert layer.input_layernorm.weight.dtype == torch.float32
    assert layer.self_attn.compressor.kv_proj.weight.dtype == torch.bfloat16
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert isinstance(model.model.layers[0].self_attn.o_a_proj, Fp8GroupedLinear | GroupedLinear)
    ids = torch.arange(40) % 97
    run = PagedRun(model, 16)
    run.caches = [c.to(torch.bfloat16) for c in run.caches]
    logprobs = run.run(ids.tolist(), [40])
    assert torch.isfinite(logprobs).all()
