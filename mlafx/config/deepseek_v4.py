"""`DeepseekV4Config`: the frozen, validated description of one DeepSeek-V4 model
(``model_type: deepseek_v4``, V4-Flash and V4-Pro).

V4 descends from MLA but its attention is its own (``mlafx.models.deepseek_v4``): one shared
K=V head of ``head_dim`` per token, a sliding window of ``sliding_window`` rows, and on
compressed layers a pool of one entry per ``compress_rate`` tokens (CSA: searched by an
indexer; HCA: read whole). Read from a ``config.json`` as transformers writes it
(``layer_types``, ``mlp_layer_types``, ``compress_rates``, ``rope_parameters`` with ``main`` and
``compress``) or as DeepSeek ships it (``compress_ratios``, ``num_hash_layers``,
``compress_rate_csa`` / ``_hca``, ``qk_rope_head_dim``, flat YaRN keys for the compressed
rope), like transformers' ``DeepseekV4Config``. Every error names the field.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from mlafx.config.model_config import ConfigError, YarnScaling, _rope

SLIDING, CSA, HCA = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_LAYER_TYPES = ("hash_moe", "moe")
SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")
_RATIO_LAYER_TYPES = {0: SLIDING, 4: CSA, 128: HCA}  # DeepSeek's compress_ratios
# Version of the bytes the caches hold (``layer_cache_widths``, ``models/deepseek_v4``): bump it
# whenever a row's layout changes, so a KV store never serves stale rows.
CACHE_LAYOUT_VERSION = 1


@dataclass(frozen=True)
class V4Rope:
    """One of V4's two ropes, on the trailing ``qk_rope_head_dim`` dims of a head in
    interleaved pairs: ``main`` (sliding layers) or ``compress`` (CSA/HCA layers, their
    compressors and the indexer), each its own theta and optional YaRN."""

    theta: float
    scaling: YarnScaling | None


@dataclass(frozen=True)
class DeepseekV4Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int  # the shared K=V head; its trailing qk_rope_head_dim dims carry RoPE
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int  # grouped output projection: heads in o_groups groups, each to o_lora_rank
    o_lora_rank: int
    sliding_window: int
    layer_types: tuple[str, ...]  # SLIDING | CSA | HCA per layer
    csa_compress_rate: int
    hca_compress_rate: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int  # mHC residual streams
    hc_sinkhorn_iters: int
    hc_eps: float
    mlp_layer_types: tuple[str, ...]  # "hash_moe" | "moe" per layer
    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int  # routed and shared experts alike
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    rms_norm_eps: float
    main_rope: V4Rope
    compress_rope: V4Rope
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]

    @property
    def model_type(self) -> str:
        return "deepseek_v4"

    def compress_rate(self, layer: int) -> int:
        """Tokens per pool entry of layer ``layer`` (0: a sliding layer has no pool)."""
        kind = self.layer_types[layer]
        return {SLIDING: 0, CSA: self.csa_compress_rate, HCA: self.hca_compress_rate}[kind]

    def rope(self, layer: int) -> V4Rope:
        return self.main_rope if self.layer_types[layer] == SLIDING else self.compress_rope

    @property
    def compress_rates(self) -> tuple[int, ...]:
        """The distinct compression rates the layers use, ascending."""
        rates = {self.compress_rate(i) for i in range(self.num_hidden_layers)} - {0}
        return tuple(sorted(rates))

    def layer_cache_widths(self, layer: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(token caches, pool caches) row widths of layer ``layer``, in its cache order:
        window rows; on compressed layers the compressor's ``kv | gate`` inputs (CSA: two
        series, then the indexer's); then the pool (CSA: then the indexer's key pool)."""
        kind, c = self.layer_types[layer], self.head_dim
        if kind == SLIDING:
            return (c,), ()
        if kind == CSA:
            return (c, 4 * c, 4 * self.index_head_dim), (c, self.index_head_dim)
        return (c, 2 * c), (c,)

    @property
    def overlapping_rates(self) -> tuple[int, ...]:
        """Rates whose entries pool two windows (CSA's, and its indexer's): closing entry
        ``w`` reads window ``w - 1``'s token rows too."""
        return (self.csa_compress_rate,) if CSA in self.layer_types else ()

    def first_token_row_read(self, start: int) -> int:
        """The first position whose token rows (window rows, compressor inputs) a step that
        computes positions ``start ..`` reads: its queries' windows (``start - W + 1``) and
        the windows its compressors close (from ``start // m``; CSA's also the one before).
        Rows before it are never read again by that sequence."""
        first = start - self.sliding_window + 1
        for m in self.compress_rates:
            window = start // m - (1 if m in self.overlapping_rates else 0)
            first = min(first, window * m)
        return max(first, 0)

    @property
    def token_row_lookback(self) -> int:
        """How far before its first new position a step may read token rows: the most
        ``start - first_token_row_read(start)`` can be."""
        spans = [2 * m - 1 if m in self.overlapping_rates else m - 1 for m in self.compress_rates]
        return max([self.sliding_window - 1, *spans])

    def token_caches(self) -> tuple[bool, ...]:
        """Per cache (``cache_block_shapes`` order): whether it holds one row per token (the
        window rows and compressor inputs) rather than pool entries."""
        kinds: list[bool] = []
        for layer in range(self.num_hidden_layers):
            tokens, pools = self.layer_cache_widths(layer)
            kinds += [True] * len(tokens) + [False] * len(pools)
        return tuple(kinds)

    def cache_block_shapes(self, block_size: int) -> tuple[tuple[int, int], ...]:
        """Every cache of the step, layer by layer, as the shape of one of its blocks
        ``(rows, width)``: token caches hold ``block_size`` rows, pool caches
        ``pool_rows_per_block(rate, block_size)`` entries (``models/deepseek_v4/step.py``)."""
        shapes: list[tuple[int, int]] = []
        for layer in range(self.num_hidden_layers):
            tokens, pools = self.layer_cache_widths(layer)
            shapes += [(block_size, w) for w in tokens]
            rows = pool_rows_per_block(self.compress_rate(layer), block_size) if pools else 0
            shapes += [(rows, w) for w in pools]
        return tuple(shapes)

    def to_dict(self) -> dict[str, Any]:
        """The fields, the model type and the cache layout's version (the cache fingerprint's
        facts: ``runtime/block_hash.py``)."""
        return {
            "model_type": self.model_type,
            "cache_layout": CACHE_LAYOUT_VERSION,
            **dataclasses.asdict(self),
        }

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> DeepseekV4Config:
        return _parse(raw)


