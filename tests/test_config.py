"""ModelConfig: parsing of every supported family, overrides, and clear refusals."""

from __future__ import annotations

import json
import re

import pytest

from mlafx.config import (
    EMBEDDED_DEFAULT_OVERRIDES,
    ConfigError,
    ModelConfig,
    check_fits_in_memory,
    weight_bytes,
)
from mlafx.config.presets import DEEPSEEK_V2_LITE


def v2_lite(**overrides) -> dict:
    return {**json.loads(json.dumps(DEEPSEEK_V2_LITE)), **overrides}


def test_preset_holds_the_real_deepseek_v2_lite_config():
    cfg = ModelConfig.from_model("deepseek-v2-lite")
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (
        102400,
        2048,
        27,
        16,
    )
    assert (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim) == (
        512,
        64,
        128,
        128,
    )
    assert cfg.q_lora_rank is None and cfg.latent_width == 576
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_shared_experts) == (64, 6, 2)
    assert cfg.mlp_layer_types == ("dense",) + ("sparse",) * 26
    assert cfg.rope_scaling is not None and cfg.rope_scaling.factor == 40
    assert cfg.rope_scaling.cos_sin_scale == pytest.approx(1.0)  # mscale == mscale_all_dim
    # (P+R)^-0.5 * mscale(40, 0.707)^2, never (Lkv+R)^-0.5
    mscale = 0.1 * 0.707 * __import__("math").log(40) + 1
    assert cfg.softmax_scale == pytest.approx(192**-0.5 * mscale**2)
    assert cfg.eos_token_ids == (100001,) and cfg.bos_token_id == 100000
    # ~15.7B parameters: ~31 GB in bf16
    assert 30e9 < weight_bytes(cfg, "bfloat16") < 33e9


def test_embedded_default_overrides():
    cfg = ModelConfig.from_model("deepseek-v2-lite", EMBEDDED_DEFAULT_OVERRIDES)
    assert cfg.num_hidden_layers == 2 and cfg.n_routed_experts == 4
    assert cfg.mlp_layer_types == ("sparse", "sparse") and cfg.num_experts_per_tok == 2


def test_transformers5_rope_parameters_and_hub_rope_scaling_agree():
    hub = ModelConfig.from_hf_dict(v2_lite())
    raw = v2_lite(
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000,
            **{k: v for k, v in DEEPSEEK_V2_LITE["rope_scaling"].items() if k != "type"},
        }
    )
    del raw["rope_scaling"], raw["rope_theta"]
    assert ModelConfig.from_hf_dict(raw) == hub


def test_families_and_nested_text_config():
    v3_raw = v2_lite(model_type="deepseek_v3", q_lora_rank=1536, n_group=8, topk_group=4)
    del v3_raw["scoring_func"], v3_raw["topk_method"]  # silent config: the family's router
    v3 = ModelConfig.from_hf_dict(v3_raw)
    assert (
        v3.family == "deepseek_v3" and v3.scoring_func == "sigmoid" and v3.topk_method == "noaux_tc"
    )
    assert v3.q_lora_rank == 1536 and (v3.n_group, v3.topk_group) == (8, 4)
    kimi = ModelConfig.from_hf_dict(v2_lite(model_type="kimi_k2"))
    assert kimi.family == "deepseek_v3"
    wrapper = {"model_type": "kimi_k25", "text_config": v2_lite(), "tie_word_embeddings": False}
    assert ModelConfig.from_hf_dict(wrapper) == ModelConfig.from_hf_dict(v2_lite())
    # transformers ties by the wrapper's config, whose own default (Kimi_K25Config's) is True
    del wrapper["tie_word_embeddings"]
    assert ModelConfig.from_hf_dict(wrapper).tie_word_embeddings
    glm = ModelConfig.from_hf_dict(
        v2_lite(
            model_type="glm4_moe_lite",
            qk_nope_head_dim=192,
            v_head_dim=256,
            num_attention_heads=20,
            num_key_value_heads=20,
            mlp_layer_types=["dense"] + ["sparse"] * 26,
        )
    )
    assert glm.qk_head_dim == 256 and glm.v_head_dim == 256 and glm.latent_width == 576


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (v2_lite(model_type="llama"), "model_type"),
        (v2_lite(model_type="deepseek_v32", index_topk=2048), "q_lora_rank"),
        (v2_lite(model_type="deepseek_v3", index_topk=2048), "index_topk"),
        (v2_lite(model_type="glm5", index_topk=2048), "index_topk"),
        (v2_lite(model_type="glm_moe_dsa", q_lora_rank=64, index_topk=0), "index_topk"),
        (v2_lite(model_type="glm_moe_dsa", q_lora_rank=64, index_head_dim=32), "index_head_dim"),
        (
            v2_lite(model_type="glm_moe_dsa", q_lora_rank=64, indexer_types=["shared"] * 27),
            "indexer_types",
        ),
        (v2_lite(model_type="glm_moe_dsa", q_lora_rank=64, index_topk_pattern="FX"), "pattern"),
        (v2_lite(hidden_size=0), "hidden_size"),
        (v2_lite(kv_lora_rank=-512), "kv_lora_rank"),
        (v2_lite(qk_rope_head_dim=63), "qk_rope_head_dim"),
        (v2_lite(num_key_value_heads=8), "num_key_value_heads"),
        (v2_lite(num_experts_per_tok=65), "num_experts_per_tok"),
        (v2_lite(n_group=3), "n_group"),
        (v2_lite(topk_method="random"), "topk_method"),
        (v2_lite(hidden_act="gelu"), "hidden_act"),
        (v2_lite(mlp_layer_types=["dense"]), "mlp_layer_types"),
        (v2_lite(rope_scaling={"type": "yarn", "factor": 4}), "original_max_position_embeddings"),
        (v2_lite(vocab_size=None), "vocab_size"),
    ],
)
def test_bad_configs_are_refused_naming_the_field(raw, field):
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_hf_dict(raw)


