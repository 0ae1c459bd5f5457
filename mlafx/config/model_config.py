"""`ModelConfig`: the frozen, validated description of one MLA model.

Built from a Hugging Face ``config.json`` (``deepseek_v2``, ``deepseek_v3``/``kimi_k2``,
``glm4_moe_lite``, ``minicpm3``, or any of them nested under ``text_config`` as Kimi K2.5's
``kimi_k25`` does) with optional ``hf_overrides`` applied over the file before validation,
like vLLM's ``--hf-overrides``. Every error names the offending field; a ``transformers``
model type with MLA attention that mlafx cannot serve yet is refused naming what it lacks
(``UNSUPPORTED_MLA_MODEL_TYPES``), and one served by its own step (DeepSeek-V4) naming what
takes it (``OWN_STEP_MODEL_TYPES``).

Symbols (DESIGN.md): D = hidden_size, H = num_attention_heads, Lkv = kv_lora_rank,
R = qk_rope_head_dim, P = qk_nope_head_dim, V = v_head_dim, Lq = q_lora_rank.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

from mlafx.config.presets import PRESETS
from mlafx.config.sparse_attention import SPARSE_KEYS, SPARSE_MODEL_TYPES, parse_indexer


class ConfigError(ValueError):
    """A model configuration mlafx cannot serve; the message names the field."""


# model_type -> family. Kimi K2 ships as "kimi_k2" with DeepSeek-V3 modelling code.
_FAMILIES = {
    "deepseek_v2": "deepseek_v2",
    "deepseek_v3": "deepseek_v3",
    "kimi_k2": "deepseek_v3",
    "glm4_moe_lite": "glm4_moe_lite",
    "minicpm3": "minicpm3",
    "longcat_flash": "longcat_flash",
    # transformers runs these with DeepSeek-V3's modelling code (config names aside)
    "sarvam_mla": "deepseek_v3",
    "youtu": "deepseek_v3",  # every layer a dense MLP, tied embeddings by default
    # DSA sparse attention (``config/sparse_attention.py``): V3 and GLM-4.7-Flash layers with an
    # indexer that picks the keys each query attends to
    "deepseek_v32": "deepseek_v3",
    "glm_moe_dsa": "deepseek_v3",
}
# transformers' MLA model types mlafx cannot serve yet, and what each needs (a model type not
# listed anywhere is refused as unknown).
UNSUPPORTED_MLA_MODEL_TYPES = {
    "mistral4": "a position-dependent query scale (rope_parameters.llama_4_scaling_beta) and "
    "a router without fp32 upcast",
    "axk1": "an RMSNorm on the MoE output (post_mlp_layernorm)",
    "axk2": "a fused q + output-gate projection, gated RMSNorms and DSA sparse attention",
    "dots3_note": "latent scalings, a k_rope norm, per-head output gates, sliding-window layers "
    "and DSA sparse attention",
    "dots3_note_text": "latent scalings, a k_rope norm, per-head output gates, sliding-window "
    "layers and DSA sparse attention",
    "hy_v4": "attention output gates, attention sinks, hyper-connection residual streams and "
    "DSA sparse attention",
    "hy_v4_vl": "attention output gates, attention sinks, hyper-connection residual streams and "
    "DSA sparse attention",
    "hy_v4_vl_text": "attention output gates, attention sinks, hyper-connection residual streams "
    "and DSA sparse attention",
    "mistral_large4": "NoPE layers, shared latent KV across layers, learned RoPE and query "
    "scalings, logit softcapping and DSA sparse attention",
    "mistral_large4_text": "NoPE layers, shared latent KV across layers, learned RoPE and query "
    "scalings, logit softcapping and DSA sparse attention",
    "bailing_hybrid": "KDA linear-attention layers (a hybrid: 5 of 6 layers are not MLA)",
    "glm5_next": "KDA linear-attention layers, hyper-connections and a pooled DSA indexer",
    "glm5_next_text": "KDA linear-attention layers, hyper-connections and a pooled DSA indexer",
    "kimi_linear": "KDA linear-attention layers (a hybrid: 3 of 4 layers are not MLA)",
}
# Model types mlafx serves with their own step, not ModelConfig's MLA step: what takes them and
# what does not (ModelConfig is the MLA paths': export, tensor parallelism).
OWN_STEP_MODEL_TYPES = {
    "deepseek_v4": "DeepSeek-V4 has its own step (mlafx.models.deepseek_v4, "
    "config/deepseek_v4.py), which LLM(checkpoint), `mlafx run`, `mlafx serve` and `mlafx "
    "inspect` take (compiled per layer kind, or compile=False); export and tensor parallelism "
    "do not take it yet",
}
# Sparse-attention model types refused: a DSA variant mlafx does not serve (any other config
# with ``index_topk`` is refused too).
_SPARSE_MODEL_TYPES = {"glm5"}

# Router defaults per family when config.json is silent (transformers' behaviour).
_ROUTER_DEFAULTS = {
    "deepseek_v2": ("softmax", "greedy"),
    "deepseek_v3": ("sigmoid", "noaux_tc"),
    "glm4_moe_lite": ("sigmoid", "noaux_tc"),
    "minicpm3": ("softmax", "greedy"),  # dense: no router
    "longcat_flash": ("softmax", "noaux_tc"),  # one group: top-k of scores + correction bias
}
# What each family's transformers config assumes when config.json is silent (a hub config may
# rely on them): tied embeddings, RoPE pairs (interleaved) or NeoX halves.
_TIE_DEFAULTS = {"minicpm3": True, "youtu": True}  # by model_type
# Model types whose modelling code fixes the RoPE layout whatever config.json says: MiniCPM3
# rotates NeoX halves (Llama's ``apply_rotary_pos_emb``), the DSA models interleaved pairs.
_FIXED_ROPE_INTERLEAVE = {"minicpm3": False, "deepseek_v32": True, "glm_moe_dsa": True}

ScoringFunc = Literal["softmax", "sigmoid"]
TopkMethod = Literal["greedy", "group_limited_greedy", "noaux_tc"]

# Keys that may appear in config.json and that mlafx deliberately does not read (they
# do not change the math of inference, or describe training). Overriding one is allowed.
_IGNORED_KEYS = {
    "architectures",
    "auto_map",
    "torch_dtype",
    "dtype",
    "transformers_version",
    "use_cache",
    "initializer_range",
    "pretraining_tp",
    "attention_dropout",
    "output_router_logits",
    "aux_loss_alpha",
    "seq_aux",
    "router_aux_loss_coef",
    "pad_token_id",
    "qk_head_dim",
    "head_dim",
    "num_nextn_predict_layers",
    "num_mtp_layers",
    "quantization_config",
    "ep_size",
    "_name_or_path",
    "model_type",
    "tokenizer_class",
    "bos_token_id",
    "eos_token_id",
    "name_or_path",
    "id2label",
    "label2id",
    "return_dict",
    "output_hidden_states",
    "output_attentions",
    "chunk_size_feed_forward",
    "is_decoder",
    "is_encoder_decoder",
    "tie_encoder_decoder",
    "problem_type",
    "num_labels",
}


@dataclass(frozen=True)
class YarnScaling:
    """DeepSeek YaRN RoPE scaling (``rope_type: yarn``)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # explicit cos/sin scale; derived when None
    truncate: bool = True  # round the YaRN correction range to whole dimensions

    @property
    def cos_sin_scale(self) -> float:
        """The factor on cos/sin: ``mscale(f, mscale) / mscale(f, mscale_all_dim)`` when both
        are set, else ``mscale(f)`` (transformers' and DeepSeek's rule)."""
        if self.attention_factor is not None:
            return self.attention_factor
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return yarn_mscale(self.factor)


