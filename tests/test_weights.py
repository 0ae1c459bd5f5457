"""Weight loading and dummy init, with transformers' own models as the target module.

transformers 5's in-memory state_dict keys are the mlafx model's keys (fused experts
``mlp.experts.gate_up_proj`` [E, 2I, D] / ``down_proj`` [E, D, I]), while its
``save_pretrained`` writes the per-expert Hub layout — so a save/load round trip through
a fresh transformers model exercises the real conversion.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    Glm4MoeLiteConfig,
    Glm4MoeLiteForCausalLM,
)

from mlafx.models import weights
from mlafx.models.weights import WeightLoadError, init_dummy_weights, load_safetensors_weights

_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    max_position_embeddings=256,
)


def _v2(**overrides: object) -> DeepseekV2ForCausalLM:
    return DeepseekV2ForCausalLM(DeepseekV2Config(**{**_COMMON, "q_lora_rank": None, **overrides}))


def _v3(**overrides: object) -> DeepseekV3ForCausalLM:
    cfg = {**_COMMON, "q_lora_rank": 48, "n_group": 2, "topk_group": 1, **overrides}
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**cfg))
    with torch.no_grad():  # transformers zero-inits the correction bias; make it worth checking
        for layer in model.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_()
    return model


def _glm(**overrides: object) -> Glm4MoeLiteForCausalLM:
    cfg = {**_COMMON, "q_lora_rank": 48, "n_group": 1, "topk_group": 1, **overrides}
    return Glm4MoeLiteForCausalLM(Glm4MoeLiteConfig(**cfg))


FAMILIES = {"v2": _v2, "v3": _v3, "glm4_moe_lite": _glm}


def _zeroed_like(model: nn.Module) -> nn.Module:
    """A fresh model of the same class and config with every tensor zeroed."""
    fresh = type(model)(model.config)
    with torch.no_grad():
        for t in fresh.state_dict(keep_vars=True).values():
            t.data.zero_()
    return fresh


def _assert_equal(got: nn.Module, want: nn.Module) -> None:
    want_sd = want.state_dict()
    got_sd = got.state_dict()
    assert got_sd.keys() == want_sd.keys()
    for key, value in want_sd.items():
        torch.testing.assert_close(
            got_sd[key], value.to(got_sd[key].dtype), rtol=0, atol=0, msg=key
        )


def _load(model: nn.Module, path: Path) -> None:
    load_safetensors_weights(
        model, path, num_hidden_layers=model.config.num_hidden_layers, progress=False
    )


def _save_fused(
    model: nn.Module,
    path: Path,
    drop: tuple[str, ...] = (),
    extra: dict[str, torch.Tensor] | None = None,
) -> None:
    """Write the model's own (fused-expert) state_dict as one model.safetensors."""
    path.mkdir(exist_ok=True)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items() if k not in drop}
    save_file({**sd, **(extra or {})}, str(path / "model.safetensors"))


def _rewrite(path: Path, edit: dict[str, torch.Tensor | None]) -> None:
    """Edit a single-file checkpoint in place: a None value deletes that key."""
    file = path / "model.safetensors"
    with safe_open(str(file), framework="pt") as f:
        sd = {k: f.get_tensor(k) for k in f.keys()}
    for key, value in edit.items():
        if value is None:
            del sd[key]
        else:
            sd[key] = value
    save_file(sd, str(file))


@pytest.mark.parametrize("family", FAMILIES)
def test_per_expert_round_trip(family: str, tmp_path: Path) -> None:
    model = FAMILIES[family]()
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert "model.layers.1.mlp.experts.3.up_proj.weight" in f.keys()  # the Hub layout
    fresh = _zeroed_like(model)
    _load(fresh, tmp_path)
    _assert_equal(fresh, model)


def test_fused_layout(tmp_path: Path) -> None:
    model = _v3()
    _save_fused(model, tmp_path)
    fresh = _zeroed_like(model)
    _load(fresh, tmp_path)
    _assert_equal(fresh, model)


def test_sharded(tmp_path: Path) -> None:
    model = _v2()
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    fresh = _zeroed_like(model)
    _load(fresh, tmp_path)
    _assert_equal(fresh, model)


def test_bf16_target_casts_and_fp32_gate_stays(tmp_path: Path) -> None:
    model = _v3()
    model.save_pretrained(tmp_path)
    fresh = _zeroed_like(model).to(torch.bfloat16)
    gate = fresh.model.layers[1].mlp.gate
    gate.weight = nn.Parameter(gate.weight.float())  # the mlafx model keeps its router in fp32
    _load(fresh, tmp_path)
    assert fresh.model.embed_tokens.weight.dtype == torch.bfloat16
    assert gate.weight.dtype == torch.float32
    torch.testing.assert_close(gate.weight, model.model.layers[1].mlp.gate.weight, rtol=0, atol=0)
    _assert_equal(fresh, model)  # compares against the original cast to each target dtype


def test_tied_lm_head_omitted_from_checkpoint(tmp_path: Path) -> None:
    model = _v2(tie_word_embeddings=True)
    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
    fresh = _zeroed_like(model)
    _load(fresh, tmp_path)
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    _assert_equal(fresh, model)


