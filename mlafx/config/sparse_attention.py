"""DeepSeek Sparse Attention (DSA) settings of a config: the lightning indexer's shape and which
layers run it (DeepSeek-V3.2's ``deepseek_v32``, GLM-5's ``glm_moe_dsa``).

Every layer of V3.2 runs its indexer. GLM-5 lists a per-layer ``indexer_types``: a ``full``
layer runs its own indexer, a ``shared`` layer reuses the selection of the last full layer
before it (and has no indexer, so no indexer cache). When the config has no list, transformers
derives it from ``index_topk_pattern`` ("F"/"S" per layer) or from ``index_topk_freq`` and
``index_skip_topk_offset``; so does this module.
"""

from __future__ import annotations

from typing import Any

# model_type -> (default index_n_heads, indexer RoPE interleaved). transformers rotates the
# indexer's first R dims as NeoX halves in V3.2 and as interleaved pairs in GLM-5 (the MLA's own
# RoPE is interleaved pairs in both).
SPARSE_MODEL_TYPES = {"deepseek_v32": (64, False), "glm_moe_dsa": (32, True)}
INDEXER_TYPES = ("full", "shared")

# config.json keys only this module reads
SPARSE_KEYS = {
    "index_topk",
    "index_head_dim",
    "index_n_heads",
    "indexer_types",
    "index_topk_pattern",
    "index_topk_freq",
    "index_skip_topk_offset",
}


def parse_indexer(
    cfg: dict[str, Any], model_type: str, num_layers: int, rope_dim: int, error: type[Exception]
) -> dict[str, Any]:
    """The ``ModelConfig`` fields of a DSA model type's config (raising ``error`` naming the
    field): ``index_topk``, ``index_n_heads``, ``index_head_dim``, ``indexer_types`` and
    ``indexer_rope_interleave``."""
    default_heads, interleave = SPARSE_MODEL_TYPES[model_type]
    fields = {
        "index_topk": cfg.get("index_topk", 2048),
        "index_n_heads": cfg.get("index_n_heads", default_heads),
        "index_head_dim": cfg.get("index_head_dim", 128),
    }
    for key, value in fields.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise error(f"config field {key!r} must be a positive integer, got {value!r}")
    if fields["index_head_dim"] < rope_dim:
        raise error(
            f"config field 'index_head_dim'={fields['index_head_dim']} must be at least "
            f"qk_rope_head_dim={rope_dim} (the indexer rotates its first {rope_dim} dims)"
        )
    if cfg.get("q_lora_rank") is None:
        raise error("config field 'q_lora_rank' is missing: the DSA indexer reads the q LoRA")
    types = _indexer_types(cfg, model_type, num_layers, error)
    return {**fields, "indexer_types": types, "indexer_rope_interleave": interleave}


def _indexer_types(
    cfg: dict[str, Any], model_type: str, num_layers: int, error: type[Exception]
) -> tuple[str, ...]:
    explicit = cfg.get("indexer_types")
    pattern = cfg.get("index_topk_pattern")
    if model_type != "glm_moe_dsa":
        for key in ("indexer_types", "index_topk_pattern"):
            if cfg.get(key) is not None and set(cfg[key]) - {"full", "F"}:
                raise error(f"config field {key!r}: every {model_type} layer runs its indexer")
        return ("full",) * num_layers
    if explicit is not None:
        types = tuple(explicit)
    elif pattern is not None:
        letters = {"F": "full", "S": "shared"}
        if isinstance(pattern, str):
            if set(pattern) - set(letters):
                raise error(f"config field 'index_topk_pattern'={pattern!r}: letters F and S")
            types = tuple(letters[c] for c in pattern)
        else:
            types = tuple(pattern)
    else:
        freq = max(int(cfg.get("index_topk_freq") or 1), 1)
        offset = int(cfg.get("index_skip_topk_offset", 2))
        types = tuple(
            "full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)
        )
    if len(types) != num_layers or set(types) - set(INDEXER_TYPES):
        raise error(
            f"config field 'indexer_types' must list 'full'/'shared' for each of the "
            f"{num_layers} layers, got {list(types)}"
        )
    if types[0] != "full":
        raise error(
            "config field 'indexer_types': layer 0 is 'shared', but a shared layer reuses the "
            "selection of an earlier full layer"
        )
    return types