@dataclass(frozen=True)
class LongRopeScaling:
    """LongRoPE (``rope_type: longrope``, MiniCPM3) with one list of per-frequency factors in
    force: ``inv_freq[i] = 1 / (factors[i] * theta^(2i/R))``, cos/sin times
    ``attention_factor``. transformers switches every position of a batch from the short to the
    long factors once any sequence passes ``original_max_position_embeddings``, which keys
    already in a paged cache cannot follow, so a config whose two lists differ must keep
    ``max_position_embeddings`` within the original length (the short list is then the one
    transformers uses for every position too)."""

    factors: tuple[float, ...]
    attention_factor: float

    @property
    def cos_sin_scale(self) -> float:
        return self.attention_factor


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    """``mscale(s, m) = 1 if s <= 1 else 0.1 * m * ln(s) + 1`` (DESIGN.md)."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    # MoE
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    mlp_layer_types: tuple[str, ...]  # "dense" | "sparse" per layer
    norm_topk_prob: bool
    routed_scaling_factor: float
    scoring_func: ScoringFunc
    topk_method: TopkMethod
    n_group: int
    topk_group: int
    # norms, RoPE, embeddings
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: YarnScaling | LongRopeScaling | None
    rope_interleave: bool
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # MiniCPM3's scalings (1.0 for every other family): the embedding times
    # ``embedding_scale`` (``scale_emb``), every residual branch times ``residual_scale``
    # (``scale_depth / sqrt(num_hidden_layers)``) before it is added, the final norm's output
    # divided by ``logits_divisor`` (``hidden_size / dim_model_base``) before ``lm_head``
    embedding_scale: float = 1.0
    residual_scale: float = 1.0
    logits_divisor: float = 1.0
    # LongCat-Flash: two MLA blocks per decoder layer (each its own latent cache layer) and
    # ``n_zero_experts`` identity experts among the router's choices (1 and 0 elsewhere)
    attention_blocks: int = 1
    n_zero_experts: int = 0
    router_bias: bool = False
    # DSA sparse attention (DeepSeek-V3.2, GLM-5; 0 / () elsewhere): a layer whose
    # ``indexer_types`` entry is "full" runs its lightning indexer (``index_n_heads`` heads of
    # ``index_head_dim``, RoPE on its first R dims, interleaved or NeoX halves) and attends to
    # the ``index_topk`` keys it scores highest; a "shared" layer reuses the last full layer's
    index_topk: int = 0
    index_n_heads: int = 0
    index_head_dim: int = 0
    indexer_types: tuple[str, ...] = ()
    indexer_rope_interleave: bool = False

    # ----- derived quantities (never stored twice) -----
    @property
    def qk_head_dim(self) -> int:
        """P + R: width of one head's query/key."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        """Lkv + R: width of one paged-cache row."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """``(P+R)^-0.5``, times ``mscale(factor, mscale_all_dim)^2`` under YaRN."""
        scale = self.qk_head_dim**-0.5
        if isinstance(self.rope_scaling, YarnScaling) and self.rope_scaling.mscale_all_dim:
            m = yarn_mscale(self.rope_scaling.factor, self.rope_scaling.mscale_all_dim)
            scale *= m * m
        return scale

    @property
    def num_mla_blocks(self) -> int:
        """MLA blocks: ``attention_blocks`` per decoder layer."""
        return self.num_hidden_layers * self.attention_blocks

    @property
    def sparse_attention(self) -> bool:
        """DSA: an indexer picks the keys of each query (``index_topk`` > 0)."""
        return self.index_topk > 0

    def runs_indexer(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` runs its own DSA indexer (has an indexer cache)."""
        return self.sparse_attention and self.indexer_types[layer] == "full"

    def layer_cache_widths(self, layer: int) -> tuple[int, ...]:
        """Row widths of decoder layer ``layer``'s caches, in step order: one latent cache
        (Lkv + R) per MLA block, then the indexer's keys (``index_head_dim``) if it runs one."""
        latent = (self.latent_width,) * self.attention_blocks
        return latent + ((self.index_head_dim,) if self.runs_indexer(layer) else ())

    @property
    def cache_widths(self) -> tuple[int, ...]:
        """Row width of every cache of the step, layer by layer (``layer_cache_widths``)."""
        return tuple(w for i in range(self.num_hidden_layers) for w in self.layer_cache_widths(i))

    def cache_block_shapes(self, block_size: int) -> tuple[tuple[int, int], ...]:
        """Every cache of the step as the shape of one of its blocks ``(rows, width)``: all
        hold ``block_size`` token rows (``cache_widths``)."""
        return tuple((block_size, width) for width in self.cache_widths)

    @property
    def num_caches(self) -> int:
        """Paged caches the step reads and writes (``cache_widths``)."""
        return len(self.cache_widths)

    @property
    def num_router_choices(self) -> int:
        """Experts the router scores: the routed ones, then the zero (identity) experts."""
        return self.n_routed_experts + self.n_zero_experts

    @property
    def shortcut_moe(self) -> bool:
        """LongCat-Flash's layer: two attention + dense-MLP blocks, and the MoE of the first
        block's normed output added at the end (``models/longcat.py``)."""
        return self.family == "longcat_flash"

    @property
    def mla_q_scale(self) -> float:
        """LongCat-Flash scales q by ``sqrt(D / Lq)`` (1 elsewhere)."""
        if not self.shortcut_moe or self.q_lora_rank is None:
            return 1.0
        return (self.hidden_size / self.q_lora_rank) ** 0.5

    @property
    def mla_latent_scale(self) -> float:
        """LongCat-Flash scales the normed latent (what the cache holds) by ``sqrt(D / Lkv)``."""
        return (self.hidden_size / self.kv_lora_rank) ** 0.5 if self.shortcut_moe else 1.0

    def is_moe_layer(self, layer: int) -> bool:
        return self.mlp_layer_types[layer] == "sparse"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ----- constructors -----
    @classmethod
    def from_hf_dict(
        cls, raw: dict[str, Any], hf_overrides: dict[str, Any] | None = None
    ) -> ModelConfig:
        """Validate an HF config dict (with ``hf_overrides`` applied first)."""
        return _parse(_apply_overrides(_text_config(raw), hf_overrides or {}))

    @classmethod
    def from_model(
        cls, model: str | Path, hf_overrides: dict[str, Any] | None = None
    ) -> ModelConfig:
        """``model`` is a preset name (see ``mlafx.config.PRESETS``) or a directory."""
        return cls.from_hf_dict(load_hf_config_dict(model), hf_overrides)


def load_hf_config_dict(model: str | Path) -> dict[str, Any]:
    """The raw config dict of a preset name, a local model directory or a GGUF file
    (``config/gguf_config.py``)."""
    if isinstance(model, str) and model in PRESETS:
        return json.loads(json.dumps(PRESETS[model]))  # a deep copy
    if str(model).endswith(".gguf"):
        from mlafx.config.gguf_config import gguf_config_dict
        from mlafx.config.gguf_file import open_gguf

        return gguf_config_dict(open_gguf(model))
    path = Path(model)
    if not path.is_dir():
        raise ConfigError(
            f"model {str(model)!r} is neither a preset ({', '.join(sorted(PRESETS))}), "
            "a local directory nor a .gguf file (weights cannot be downloaded here)"
        )
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"{path} has no config.json")
    with cfg_file.open() as f:
        return json.load(f)


# Multimodal wrappers' own default for tying lm_head to the embedding (transformers ties by the
# wrapper's config, not the text config's): Kimi_K25Config's.
_WRAPPER_TIE_DEFAULTS = {"kimi_k25": True}


def _text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """Multimodal wrappers (Kimi K2.5) keep the language model under ``text_config``; the
    wrapper's ``tie_word_embeddings`` decides the tie."""
    text = raw.get("text_config")
    if not (isinstance(text, dict) and "model_type" in text):
        return dict(raw)
    text = dict(text)
    wrapper = raw.get("model_type")
    if "tie_word_embeddings" in raw:
        text["tie_word_embeddings"] = raw["tie_word_embeddings"]
    elif wrapper in _WRAPPER_TIE_DEFAULTS:
        text["tie_word_embeddings"] = _WRAPPER_TIE_DEFAULTS[wrapper]
    return text


def _apply_overrides(cfg: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(overrides, dict):
        raise ConfigError(f"hf_overrides must be a dict, got {type(overrides).__name__}")
    known = (
        set(cfg) | {f.name for f in dataclasses.fields(ModelConfig)} | _READ_KEYS | _IGNORED_KEYS
    )
    unknown = sorted(k for k in overrides if k not in known)
    if unknown:
        raise ConfigError(
            f"unknown hf_overrides key(s): {', '.join(unknown)} "
            "(neither in config.json nor a field mlafx reads)"
        )
    return {**cfg, **overrides}


# config.json keys that _parse reads beyond the dataclass field names.
_READ_KEYS = {
    "rope_parameters",
    "rope_scaling",
    "first_k_dense_replace",
    "moe_layer_freq",
    "num_key_value_heads",
    "hidden_act",
    "eos_token_id",
    "bos_token_id",
    "index_topk",
    "num_experts_per_tok",
    "mlp_bias",
    "partial_rotary_factor",
    "scale_emb",
    "scale_depth",
    "dim_model_base",
    "num_layers",
    "ffn_hidden_size",
    "expert_ffn_hidden_size",
    "moe_topk",
    "zero_expert_num",
    "router_bias",
    "num_experts",
    "num_shared_experts",
    "q_head_dim",
    *SPARSE_KEYS,
}


def _require(cfg: dict[str, Any], key: str) -> Any:
    if cfg.get(key) is None:
        raise ConfigError(f"config field {key!r} is missing")
    return cfg[key]


def _positive_int(cfg: dict[str, Any], key: str) -> int:
    value = _require(cfg, key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ConfigError(f"config field {key!r} must be a positive integer, got {value!r}")
    return value


def _rope(cfg: dict[str, Any]) -> tuple[float, YarnScaling | LongRopeScaling | None]:
    """RoPE theta and YaRN or LongRoPE scaling from either transformers-5 ``rope_parameters``
    or the hub's ``rope_theta`` + ``rope_scaling``."""
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(legacy, dict):
        raise ConfigError("config fields 'rope_parameters'/'rope_scaling' must be objects")
    params = {**legacy, **params}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    if theta <= 0:
        raise ConfigError(f"config field 'rope_theta' must be positive, got {theta}")
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ConfigError(f"config field 'partial_rotary_factor'={partial} is not supported")
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type == "default":
        return theta, None
    if rope_type == "longrope":
        return theta, _longrope(cfg, params)
    if rope_type not in ("yarn", "deepseek_yarn"):
        raise ConfigError(
            f"config field 'rope_type'={rope_type!r} is not supported (yarn or longrope)"
        )
    factor = params.get("factor")
    original = params.get("original_max_position_embeddings")
    if factor is None or original is None:
        raise ConfigError(
            "YaRN RoPE needs 'factor' and 'original_max_position_embeddings' in rope_parameters"
        )
    if float(factor) <= 0 or int(original) <= 0:
        raise ConfigError("YaRN 'factor' and 'original_max_position_embeddings' must be positive")
    yarn = YarnScaling(
        factor=float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        mscale=_optional_float(params.get("mscale")),
        mscale_all_dim=_optional_float(params.get("mscale_all_dim")),
        attention_factor=_optional_float(params.get("attention_factor")),
        truncate=bool(params.get("truncate", True)),
    )
    return theta, yarn


def _longrope(cfg: dict[str, Any], params: dict[str, Any]) -> LongRopeScaling:
    """transformers' ``_compute_longrope_parameters`` with the factor list that applies to
    every position the config admits (``LongRopeScaling``)."""
    half = _positive_int(cfg, "qk_rope_head_dim") // 2
    lists = {}
    for key in ("short_factor", "long_factor"):
        values = params.get(key)
        if not isinstance(values, list) or len(values) != half:
            raise ConfigError(
                f"config field 'rope_parameters.{key}' must list {half} factors "
                f"(qk_rope_head_dim / 2), got {values!r}"
            )
        lists[key] = tuple(float(v) for v in values)
    max_positions = _positive_int(cfg, "max_position_embeddings")
    original = params.get("original_max_position_embeddings") or max_positions
    if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
        raise ConfigError(
            "config field 'rope_parameters.original_max_position_embeddings' must be a positive "
            f"integer, got {original!r}"
        )
    if lists["short_factor"] != lists["long_factor"] and max_positions > original:
        raise ConfigError(
            f"config field 'max_position_embeddings'={max_positions} exceeds LongRoPE's "
            f"original_max_position_embeddings={original} while long_factor differs from "
            "short_factor: transformers switches every position of a batch to the long factors "
            "past the original length, which keys already in a paged cache cannot follow; "
            f"serve it with hf_overrides={{'max_position_embeddings': {original}}}"
        )
    factor = params.get("factor")
    factor = max_positions / original if factor is None else float(factor)
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return LongRopeScaling(factors=lists["short_factor"], attention_factor=float(attention))


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _mlp_layer_types(cfg: dict[str, Any], num_layers: int, moe: bool) -> tuple[str, ...]:
    explicit = cfg.get("mlp_layer_types")
    if explicit is not None:
        types = tuple(explicit)
        if len(types) != num_layers or any(t not in ("dense", "sparse") for t in types):
            raise ConfigError(
                f"config field 'mlp_layer_types' must list 'dense'/'sparse' for each of the "
                f"{num_layers} layers, got {list(types)}"
            )
        if not moe and "sparse" in types:
            raise ConfigError("config field 'mlp_layer_types' has sparse layers but no experts")
        return types
    if not moe:
        return ("dense",) * num_layers
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    freq = int(cfg.get("moe_layer_freq") or 1)
    if first_dense < 0 or freq <= 0:
        raise ConfigError("config fields 'first_k_dense_replace' >= 0 and 'moe_layer_freq' > 0")
    return tuple(
        "sparse" if (i >= first_dense and i % freq == 0) else "dense" for i in range(num_layers)
    )


def _parse(cfg: dict[str, Any]) -> ModelConfig:
    model_type, family, cfg = _family_keys(cfg)
    dims = _dims(cfg)
    routing = _routing(cfg, family)
    eps = float(cfg.get("rms_norm_eps", 1e-6))
    if eps <= 0:
        raise ConfigError(f"config field 'rms_norm_eps' must be positive, got {eps}")
    theta, yarn = _rope(cfg)
    eos = cfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    for tok in eos_ids:
        if not 0 <= tok < dims["vocab_size"]:
            raise ConfigError(f"config field 'eos_token_id'={tok} is outside the vocabulary")
    bos = cfg.get("bos_token_id")
    moe = routing["n_routed_experts"] > 0
    q_lora_rank = None if cfg.get("q_lora_rank") is None else _positive_int(cfg, "q_lora_rank")
    return ModelConfig(
        model_type=model_type,
        family=family,
        q_lora_rank=q_lora_rank,
        mlp_layer_types=_mlp_layer_types(cfg, dims["num_hidden_layers"], moe),
        rms_norm_eps=eps,
        rope_theta=theta,
        rope_scaling=yarn,
        # DeepSeek-V2 is always interleaved; V3/GLM configs may switch to NeoX halves.
        rope_interleave=_FIXED_ROPE_INTERLEAVE.get(
            model_type, bool(cfg.get("rope_interleave", True))
        ),
        tie_word_embeddings=bool(
            cfg.get("tie_word_embeddings", _TIE_DEFAULTS.get(model_type, False))
        ),
        attention_bias=bool(cfg.get("attention_bias", False)),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
        attention_blocks=2 if family == "longcat_flash" else 1,
        **routing,
        **_scalings(cfg, family, dims),
        **_sparse_fields(cfg, model_type, dims),
        **cast(dict[str, Any], dims),
    )


def _family_keys(cfg: dict[str, Any]) -> tuple[str, str, dict[str, Any]]:
    """The model type, its family, and ``cfg`` with the family's keys renamed to DeepSeek's;
    a clear ``ConfigError`` for a model type mlafx does not serve."""
    model_type = cfg.get("model_type")
    sparse = model_type in _SPARSE_MODEL_TYPES or cfg.get("index_topk") is not None
    refused = UNSUPPORTED_MLA_MODEL_TYPES.keys() | OWN_STEP_MODEL_TYPES.keys()
    if sparse and model_type not in refused | SPARSE_MODEL_TYPES.keys():
        raise ConfigError(
            f"model_type {model_type!r} uses sparse attention (config field 'index_topk'), "
            f"which mlafx serves only as {' and '.join(SPARSE_MODEL_TYPES)} define it"
        )
    if model_type in OWN_STEP_MODEL_TYPES:
        raise ConfigError(
            f"config field 'model_type'={model_type!r} is not an MLA step's model: "
            f"{OWN_STEP_MODEL_TYPES[model_type]}"
        )
    if model_type in UNSUPPORTED_MLA_MODEL_TYPES:
        raise ConfigError(
            f"config field 'model_type'={model_type!r} is an MLA model mlafx does not serve yet: "
            f"it needs {UNSUPPORTED_MLA_MODEL_TYPES[model_type]}; supported: {_supported()}"
        )
    if model_type not in _FAMILIES:
        raise ConfigError(
            f"unknown config field 'model_type'={model_type!r}; supported: {_supported()}"
        )
    family = _FAMILIES[model_type]
    if model_type == "sarvam_mla":
        cfg = _renamed(
            cfg, {"num_experts": "n_routed_experts", "num_shared_experts": "n_shared_experts"}
        )
    if family == "longcat_flash":
        cfg = _longcat_keys(cfg)
    if family == "minicpm3" and cfg.get("v_head_dim") is None:  # transformers' default
        cfg = {
            **cfg,
            "v_head_dim": _positive_int(cfg, "hidden_size")
            // _positive_int(cfg, "num_attention_heads"),
        }
    return model_type, family, cfg


def _dims(cfg: dict[str, Any]) -> dict[str, int]:
    """The model's widths and counts (positive integers), and the attention and MLP options
    MLA constrains."""
    dims = {
        k: _positive_int(cfg, k)
        for k in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "max_position_embeddings",
        )
    }
    if dims["qk_rope_head_dim"] % 2:
        raise ConfigError(
            f"config field 'qk_rope_head_dim' must be even, got {dims['qk_rope_head_dim']}"
        )
    kv_heads = cfg.get("num_key_value_heads")
    if kv_heads is not None and kv_heads != dims["num_attention_heads"]:
        raise ConfigError(
            f"config field 'num_key_value_heads'={kv_heads} must equal num_attention_heads="
            f"{dims['num_attention_heads']} (MLA has one latent shared by all heads)"
        )
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"config field 'hidden_act'={act!r} is not supported (silu only)")
    if cfg.get("mlp_bias"):
        raise ConfigError("config field 'mlp_bias'=true is not supported")
    return dims


def _routing(cfg: dict[str, Any], family: str) -> dict[str, Any]:
    """The experts and the router's fields (zero where the model has no MoE)."""
    n_routed = int(cfg.get("n_routed_experts") or 0)
    moe = n_routed > 0
    if n_routed < 0:
        raise ConfigError(f"config field 'n_routed_experts' must be >= 0, got {n_routed}")
    n_zero = int(cfg.get("zero_expert_num") or 0) if family == "longcat_flash" else 0
    if n_zero < 0:
        raise ConfigError(f"config field 'zero_expert_num' must be >= 0, got {n_zero}")
    choices = n_routed + n_zero  # what the router scores
    top_k = int(cfg.get("num_experts_per_tok") or 0) if moe else 0
    moe_inter = int(cfg.get("moe_intermediate_size") or 0) if moe else 0
    n_shared = int(cfg.get("n_shared_experts") or 0) if moe else 0
    if moe:
        if top_k <= 0 or top_k > choices:
            raise ConfigError(
                f"config field 'num_experts_per_tok'={cfg.get('num_experts_per_tok')} must be in "
                f"1..{choices} (the experts the router scores)"
            )
        if moe_inter <= 0:
            raise ConfigError("config field 'moe_intermediate_size' must be a positive integer")
        if n_shared < 0:
            raise ConfigError("config field 'n_shared_experts' must be >= 0")
    default_scoring, default_method = _ROUTER_DEFAULTS[family]
    scoring = cfg.get("scoring_func") or default_scoring
    method = cfg.get("topk_method") or default_method
    if scoring not in ("softmax", "sigmoid"):
        raise ConfigError(f"config field 'scoring_func'={scoring!r}: softmax or sigmoid")
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise ConfigError(
            f"config field 'topk_method'={method!r}: greedy, group_limited_greedy or noaux_tc"
        )
    n_group = int(cfg.get("n_group") or 1)
    topk_group = int(cfg.get("topk_group") or n_group)
    if moe:
        _check_groups(choices, n_group, topk_group, top_k, method)
    return {
        "moe_intermediate_size": moe_inter,
        "n_routed_experts": n_routed,
        "num_experts_per_tok": top_k,
        "n_shared_experts": n_shared,
        "n_zero_experts": n_zero,
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
        "routed_scaling_factor": float(cfg.get("routed_scaling_factor", 1.0)),
        "scoring_func": cast(ScoringFunc, scoring),
        "topk_method": cast(TopkMethod, method),
        "n_group": n_group,
        "topk_group": topk_group,
        "router_bias": bool(cfg.get("router_bias", False)) and family == "longcat_flash",
    }


def _check_groups(choices: int, n_group: int, topk_group: int, top_k: int, method: str) -> None:
    if n_group <= 0 or choices % n_group:
        raise ConfigError(
            f"config field 'n_group'={n_group} must divide n_routed_experts={choices}"
        )
    if not 1 <= topk_group <= n_group:
        raise ConfigError(f"config field 'topk_group'={topk_group} must be in 1..n_group")
    if method == "noaux_tc" and choices // n_group < 2:
        raise ConfigError("topk_method noaux_tc needs at least 2 experts per group (n_group)")
    if top_k > (choices // n_group) * topk_group:
        raise ConfigError(
            f"config field 'num_experts_per_tok'={top_k} exceeds the experts in the "
            f"topk_group={topk_group} selected groups"
        )


def _sparse_fields(cfg: dict[str, Any], model_type: str, dims: dict[str, int]) -> dict[str, Any]:
    if model_type not in SPARSE_MODEL_TYPES:
        return {}
    return parse_indexer(
        cfg, model_type, dims["num_hidden_layers"], dims["qk_rope_head_dim"], ConfigError
    )


def _supported() -> str:
    families = ", ".join(sorted(_FAMILIES))
    return f"{families} (or one of them in a wrapper's text_config, as kimi_k25's)"


def _renamed(cfg: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """``cfg`` with each key of ``names`` also under its new name (transformers'
    ``attribute_map``), unless the config already has the new one."""
    out = dict(cfg)
    for old, new in names.items():
        if old in cfg and new not in cfg:
            out[new] = cfg[old]
    return out


# LongCat-Flash's config names -> the names _parse reads (transformers' attribute_map)
_LONGCAT_RENAMES = {
    "num_layers": "num_hidden_layers",
    "ffn_hidden_size": "intermediate_size",
    "expert_ffn_hidden_size": "moe_intermediate_size",
    "moe_topk": "num_experts_per_tok",
}


def _longcat_keys(cfg: dict[str, Any]) -> dict[str, Any]:
    """A ``longcat_flash`` config in the DeepSeek terms ``_parse`` reads: ``num_layers``
    decoder layers of two MLA blocks each (``num_hidden_layers`` here counts decoder layers;
    ``ModelConfig.num_mla_blocks`` the blocks), every layer with its shortcut MoE, the router
    a softmax over routed + zero experts, chosen with the correction bias (noaux_tc in one
    group), no renormalisation, no shared experts; RoPE theta 1e7 when the config has none."""
    hidden, layers = cfg.get("num_hidden_layers"), cfg.get("num_layers")
    if hidden is not None and (not isinstance(layers, int) or hidden != 2 * layers):
        raise ConfigError(
            f"config field 'num_hidden_layers'={hidden}: LongCat-Flash counts its decoder layers "
            f"in 'num_layers' ({layers!r}); num_hidden_layers is always twice that"
        )
    head_dim, rope_dim = cfg.get("head_dim"), cfg.get("qk_rope_head_dim")
    if head_dim is not None and head_dim != rope_dim:  # transformers' RoPE width is head_dim
        raise ConfigError(
            f"config field 'head_dim'={head_dim} must equal qk_rope_head_dim={rope_dim} "
            "(LongCat-Flash's rotary embedding is head_dim wide)"
        )
    out = dict(cfg)
    for key in ("num_hidden_layers", "intermediate_size", "moe_intermediate_size"):
        out.pop(key, None)  # transformers derives them; num_layers etc. are the config's own
    for longcat, ours in _LONGCAT_RENAMES.items():
        if longcat in cfg:
            out[ours] = cfg[longcat]
    for key, value in (
        ("scoring_func", "softmax"),
        ("topk_method", "noaux_tc"),
        ("n_group", 1),
        ("topk_group", 1),
        ("norm_topk_prob", False),
        ("n_shared_experts", 0),
        ("first_k_dense_replace", 0),
    ):
        if cfg.get(key) not in (None, value):
            raise ConfigError(f"config field {key!r}={cfg[key]!r}: LongCat-Flash's is {value!r}")
        out[key] = value
    out["mlp_layer_types"] = ["sparse"] * int(_positive_int(out, "num_hidden_layers"))
    params = out.get("rope_parameters") or out.get("rope_scaling") or {}
    if "rope_theta" not in out and not (isinstance(params, dict) and "rope_theta" in params):
        out["rope_theta"] = 10000000.0  # LongcatFlashConfig.default_theta
    return out


def _scalings(cfg: dict[str, Any], family: str, dims: dict[str, int]) -> dict[str, Any]:
    """MiniCPM3's embedding, residual and logits scalings (transformers' defaults when
    config.json is silent: 12, 1.4 / sqrt(L), hidden_size / 256; None means no scaling)."""
    if family != "minicpm3":
        return {}
    emb = cfg.get("scale_emb", 12)
    depth = cfg.get("scale_depth", 1.4)
    base = cfg.get("dim_model_base", 256)
    for key, value in (("scale_emb", emb), ("scale_depth", depth), ("dim_model_base", base)):
        positive = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
        if value is not None and not positive:
            raise ConfigError(f"config field {key!r} must be a positive number, got {value!r}")
    values = {
        "embedding_scale": 1.0 if emb is None else emb,
        "residual_scale": 1.0 if depth is None else depth / math.sqrt(dims["num_hidden_layers"]),
        "logits_divisor": 1.0 if base is None else dims["hidden_size"] / base,
    }
    return {k: float(v) for k, v in values.items()}
