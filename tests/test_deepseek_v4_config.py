"""``DeepseekV4Config``: transformers' keys and DeepSeek's own give the same config; every
invalid field is named."""

from __future__ import annotations

import pytest
from v4_cases import TINY_V4

from mlafx.config import ConfigError, ModelConfig
from mlafx.config.deepseek_v4 import CSA, HCA, SLIDING, DeepseekV4Config


def _transformers_dict(**overrides) -> dict:
    from transformers import DeepseekV4Config as HFConfig

    return HFConfig(**{**TINY_V4, **overrides}).to_dict()


def test_transformers_config_round_trips():
    cfg = DeepseekV4Config.from_hf_dict(_transformers_dict())
    assert cfg.layer_types == (SLIDING, CSA, HCA, CSA)
    assert [cfg.compress_rate(i) for i in range(4)] == [0, 4, 16, 4]
    assert cfg.compress_rates == (4, 16)
    assert cfg.mlp_layer_types == ("hash_moe", "moe", "moe", "hash_moe")
    assert cfg.qk_rope_head_dim == 8 and cfg.head_dim == 24
    assert cfg.main_rope.theta == 10000.0 and cfg.main_rope.scaling is None
    yarn = cfg.compress_rope.scaling
    assert cfg.compress_rope.theta == 160000.0 and yarn is not None
    assert (yarn.factor, yarn.original_max_position_embeddings) == (4.0, 128)
    assert yarn.cos_sin_scale == 1.0  # transformers' V4 default attention_factor


def test_deepseek_keys_give_the_same_config():
    """DeepSeek's config.json: compress_ratios per layer, num_hash_layers, qk_rope_head_dim,
    flat YaRN keys that apply to the compressed rope only."""
    raw = {k: v for k, v in TINY_V4.items() if k not in ("layer_types", "mlp_layer_types")}
    raw.pop("compress_rates")
    raw.pop("rope_parameters")
    raw.update(
        model_type="deepseek_v4",
        compress_ratios=[0, 4, 128, 4],
        compress_rate_hca=16,
        num_hash_layers=1,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    )
    cfg = DeepseekV4Config.from_hf_dict(raw)
    want = DeepseekV4Config.from_hf_dict(
        _transformers_dict(mlp_layer_types=["hash_moe"] + ["moe"] * 3)
    )
    assert cfg == want


@pytest.mark.parametrize(
    "override, field",
    [
        ({"layer_types": ["sliding_attention"] * 3 + ["full_attention"]}, "layer_types"),
        ({"o_groups": 3}, "o_groups"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"scoring_func": "relu"}, "scoring_func"),
        ({"qk_rope_head_dim": 7}, "qk_rope_head_dim"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_invalid_fields_are_named(override, field):
    raw = {**_transformers_dict(), **override}
    with pytest.raises(ConfigError, match=field):
        DeepseekV4Config.from_hf_dict(raw)


def test_the_mla_paths_refuse_v4_naming_what_serves_it():
    with pytest.raises(ConfigError) as refused:
        ModelConfig.from_hf_dict(_transformers_dict())
    message = str(refused.value)
    assert "'deepseek_v4' is not an MLA step's model" in message
    assert "LLM(checkpoint)" in message and "export and tensor parallelism" in message
    assert "does not serve" not in message


def test_yarn_factor_defaults_to_the_context_ratio():
    raw = _transformers_dict()
    del raw["rope_parameters"]["compress"]["factor"]
    yarn = DeepseekV4Config.from_hf_dict(raw).compress_rope.scaling
    assert yarn is not None and yarn.factor == 512 / 128