def pool_rows_per_block(rate: int, block_size: int) -> int:
    """Pool entries one cache block holds (``ValueError`` unless one divides the other)."""
    if block_size % rate and rate % block_size:
        raise ValueError(
            f"block size {block_size} and compression rate {rate}: one must divide the other"
        )
    return max(1, block_size // rate)


def _int(cfg: dict[str, Any], key: str, default: int | None = None, minimum: int = 1) -> int:
    value = cfg.get(key, default)
    if value is None:
        raise ConfigError(f"config field {key!r} is required for deepseek_v4")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"config field {key!r} must be an integer >= {minimum}, got {value!r}")
    return value


def _float(cfg: dict[str, Any], key: str, default: float) -> float:
    value = cfg.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"config field {key!r} must be a number, got {value!r}")
    return float(value)


def _layer_types(cfg: dict[str, Any], n: int) -> tuple[str, ...]:
    types = cfg.get("layer_types")
    if types is None and cfg.get("compress_ratios") is not None:
        ratios = cfg["compress_ratios"]
        unknown = [r for r in ratios if r not in _RATIO_LAYER_TYPES]
        if unknown:
            raise ConfigError(f"config field 'compress_ratios' has unknown ratios {unknown}")
        types = [_RATIO_LAYER_TYPES[r] for r in ratios]
    if types is None:  # transformers' default: two HCA layers, then HCA / CSA alternating
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    return _checked_types("layer_types", list(types)[:n], n, LAYER_TYPES)


def _mlp_layer_types(cfg: dict[str, Any], n: int) -> tuple[str, ...]:
    types = cfg.get("mlp_layer_types")
    if types is None:
        hashed = _int(cfg, "num_hash_layers", 3, minimum=0)
        types = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
    return _checked_types("mlp_layer_types", list(types)[:n], n, MLP_LAYER_TYPES)


def _checked_types(
    name: str, types: list[str], n: int, allowed: tuple[str, ...]
) -> tuple[str, ...]:
    if len(types) != n:
        raise ConfigError(f"config field {name!r} has {len(types)} entries for {n} layers")
    bad = sorted({t for t in types if t not in allowed})
    if bad:
        raise ConfigError(f"config field {name!r} has unknown entries {bad}; allowed: {allowed}")
    return tuple(types)


def _ropes(cfg: dict[str, Any]) -> tuple[V4Rope, V4Rope]:
    """(main, compress): transformers' nested ``rope_parameters`` or DeepSeek's flat keys
    (YaRN applies to the compressed rope only)."""
    params = cfg.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ConfigError("config field 'rope_parameters' must be an object")
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main, compress = params["main"], params["compress"]
    else:
        flat = {**(cfg.get("rope_scaling") or {}), **params}
        main = {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 10000.0)}
        compress = {
            **{k: v for k, v in flat.items() if k not in ("main", "compress", "rope_theta")},
            "rope_theta": cfg.get("compress_rope_theta", 160000.0),
        }
        if compress.get("rope_type", compress.get("type")) == "yarn":
            compress.setdefault("attention_factor", 1.0)  # transformers' V4 default

    def one(label: str, p: dict[str, Any]) -> V4Rope:
        p = {k: v for k, v in p.items() if k != "partial_rotary_factor"}
        original = p.get("original_max_position_embeddings")
        if p.get("rope_type", p.get("type")) == "yarn" and p.get("factor") is None and original:
            # transformers' YaRN factor default: max_position_embeddings / the original
            p["factor"] = _int(cfg, "max_position_embeddings", 1048576) / original
        try:
            theta, scaling = _rope({"rope_parameters": p})
        except ConfigError as e:
            raise ConfigError(f"rope_parameters[{label!r}]: {e}") from None
        if scaling is not None and not isinstance(scaling, YarnScaling):
            raise ConfigError(f"rope_parameters[{label!r}]: only default or YaRN RoPE")
        return V4Rope(theta, scaling)

    return one("main", main), one("compress", compress)


