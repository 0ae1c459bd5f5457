"""Checkpoints stored quantized by their makers (``config/stored_quantization.py``,
``models/packed_int4_checkpoint.py``): the config check, the lossless repacking of
compressed-tensors pack-quantized int4, and whole models written with the ``compressed-tensors``
package itself, run against ``transformers`` on the package's own dequantized weights.

How close to transformers, and why two tests: mlafx's int4 linears quantize their activations
to int8 per group of 32 (W4A8, the op semantics of ``kernels/quant_format.py``) where
transformers multiplies the dequantized weights by fp32 activations. So the loader is checked
exactly (1e-4) with the reference path's activation rounding switched off, and the compiled
step against the reference path over the same bytes (1e-4). Measured with the rounding on,
against transformers: logprobs within 0.021 (kimi_k2_experts) and 0.080 (v3_channel_all, every
linear int4 per channel) over the positions before the first differing token (at 32 and 41 of
48 positions).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import (
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
)
from safetensors.torch import load_file, save_file

import mlafx
from mlafx.config.model_config import ConfigError
from mlafx.config.stored_quantization import PackedInt4, stored_quantization
from mlafx.kernels import quant_format
from mlafx.kernels.quant_format import GROUP, dequantize_weight, repack_compressed_int4
from mlafx.models.quantized import QuantizedExperts, QuantizedLinear
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

# ---- the config -------------------------------------------------------------------------


def _scheme(**weights: object) -> QuantizationScheme:
    args = dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**{**args, **weights}))


def _quantization_config(scheme: QuantizationScheme, ignore: list[str]) -> dict:
    """The ``quantization_config`` compressed-tensors writes for ``scheme``."""
    config = QuantizationConfig(
        config_groups={"group_0": scheme},
        format="pack-quantized",
        quantization_status="compressed",
        ignore=ignore,
    )
    return config.model_dump(mode="json")


def test_a_kimi_style_config_is_read():
    ignore = ["lm_head", r"re:.*self_attn.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*"]
    stored = stored_quantization({"quantization_config": _quantization_config(_scheme(), ignore)})
    assert stored == PackedInt4(group_size=32, ignore=tuple(ignore))
    assert stored.ignores("lm_head") and stored.ignores("model.layers.3.self_attn.q_a_proj")
    assert stored.ignores("model.layers.0.mlp.gate_proj")
    assert not stored.ignores("model.layers.3.mlp.experts.7.gate_proj")
    assert not stored.ignores("lm_head_x")  # exact names are exact
    channel = _quantization_config(_scheme(strategy="channel", group_size=None), [])
    assert stored_quantization({"text_config": {"quantization_config": channel}}) == PackedInt4(
        group_size=None
    )
    assert stored_quantization({"hidden_size": 8}) is None


def _cases() -> dict[str, tuple[dict, str]]:
    base = _quantization_config(_scheme(), ["lm_head"])

    def edit(path: str, value: object) -> dict:
        config = json.loads(json.dumps(base))
        where = config
        *parents, leaf = path.split(".")
        for p in parents:
            where = where[p]
        where[leaf] = value
        return config

    weights = "config_groups.group_0.weights"
    return {
        "method": ({"quant_method": "awq", "bits": 4}, "quant_method = 'awq'"),
        "format": (edit("format", "int-quantized"), "format = 'int-quantized'"),
        "bits": (edit(f"{weights}.num_bits", 8), "weights.num_bits = 8"),
        "asymmetric": (edit(f"{weights}.symmetric", False), "weights.symmetric = False"),
        "float": (edit(f"{weights}.type", "float"), "weights.type = 'float'"),
        "group": (edit(f"{weights}.group_size", 16), "weights.group_size = 16"),
        "actorder": (edit(f"{weights}.actorder", "group"), "weights.actorder = 'group'"),
        "activations": (
            edit("config_groups.group_0.input_activations", {"num_bits": 8}),
            "input_activations",
        ),
        "kv_cache": (edit("kv_cache_scheme", {"num_bits": 8}), "kv_cache_scheme"),
        "status": (edit("quantization_status", "frozen"), "quantization_status = 'frozen'"),
        "fp8_block": ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
    }


@pytest.mark.parametrize("case", sorted(_cases()))
def test_an_unsupported_config_is_one_line_naming_the_key(case):
    config, names = _cases()[case]
    with pytest.raises(ConfigError) as info:
        stored_quantization({"quantization_config": config})
    message = str(info.value)
    assert names in message and "\n" not in message
    assert "mlafx serves" in message


# ---- repacking ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rows", "cols", "group"),
    [(16, 32, 32), (37, 96, 32), (20, 128, 64), (33, 256, 128), (24, 40, None), (5, 7, None)],
)
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16])
def test_repacking_is_lossless(rows, cols, group, scale_dtype):
    gen = torch.Generator().manual_seed(rows * cols)
    values = torch.randint(-8, 8, (rows, cols), generator=gen, dtype=torch.int8)
    values[0, :4] = torch.tensor([-8, 7, 0, -1], dtype=torch.int8)
    groups = 1 if group is None else cols // group
    scale = (torch.rand(rows, groups, generator=gen) * 0.1 + 1e-3).to(scale_dtype)
    packed = pack_to_int32(values, 4)
    want = values.float() * scale.float().repeat_interleave(cols // groups, dim=1)
    ours = repack_compressed_int4(packed, scale, cols, group)
    assert torch.equal(dequantize_weight(ours, rows, cols), want)


def test_a_scale_float16_cannot_hold_is_refused():
    packed = pack_to_int32(torch.zeros(16, 32, dtype=torch.int8), 4)
    scale = torch.full((16, 1), 0.1, dtype=torch.float32)  # 0.1 rounds in float16
    with pytest.raises(ValueError, match="not exactly a float16"):
        repack_compressed_int4(packed, scale, 32, 32)


# ---- whole checkpoints --------------------------------------------------------------------

# name -> (config overrides, scheme, ignore list)
MODELS = {
    # Kimi K2-Thinking's layout: routed experts int4 in groups of 32, the rest bf16/fp32
    "kimi_k2_experts": (
        {"moe_intermediate_size": 32},
        _scheme(),
        [
            "lm_head",
            r"re:.*self_attn.*",
            r"re:.*shared_experts.*",
            r"re:.*mlp\.(gate|up|down)_proj.*",
        ],
    ),
    # every linear but lm_head per output channel (kv_b_proj too: dequantized on load), with an
    # expert width I = 24 whose gate and up rows share a 16-row block and whose down rows have a
    # partial group of 32 columns
    "v3_channel_all": (
        {"moe_intermediate_size": 24},
        _scheme(strategy="channel", group_size=None),
        ["lm_head"],
    ),
}


def _packed_module_names(keys: list[str], ignore: list[str]) -> list[str]:
    """The checkpoint's linears (``*_proj``, ``lm_head``; per-expert ones included) that
    ``ignore`` does not keep: the modules compressed-tensors' ``targets=["Linear"]`` packs."""
    check = PackedInt4(group_size=32, ignore=tuple(ignore))
    names = [k.removesuffix(".weight") for k in keys if k.endswith("_proj.weight")]
    names += ["lm_head"] if "lm_head.weight" in keys else []
    return [name for name in names if not check.ignores(name)]