def test_skips_layers_beyond_num_hidden_layers(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    big = _v3(num_hidden_layers=3)
    big.save_pretrained(tmp_path)
    small = _v3(num_hidden_layers=2)
    with caplog.at_level(logging.INFO, logger=weights.__name__):
        _load(small, tmp_path)
    assert "skipped" in caplog.text
    want = {k: v for k, v in big.state_dict().items() if not k.startswith("model.layers.2.")}
    for key, value in small.state_dict().items():
        torch.testing.assert_close(value, want[key], rtol=0, atol=0, msg=key)


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
def test_skips_experts_beyond_the_targets(layout: str, tmp_path: Path) -> None:
    big = _v3(n_routed_experts=8)
    if layout == "fused":
        _save_fused(big, tmp_path)
    else:
        big.save_pretrained(tmp_path)
    small = _zeroed_like(_v3(n_routed_experts=4))
    _load(small, tmp_path)
    for key, value in small.state_dict().items():
        want = big.state_dict()[key]
        if ".mlp.gate." in key or ".mlp.experts." in key:
            want = want[:4]
        torch.testing.assert_close(value, want, rtol=0, atol=0, msg=key)


def test_reports_every_problem_and_leaves_the_model_untouched(tmp_path: Path) -> None:
    model = _v2()
    model.save_pretrained(tmp_path)
    _rewrite(
        tmp_path,
        {
            "model.norm.weight": None,
            "model.layers.1.mlp.experts.2.up_proj.weight": None,
            "model.layers.0.self_attn.q_proj.weight": torch.zeros(97, 64),
            "model.layers.0.self_attn.surprise.weight": torch.zeros(3),
        },
    )
    fresh = _zeroed_like(model)
    with pytest.raises(WeightLoadError) as info:
        _load(fresh, tmp_path)
    message = str(info.value)
    assert len(info.value.problems) == 4, message
    assert "model.norm.weight: missing" in message
    assert "model.layers.1.mlp.experts.2.up_proj.weight: missing" in message
    assert (
        "model.layers.0.self_attn.q_proj.weight: checkpoint shape [97, 64] != expected [96, 64]"
    ) in message
    assert "model.layers.0.self_attn.surprise.weight: unexpected" in message
    assert all(not t.any() for t in fresh.state_dict().values())


def test_wrong_expert_shape_and_missing_fused_tensor(tmp_path: Path) -> None:
    model = _v3()
    _save_fused(model, tmp_path, drop=("model.layers.1.mlp.experts.down_proj",))
    with pytest.raises(WeightLoadError) as info:
        _load(_zeroed_like(model), tmp_path)
    # a missing fused tensor is reported per expert slice
    for e in range(4):
        assert f"model.layers.1.mlp.experts.{e}.down_proj.weight: missing" in str(info.value)

    model.save_pretrained(tmp_path)
    _rewrite(tmp_path, {"model.layers.1.mlp.experts.0.gate_proj.weight": torch.zeros(31, 64)})
    shape_error = r"experts\.0\.gate_proj\.weight: checkpoint shape \[31, 64\] != expected \[32,"
    with pytest.raises(WeightLoadError, match=shape_error):
        _load(_zeroed_like(model), tmp_path)


def test_missing_shard_file(tmp_path: Path) -> None:
    model = _v2()
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(WeightLoadError, match=f"shard file {shard.name} listed in"):
        _load(_zeroed_like(model), tmp_path)


def test_duplicate_key_across_files(tmp_path: Path) -> None:
    model = _v2()
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    save_file(sd, str(tmp_path / "a.safetensors"))
    save_file({"model.norm.weight": sd["model.norm.weight"]}, str(tmp_path / "b.safetensors"))
    duplicate = "model.norm.weight: duplicate, in both a.safetensors and b.safetensors"
    with pytest.raises(WeightLoadError, match=duplicate):
        _load(_zeroed_like(model), tmp_path)


def test_empty_directory(tmp_path: Path) -> None:
    with pytest.raises(WeightLoadError, match="no model.safetensors"):
        _load(_v2(), tmp_path)


def test_dummy_init_is_seeded() -> None:
    a, b, c = _v3(), _v3(), _v3()
    init_dummy_weights(a, seed=1)
    init_dummy_weights(b, seed=1)
    init_dummy_weights(c, seed=2)
    _assert_equal(a, b)
    embed = "model.embed_tokens.weight"
    assert not torch.equal(a.state_dict()[embed], c.state_dict()[embed])


def test_dummy_init_values() -> None:
    model = _v3()
    init_dummy_weights(model)
    for key, value in model.state_dict().items():
        assert torch.isfinite(value).all(), key
        if key.endswith("norm.weight"):
            assert torch.equal(value, torch.ones_like(value)), key
        elif key.endswith("e_score_correction_bias"):
            assert not value.any(), key
        else:
            assert abs(value.float().std().item() - 0.02) < 0.004, key
            assert abs(value.float().mean().item()) < 0.004, key


def test_dummy_init_draws_the_same_values_in_any_dtype() -> None:
    fp32, bf16 = _v2(), _v2().to(torch.bfloat16)
    init_dummy_weights(fp32, seed=3)
    init_dummy_weights(bf16, seed=3)
    _assert_equal(bf16, fp32)  # the same fp32 draws, rounded


def test_dummy_init_fills_every_chunk(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(weights, "_DUMMY_CHUNK_ELEMS", 1000)  # chunks of a few rows
    model = _zeroed_like(_v2())
    init_dummy_weights(model)
    for key in ("model.embed_tokens.weight", "model.layers.1.mlp.experts.gate_up_proj"):
        value = model.state_dict()[key]
        assert value.flatten(0, -2).abs().amax(dim=-1).gt(0).all(), key  # no row left unfilled
        assert abs(value.std().item() - 0.02) < 0.004, key