def _parse(cfg: dict[str, Any]) -> DeepseekV4Config:
    if cfg.get("model_type") != "deepseek_v4":
        raise ConfigError(f"config field 'model_type'={cfg.get('model_type')!r} is not deepseek_v4")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config field 'hidden_act'={cfg['hidden_act']!r}: V4 uses silu")
    if _int(cfg, "num_key_value_heads", 1) != 1:
        raise ConfigError("config field 'num_key_value_heads' must be 1 (V4's shared K=V head)")
    if _int(cfg, "n_shared_experts", 1) != 1:
        raise ConfigError("config field 'n_shared_experts' must be 1 (transformers' V4 builds one)")
    n = _int(cfg, "num_hidden_layers", 43)
    heads, head_dim = _int(cfg, "num_attention_heads", 64), _int(cfg, "head_dim", 512)
    rope_dim = cfg.get("qk_rope_head_dim")
    if rope_dim is None:
        factor = cfg.get("partial_rotary_factor") or 64 / 512
        rope_dim = int(head_dim * factor)
    if not isinstance(rope_dim, int) or not 0 < rope_dim <= head_dim or rope_dim % 2:
        raise ConfigError(f"config field 'qk_rope_head_dim'={rope_dim!r} must be even, <= head_dim")
    groups = _int(cfg, "o_groups", 8)
    if heads % groups:
        raise ConfigError(
            f"config field 'o_groups'={groups} must divide num_attention_heads={heads}"
        )
    rates = dict(cfg.get("compress_rates") or {})
    csa = _int({"r": rates.get(CSA, cfg.get("compress_rate_csa", 4))}, "r")
    hca = _int({"r": rates.get(HCA, cfg.get("compress_rate_hca", 128))}, "r")
    experts, top_k = _int(cfg, "n_routed_experts", 256), _int(cfg, "num_experts_per_tok", 6)
    if top_k > experts:
        raise ConfigError(f"config field 'num_experts_per_tok'={top_k} exceeds n_routed_experts")
    scoring = cfg.get("scoring_func", "sqrtsoftplus")
    if scoring not in SCORING_FUNCS:
        raise ConfigError(f"config field 'scoring_func'={scoring!r}; allowed: {SCORING_FUNCS}")
    vocab = _int(cfg, "vocab_size", 129280)
    eos = cfg.get("eos_token_id", 1)
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    if any(not 0 <= t < vocab for t in eos_ids):
        raise ConfigError(f"config field 'eos_token_id'={eos!r} is outside the vocabulary")
    main, compress = _ropes(cfg)
    bos = cfg.get("bos_token_id", 0)
    return DeepseekV4Config(
        vocab_size=vocab,
        hidden_size=_int(cfg, "hidden_size", 4096),
        num_hidden_layers=n,
        num_attention_heads=heads,
        head_dim=head_dim,
        qk_rope_head_dim=rope_dim,
        q_lora_rank=_int(cfg, "q_lora_rank", 1024),
        o_groups=groups,
        o_lora_rank=_int(cfg, "o_lora_rank", 1024),
        sliding_window=_int(cfg, "sliding_window", 128),
        layer_types=_layer_types(cfg, n),
        csa_compress_rate=csa,
        hca_compress_rate=hca,
        index_n_heads=_int(cfg, "index_n_heads", 64),
        index_head_dim=_int(cfg, "index_head_dim", 128),
        index_topk=_int(cfg, "index_topk", 512),
        hc_mult=_int(cfg, "hc_mult", 4),
        hc_sinkhorn_iters=_int(cfg, "hc_sinkhorn_iters", 20),
        hc_eps=_float(cfg, "hc_eps", 1e-6),
        mlp_layer_types=_mlp_layer_types(cfg, n),
        n_routed_experts=experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=_int(cfg, "moe_intermediate_size", 2048),
        scoring_func=scoring,
        routed_scaling_factor=_float(cfg, "routed_scaling_factor", 1.5),
        swiglu_limit=_float(cfg, "swiglu_limit", 10.0),
        rms_norm_eps=_float(cfg, "rms_norm_eps", 1e-6),
        main_rope=main,
        compress_rope=compress,
        max_position_embeddings=_int(cfg, "max_position_embeddings", 1048576),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
    )