def _scale_of(weight: torch.Tensor, scheme: QuantizationScheme) -> torch.Tensor:
    """A bf16 absmax scale per group (or channel), as compressed-tensors' minmax observer."""
    size = weight.shape[1] if scheme.weights.group_size is None else scheme.weights.group_size
    groups = weight.reshape(weight.shape[0], -1, size)
    return (groups.abs().amax(-1) / 7.5).clamp_min(1e-4).to(torch.bfloat16)


def _dequantized(compressed: dict[str, torch.Tensor]) -> torch.Tensor:
    """scale * v in float32, v unpacked by compressed-tensors (exact; its own ``decompress``
    rounds the product to the scale's dtype, bf16)."""
    shape = torch.Size(compressed["weight_shape"].tolist())
    values = unpack_from_int32(compressed["weight_packed"], 4, shape).float()
    scale = compressed["weight_scale"].float()
    return values * scale.repeat_interleave(shape[1] // scale.shape[1], dim=1)


def write_packed_checkpoint(name: str, directory: Path) -> torch.nn.Module:
    """A tiny DeepSeek-V3 checkpoint in ``MODELS[name]``'s int4 layout, written with
    compressed-tensors; returns transformers' model over its dequantized weights
    (``_dequantized``, saved beside it in ``directory / "dequantized"``)."""
    overrides, scheme, ignore = MODELS[name]

    def pack(tensors: dict, dequantized: dict) -> None:
        packed = _packed_module_names(list(tensors), ignore)
        assert any(".experts." in m for m in packed)
        for module_name in packed:
            weight = tensors.pop(f"{module_name}.weight")
            state = {"weight": weight, "weight_scale": _scale_of(weight, scheme)}
            compressed = PackedQuantizationCompressor.compress(state, scheme)
            for key, value in compressed.items():
                tensors[f"{module_name}.{key}"] = value
            dequantized[f"{module_name}.weight"] = _dequantized(compressed).to(weight.dtype)

    config = _quantization_config(scheme, ignore)
    return write_stored_checkpoint(directory, overrides, 4321, pack, config)


def _unrounded_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``quant_format.quantize_activations`` without the int8 rounding: x itself, scale 1."""
    m, k = x.shape
    groups = -(-k // GROUP)
    padded = torch.zeros(m, groups * GROUP, dtype=torch.float32)
    padded[:, :k] = x
    return padded.view(m, groups, GROUP), torch.ones(m, groups)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_packed_checkpoint_is_exactly_its_dequantized_weights(name, tmp_path, monkeypatch):
    """The loader against transformers on the package's dequantized weights: with the
    reference path's activation rounding switched off (the int4 op's semantics round them to
    int8, which transformers does not), the two compute the same function."""
    reference = write_packed_checkpoint(name, tmp_path)
    monkeypatch.setattr(quant_format, "quantize_activations", _unrounded_activations)
    outputs = generate(tmp_path, compiled=False)
    compared = 0
    for i, prompt in enumerate(PROMPTS):
        want, want_logprobs = transformers_greedy(reference, prompt, NEW_TOKENS)
        got = outputs[i].outputs[0].token_ids
        label = f"{name} #{i}"
        compared += compare_greedy(want, want_logprobs, got, logprobs_of(outputs[i]),
                                   label=label).compared  # fmt: skip
    assert compared >= len(PROMPTS) * NEW_TOKENS * 3 // 4, f"only {compared} positions compared"


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_packed_checkpoint_compiles_to_the_reference_paths_function(name, tmp_path):
    """The compiled step (int4 kernels) against the reference path over the same bytes and
    the same W4A8 semantics: they differ in fp32 summation order only."""
    write_packed_checkpoint(name, tmp_path)
    eager = generate(tmp_path, compiled=False)
    compiled = generate(tmp_path, compiled=True)
    compared = 0
    for i in range(len(PROMPTS)):
        compared += compare_greedy(
            eager[i].outputs[0].token_ids, top_rows(eager[i], TINY_V3["vocab_size"]),
            compiled[i].outputs[0].token_ids, logprobs_of(compiled[i]), label=f"{name} #{i}",
        ).compared  # fmt: skip
    assert compared >= len(PROMPTS) * NEW_TOKENS * 3 // 4, f"only {compared} positions compared"


def test_a_packed_checkpoint_serves_batch_invariant(tmp_path):
    """Batch-invariant mode over the published int4 bytes (repacked into the int4 kernels'
    format): each prompt alone equals it inside a batch of the others, chunked elsewhere."""
    write_packed_checkpoint("v3_channel_all", tmp_path)
    options = dict(dtype="float32", block_size=4, num_kv_blocks=256, max_num_batched_tokens=16,
                   progress=False, compile=True, batch_invariant=True)  # fmt: skip
    params = mlafx.SamplingParams(max_tokens=NEW_TOKENS, logprobs=2, ignore_eos=True)

    def results(outputs: list[mlafx.RequestOutput]) -> list[tuple]:
        return [(tuple(o.outputs[0].token_ids), logprobs_of(o)) for o in outputs]

    llm = mlafx.LLM(str(tmp_path), **options)
    alone = [results(llm.generate([p], params))[0] for p in PROMPTS]
    llm = mlafx.LLM(str(tmp_path), **options)
    assert results(llm.generate(PROMPTS, params)) == alone


def test_packed_modules_load_as_quantized_modules_from_their_bytes(tmp_path):
    write_packed_checkpoint("kimi_k2_experts", tmp_path)
    llm = mlafx.LLM(str(tmp_path), dtype="bfloat16", compile=False, progress=False,
                    num_kv_blocks=8)  # fmt: skip
    model = llm.model
    layer = model.model.layers[1]
    assert isinstance(layer.mlp.experts, QuantizedExperts)
    assert type(layer.mlp.shared_experts.gate_proj) is torch.nn.Linear  # ignored: bf16
    assert type(layer.self_attn.q_a_proj) is torch.nn.Linear
    assert type(model.lm_head) is torch.nn.Linear
    assert not any(isinstance(m, QuantizedLinear) for m in model.modules())


def test_a_packed_checkpoint_with_a_missing_part_names_it(tmp_path):
    write_packed_checkpoint("kimi_k2_experts", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight_scale"]
    del tensors["model.layers.1.mlp.experts.5.down_proj.weight_packed"]
    del tensors["model.layers.1.mlp.experts.5.down_proj.weight_scale"]
    del tensors["model.layers.1.mlp.experts.5.down_proj.weight_shape"]
    (tmp_path / "model.safetensors").unlink()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightLoadError) as info:
        mlafx.LLM(str(tmp_path), dtype="float32", compile=False, progress=False, num_kv_blocks=8)
    message = str(info.value)
    assert "experts.3.up_proj.weight_scale: missing" in message
    assert "expert linears are not (first: model.layers.1.mlp.experts.5.down_proj)" in message


def test_a_kimi_k25_wrapped_packed_checkpoint_serves_its_language_model(tmp_path):
    """Kimi K2.5 as published: the int4 language model under ``language_model.*`` names in a
    ``kimi_k25`` config (quantization_config at the top), a vision tower beside it. It serves
    what the same checkpoint unwrapped serves (to fp32 rounding: the files lay the tensors out
    at other offsets, so some are mapped where the others are copied)."""
    plain = tmp_path / "plain"
    wrapped = tmp_path / "wrapped"
    write_packed_checkpoint("kimi_k2_experts", plain)
    wrapped.mkdir()
    text = json.loads((plain / "config.json").read_text())
    quantization = text.pop("quantization_config")
    config = {"model_type": "kimi_k25", "text_config": text, "quantization_config": quantization,
              "tie_word_embeddings": text.get("tie_word_embeddings", False)}  # fmt: skip
    (wrapped / "config.json").write_text(json.dumps(config))
    tensors = {
        ("language_model." + k if k.startswith("model.") else "language_model.lm_head.weight"
         if k == "lm_head.weight" else k): v
        for k, v in load_file(plain / "model.safetensors").items()
    }  # fmt: skip
    assert not [k for k in tensors if not k.startswith("language_model.")]
    tensors["vision_tower.patch_embed.proj.weight"] = torch.ones(4, 3)
    tensors["mm_projector.proj.0.weight"] = torch.ones(2, 2)
    save_file(tensors, str(wrapped / "model.safetensors"))
    want, got = generate(plain, compiled=False), generate(wrapped, compiled=False)
    for a, b in zip(want, got, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert logprobs_of(a) == pytest.approx(logprobs_of(b), abs=1e-5)
