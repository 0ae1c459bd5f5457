"""The step of a DeepSeek-V4 checkpoint (or dummy weights for its config): the reference model
(``mlafx.models.deepseek_v4``) served eagerly through ``V4EngineStep``.

What the engine does not do for V4 yet is refused here, before anything is built, each with
the reason: the compiled step (its attention, compressor and indexer ops are not lowered),
quantization on load (V4 ships FP8 + FP4 already), tensor parallelism, ``hf_overrides`` over
a checkpoint (its tensors fix the shapes), and batch invariance (it needs the compiled step).
"""

from __future__ import annotations

from pathlib import Path

from mlafx.config.deepseek_v4 import DeepseekV4Config
from mlafx.config.memory import check_need_fits, kv_bytes_per_block
from mlafx.config.model_config import load_hf_config_dict
from mlafx.config.presets import PRESETS
from mlafx.models.loader import torch_dtype
from mlafx.runtime.chat_template import load_chat_template
from mlafx.runtime.options import ServingOptions
from mlafx.runtime.step_source import ModelOptions, StepSource
from mlafx.runtime.tokenizer import load_tokenizer


def is_deepseek_v4(model: str | Path) -> bool:
    """Whether ``model`` (a checkpoint directory; presets are all MLA) is a DeepSeek-V4."""
    if isinstance(model, str) and model in PRESETS:
        return False
    config = Path(model) / "config.json"
    return config.is_file() and load_hf_config_dict(model).get("model_type") == "deepseek_v4"


def check_deepseek_v4_options(
    model: str | Path, build: ModelOptions, options: ServingOptions
) -> DeepseekV4Config:
    """Every check that needs no weights (config, options, memory); the model's config."""
    refused = {
        "compile=True": build.compile,
        "quantization": build.quantization is not None,
        "tensor_parallel_size > 1": build.tensor_parallel_size != 1,
        "batch_invariant": options.batch_invariant,
        "hf_overrides over a checkpoint": bool(build.hf_overrides) and build.load_format != "dummy",
    }
    named = [what for what, given in refused.items() if given]
    if named:
        raise ValueError(
            f"DeepSeek-V4 is served by its reference model only, eagerly (compile=False): "
            f"{', '.join(named)} not supported for it yet (its attention, compressor and "
            "indexer ops are not lowered; it ships FP8 + FP4 weights of its own)"
        )
    if build.load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format {build.load_format!r}: use 'auto' or 'dummy'")
    raw = {**load_hf_config_dict(model), **(build.hf_overrides or {})}
    cfg = DeepseekV4Config.from_hf_dict(raw)
    options.resolved_max_model_len(cfg)
    blocks = options.num_blocks(cfg, build.dtype)  # also checks the block size's rates
    weights_dir = Path(model) if build.load_format == "auto" else None
    from mlafx.models.deepseek_v4.build import deepseek_v4_weight_bytes

    weights = deepseek_v4_weight_bytes(cfg, torch_dtype(build.dtype), weights_dir)
    need = weights + kv_bytes_per_block(cfg, build.dtype, options.block_size) * min(blocks, 2)
    check_need_fits(
        need,
        f"DeepSeek-V4 model needs about {need / 2**30:.1f} GiB ({weights / 2**30:.1f} GiB "
        f"of weights for {cfg.num_hidden_layers} layers plus two KV blocks)",
    )
    return cfg


def deepseek_v4_source(
    model: str | Path, cfg: DeepseekV4Config, build: ModelOptions, options: ServingOptions
) -> StepSource:
    """The reference model (checkpoint or dummy weights) as the engine's step."""
    from mlafx.models.deepseek_v4.build import build_deepseek_v4
    from mlafx.models.deepseek_v4.engine_step import V4EngineStep

    checkpoint = Path(model) if build.load_format == "auto" else None
    reference = build_deepseek_v4(cfg, torch_dtype(build.dtype), checkpoint, seed=options.seed)
    return StepSource(
        cfg,
        build.dtype,
        V4EngineStep(reference, options.block_size),
        model=reference,
        tokenizer=load_tokenizer(model),
        chat_template=load_chat_template(model),
    )