def test_overrides_apply_before_validation_and_unknown_keys_are_refused():
    cfg = ModelConfig.from_hf_dict(v2_lite(), {"num_hidden_layers": 3, "first_k_dense_replace": 2})
    assert cfg.mlp_layer_types == ("dense", "dense", "sparse")
    with pytest.raises(ConfigError, match="num_hiden_layers"):
        ModelConfig.from_hf_dict(v2_lite(), {"num_hiden_layers": 3})
    with pytest.raises(ConfigError, match="hidden_size"):
        ModelConfig.from_hf_dict(v2_lite(), {"hidden_size": -1})


def test_model_argument_errors(tmp_path):
    with pytest.raises(ConfigError, match="neither a preset"):
        ModelConfig.from_model("no-such-model")
    with pytest.raises(ConfigError, match="config.json"):
        ModelConfig.from_model(tmp_path)


def test_full_preset_is_refused_up_front_with_an_estimate():
    cfg = ModelConfig.from_model("deepseek-v2-lite")
    with pytest.raises(ConfigError, match=r"needs about 29\.\d GiB"):
        check_fits_in_memory(cfg, "bfloat16", min_kv_tokens=16)


def minicpm3_4b(**overrides) -> dict:
    """openbmb/MiniCPM3-4B's config.json as the Hub has it (LongRoPE, no v_head_dim, no tie
    field), with its factor lists cut to two entries per list for a rope width of 4."""
    raw = {
        "model_type": "minicpm3",
        "vocab_size": 73448,
        "hidden_size": 2560,
        "intermediate_size": 6400,
        "num_hidden_layers": 62,
        "num_attention_heads": 40,
        "num_key_value_heads": 40,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 4,
        "kv_lora_rank": 256,
        "q_lora_rank": 768,
        "max_position_embeddings": 32768,
        "rope_scaling": {
            "type": "longrope",
            "long_factor": [1.05, 1.2],
            "short_factor": [1.05, 1.2],
            "original_max_position_embeddings": 32768,
        },
        "scale_emb": 12,
        "scale_depth": 1.4,
        "dim_model_base": 256,
    }
    return {**raw, **overrides}


def test_minicpm3_defaults_scalings_and_longrope():
    from mlafx.config import LongRopeScaling
    from mlafx.export.manifest import config_from_dict

    cfg = ModelConfig.from_hf_dict(minicpm3_4b(rope_interleave=True))
    assert cfg.family == "minicpm3" and cfg.v_head_dim == 64  # hidden_size // heads
    assert cfg.tie_word_embeddings and not cfg.rope_interleave  # always NeoX halves
    assert cfg.mlp_layer_types == ("dense",) * 62 and cfg.n_routed_experts == 0
    assert cfg.embedding_scale == 12 and cfg.logits_divisor == 10
    assert cfg.residual_scale == pytest.approx(1.4 / 62**0.5)
    assert cfg.rope_scaling == LongRopeScaling(factors=(1.05, 1.2), attention_factor=1.0)
    assert config_from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg  # artifacts' manifest
    longer = ModelConfig.from_hf_dict(minicpm3_4b(max_position_embeddings=65536))
    assert longer.rope_scaling.attention_factor == pytest.approx(
        (1 + 0.6931471805599453 / 10.397207708399179) ** 0.5  # sqrt(1 + ln 2 / ln 32768)
    )
    off = ModelConfig.from_hf_dict(minicpm3_4b(scale_depth=None, dim_model_base=None))
    assert off.residual_scale == 1 and off.logits_divisor == 1


