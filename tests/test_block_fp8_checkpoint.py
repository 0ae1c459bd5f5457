"""Block-scaled FP8 checkpoints as DeepSeek publishes them (``models/block_fp8_checkpoint.py``):
every linear but lm_head stored as ``weight`` F8_E4M3 plus ``weight_scale_inv`` F32 per
block, the router, norms, embeddings and lm_head in bf16/fp32, ``quantization_config`` with
``quant_method: fp8``. Written here from transformers' own tiny models (DeepSeek-V3 and Kimi
K2 shapes), run against transformers on the dequantized weights.

Tolerance: the reference path multiplies fp32 activations by the float32 dequantized weight,
as transformers does, so it matches to 1e-4 in logprob (measured: within 2e-6). The compiled
step runs the kernels, which scale each block's fp32 sum instead of each weight: 1e-4 too
(measured: within 1e-5). Block shapes leave partial edge blocks on both axes (hidden 64 in
[16, 32] blocks; I = 24 rows split 16 + 8; [128, 128] blocks larger than every matrix).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import mlafx
from mlafx.config import ModelConfig, weight_bytes
from mlafx.config.memory import parameter_kinds
from mlafx.config.model_config import ConfigError
from mlafx.config.stored_quantization import BlockFp8
from mlafx.kernels.fp8_format import dequantize_fp8, quantize_fp8
from mlafx.models.fp8 import Fp8Experts, Fp8Linear
from mlafx.models.weights import WeightLoadError
from tests.greedy_compare import compare_greedy, transformers_greedy
from tests.stored_generation import (
    NEW_TOKENS,
    PROMPTS,
    TINY_V3,
    generate,
    logprobs_of,
    top_rows,
    write_stored_checkpoint,
)

# name -> (config overrides, weight_block_size)
MODELS = {
    # DeepSeek-V3 shaped, blocks smaller than the matrices: partial row and column blocks
    "v3_blocks_16x32": ({"moe_intermediate_size": 24}, [16, 32]),
    # Kimi K2 shaped (one expert group, more experts), DeepSeek's own [128, 128] blocks
    "kimi_k2_128x128": (
        {
            "moe_intermediate_size": 32,
            "n_routed_experts": 16,
            "num_experts_per_tok": 4,
            "n_group": 1,
            "topk_group": 1,
        },
        [128, 128],
    ),  # fmt: skip
}


def _fp8_config(block: list[int]) -> dict:
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": block,
    }


def write_fp8_checkpoint(name: str, directory: Path) -> torch.nn.Module:
    """The checkpoint of ``MODELS[name]`` (``write_fp8_checkpoint_of``)."""
    overrides, block = MODELS[name]
    return write_fp8_checkpoint_of(directory, overrides, block)


def write_fp8_checkpoint_of(directory: Path, overrides: dict, block: list[int]) -> torch.nn.Module:
    """A tiny checkpoint (``TINY_V3`` with ``overrides``) in DeepSeek's FP8 layout with
    ``block``; returns transformers' model over its dequantized weights (float32, saved beside
    it in ``directory / "dequantized"``)."""

    def quantize(tensors: dict, dequantized: dict) -> None:
        quantized = [k for k in tensors if k.endswith("_proj.weight")]  # not lm_head, the router
        assert any(".experts." in k for k in quantized) and any("kv_b_proj" in k for k in quantized)
        for key in quantized:
            q, scale = quantize_fp8(tensors[key], tuple(block))
            tensors[key] = q
            tensors[key.removesuffix("weight") + "weight_scale_inv"] = scale
            dequantized[key] = dequantize_fp8(q, scale, tuple(block)).to(dequantized[key].dtype)

    return write_stored_checkpoint(directory, overrides, 2468, quantize, _fp8_config(block),
                                   reference_dtype=torch.float32)  # fmt: skip


def _compare_with_transformers(name, reference, outputs):
    compared = 0
    for i, prompt in enumerate(PROMPTS):
        want, want_logprobs = transformers_greedy(reference, prompt, NEW_TOKENS)
        got = outputs[i].outputs[0].token_ids
        compared += compare_greedy(want, want_logprobs, got, logprobs_of(outputs[i]),
                                   label=f"{name} #{i}").compared  # fmt: skip
    assert compared >= len(PROMPTS) * NEW_TOKENS * 3 // 4, f"only {compared} positions compared"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_an_fp8_checkpoint_is_its_dequantized_weights(name, tmp_path):
    """The reference path against transformers, with chunked prompts and prefix hits."""
    reference = write_fp8_checkpoint(name, tmp_path)
    _compare_with_transformers(name, reference, generate(tmp_path, compiled=False))


def test_an_fp8_checkpoint_compiles_to_the_same_function(tmp_path):
    """The compiled step (the FP8 kernels) against transformers and the reference path."""
    name = "v3_blocks_16x32"
    reference = write_fp8_checkpoint(name, tmp_path)
    compiled = generate(tmp_path, compiled=True)
    _compare_with_transformers(name, reference, compiled)
    eager = generate(tmp_path, compiled=False)
    for i in range(len(PROMPTS)):
        compare_greedy(
            eager[i].outputs[0].token_ids, top_rows(eager[i], TINY_V3["vocab_size"]),
            compiled[i].outputs[0].token_ids, logprobs_of(compiled[i]), label=f"{name} #{i}",
        )  # fmt: skip


def test_fp8_modules_keep_the_files_bytes(tmp_path):
    write_fp8_checkpoint("v3_blocks_16x32", tmp_path)
    llm = mlafx.LLM(str(tmp_path), dtype="bfloat16", compile=False, progress=False,
                    num_kv_blocks=8)  # fmt: skip
    model = llm.model
    layer = model.model.layers[1]
    assert isinstance(layer.mlp.experts, Fp8Experts)
    assert layer.mlp.experts.gate_up_weight.dtype == torch.float8_e4m3fn
    assert isinstance(layer.self_attn.q_a_proj, Fp8Linear)
    assert isinstance(layer.mlp.shared_experts.gate_proj, Fp8Linear)
    assert isinstance(model.model.layers[0].mlp.down_proj, Fp8Linear)
    kv_b = layer.self_attn.kv_b_proj  # dequantized: its absorbed weights are bf16 constants
    assert type(kv_b) is torch.nn.Linear and kv_b.weight.dtype == torch.bfloat16
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight.dtype == torch.bfloat16
    stored = load_file(tmp_path / "model.safetensors")
    key = "model.layers.1.self_attn.q_a_proj"
    assert torch.equal(layer.self_attn.q_a_proj.weight.view(torch.uint8),
                       stored[f"{key}.weight"].view(torch.uint8))  # fmt: skip
    out = llm.generate([[5, 6, 7]], mlafx.SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_a_missing_scale_is_named(tmp_path):
    write_fp8_checkpoint("v3_blocks_16x32", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"]
    del tensors["model.layers.0.self_attn.o_proj.weight_scale_inv"]
    (tmp_path / "model.safetensors").unlink()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightLoadError) as info:
        mlafx.LLM(str(tmp_path), dtype="float32", compile=False, progress=False, num_kv_blocks=8)
    message = str(info.value)
    assert "experts.3.up_proj.weight_scale_inv: missing" in message
    assert "layers.0.self_attn.o_proj.weight_scale_inv: missing" in message


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"weight_block_size": [128, 48]}, "weight_block_size"),
        ({"activation_scheme": "static"}, "activation_scheme"),
        ({"fmt": "e5m2"}, "fmt"),
    ],
)
def test_an_unsupported_fp8_config_is_one_line(change, key, tmp_path):
    write_fp8_checkpoint("v3_blocks_16x32", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"].update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError) as info:
        mlafx.LLM(str(tmp_path), dtype="float32", compile=False, progress=False)
    message = str(info.value)
    assert f"quantization_config.{key}" in message and "\n" not in message


def test_the_memory_estimate_counts_the_stored_bytes():
    """DeepSeek-V2-Lite in DeepSeek's FP8 layout: one byte per linear weight (plus a float32
    per 128 x 128 block), embeddings, lm_head and kv_b_proj in bf16: about half of bf16."""
    cfg = ModelConfig.from_model("deepseek-v2-lite")
    bf16 = weight_bytes(cfg, "bfloat16")
    fp8 = weight_bytes(cfg, "bfloat16", stored=BlockFp8((128, 128)))
    kinds = parameter_kinds(cfg)
    linears = sum(kinds[k] for k in ("attention", "dense_mlp", "shared_experts", "routed_experts"))
    rest = kinds["kept"] + kinds["kv_b"] + kinds["lm_head"]
    assert fp8 == int(linears * (1 + 4 / 128**2) + rest * 2 + kinds["fp32"] * 4)
    assert 0.5 < fp8 / bf16 < 0.53


def test_an_aoti_artifact_keeps_the_fp8_bytes_and_serves_the_same_tokens(tmp_path):
    write_fp8_checkpoint("v3_blocks_16x32", tmp_path / "ckpt")
    manifest = mlafx.export(tmp_path / "ckpt", tmp_path / "aoti", "aoti", dtype="float32",
                            block_size=4, progress=False)  # fmt: skip
    from safetensors import safe_open

    with safe_open(tmp_path / "aoti" / "weights.safetensors", "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118
    assert "F8_E4M3" in dtypes, dtypes
    assert manifest.files["weights.safetensors"]["bytes"] < 0.5 * sum(
        p.stat().st_size for p in (tmp_path / "ckpt" / "dequantized").glob("*.safetensors")
    )
    served = mlafx.LLM.from_artifact(tmp_path / "aoti", num_kv_blocks=64)
    compiled = mlafx.LLM(str(tmp_path / "ckpt"), dtype="float32", block_size=4,
                         num_kv_blocks=64, progress=False)  # fmt: skip
    params = mlafx.SamplingParams(max_tokens=6, ignore_eos=True)
    got = served.generate(PROMPTS[:2], params)
    want = compiled.generate(PROMPTS[:2], params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_onnx_export_of_an_fp8_checkpoint_is_refused(tmp_path):
    write_fp8_checkpoint("v3_blocks_16x32", tmp_path / "ckpt")
    with pytest.raises(ValueError, match="ONNX export of a block-FP8 checkpoint"):
        mlafx.export(tmp_path / "ckpt", tmp_path / "onnx", "onnx", dtype="float32",
                     progress=False)  # fmt: skip