@pytest.mark.parametrize(
    "overrides, field",
    [
        (  # the long factors would apply past the original length: refused
            {
                "max_position_embeddings": 65536,
                "rope_scaling": {
                    "type": "longrope",
                    "long_factor": [2.0, 3.0],
                    "short_factor": [1.0, 1.0],
                    "original_max_position_embeddings": 32768,
                },
            },
            "'max_position_embeddings'=65536",
        ),
        (
            {"rope_scaling": {"type": "longrope", "long_factor": [1], "short_factor": [1, 2]}},
            "rope_parameters.long_factor",
        ),
        ({"scale_emb": -1}, "'scale_emb'"),
    ],
)
def test_bad_minicpm3_configs_are_refused_naming_the_field(overrides, field):
    with pytest.raises(ConfigError, match=re.escape(field)):
        ModelConfig.from_hf_dict(minicpm3_4b(**overrides))


@pytest.mark.parametrize("model_type", ["mistral4", "kimi_linear", "hy_v4"])
def test_other_mla_families_are_refused_with_what_they_need(model_type):
    from mlafx.config.model_config import UNSUPPORTED_MLA_MODEL_TYPES

    with pytest.raises(ConfigError) as refused:
        ModelConfig.from_hf_dict(v2_lite(model_type=model_type))
    message = str(refused.value)
    assert UNSUPPORTED_MLA_MODEL_TYPES[model_type] in message
    assert "minicpm3" in message and "longcat_flash" in message and "kimi_k25" in message


def test_every_mla_model_type_of_transformers_is_served_or_refused_by_name():
    """A model folder of transformers whose modelling code has a latent KV (kv_lora_rank) is
    one mlafx serves or one it refuses with its own reason, never "unknown"."""
    import pathlib

    import transformers

    from mlafx.config.model_config import (
        _FAMILIES,
        _SPARSE_MODEL_TYPES,
        OWN_STEP_MODEL_TYPES,
        UNSUPPORTED_MLA_MODEL_TYPES,
    )

    models = pathlib.Path(transformers.__file__).parent / "models"
    known = (
        set(_FAMILIES)
        | set(UNSUPPORTED_MLA_MODEL_TYPES)
        | set(OWN_STEP_MODEL_TYPES)
        | _SPARSE_MODEL_TYPES
    )
    missing = []
    for modelling in sorted(models.glob("*/modeling_*.py")):
        if "kv_lora_rank" not in modelling.read_text():
            continue
        config = modelling.with_name(modelling.name.replace("modeling_", "configuration_"))
        types = (
            re.findall(r'model_type = "([a-z0-9_]+)"', config.read_text())
            if config.exists()
            else []
        )
        # a multimodal model's vision / audio sub-configs are not language models
        missing += [t for t in types if t not in known and not re.search("vision|audio", t)]
    assert not missing, f"MLA model types neither served nor refused by name: {missing}"


def test_glm5_indexer_types_follow_transformers_schedule():
    """Without a list, GLM-5's shared layers come from index_topk_freq / _skip_topk_offset (or
    an F/S pattern), as transformers derives them; V3.2 runs every layer's indexer."""
    glm = v2_lite(model_type="glm_moe_dsa", q_lora_rank=64, num_hidden_layers=6)
    cfg = ModelConfig.from_hf_dict({**glm, "index_topk_freq": 2, "index_skip_topk_offset": 2})
    assert cfg.indexer_types == ("full", "full", "shared", "full", "shared", "full")
    assert ModelConfig.from_hf_dict({**glm, "index_topk_pattern": "FSSFFS"}).indexer_types == (
        "full", "shared", "shared", "full", "full", "shared",
    )  # fmt: skip
    v32 = ModelConfig.from_hf_dict({**glm, "model_type": "deepseek_v32"})
    assert v32.indexer_types == ("full",) * 6 and not v32.indexer_rope_interleave
    assert v32.num_caches == 12 and v32.index_topk == 2048 and v32.index_n_heads == 64
