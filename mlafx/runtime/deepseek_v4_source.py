"""The step of a DeepSeek-V4 checkpoint (or dummy weights for its config): its compiled step
(``compile/v4_compiled_step.py``, the default) or the reference model
(``mlafx.models.deepseek_v4``) served eagerly through ``V4EngineStep`` (``compile=False``).

What the engine does not do for V4 yet is refused here, before anything is built, each with
the reason: quantization on load (V4 ships FP8 + FP4 already), tensor parallelism,
``hf_overrides`` over a checkpoint (its tensors fix the shapes), batch invariance, and
``allow_unlowered`` (a V4 layer has no unlowered form to fall back to).
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
        "quantization": build.quantization is not None,
        "tensor_parallel_size > 1": build.tensor_parallel_size != 1,
        "batch_invariant": options.batch_invariant,
        "hf_overrides over a checkpoint": bool(build.hf_overrides) and build.load_format != "dummy",
        "allow_unlowered": build.allow_unlowered,
    }
    named = [what for what, given in refused.items() if given]
    if named:
        raise ValueError(
            f"DeepSeek-V4: {', '.join(named)} not supported for it yet (it ships FP8 + FP4 "
            "weights of its own; its layers compile whole or not at all)"
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
    """The model (checkpoint or dummy weights) as the engine's step: compiled, or its
    reference served eagerly (``compile=False``)."""
    from mlafx.models.deepseek_v4.build import build_deepseek_v4
    from mlafx.models.deepseek_v4.engine_step import V4EngineStep

    checkpoint = Path(model) if build.load_format == "auto" else None
    reference = build_deepseek_v4(cfg, torch_dtype(build.dtype), checkpoint, seed=options.seed)
    tokenizer, chat_template = load_tokenizer(model), load_chat_template(model)
    if not build.compile:
        step = V4EngineStep(reference, options.block_size)
        return StepSource(
            cfg, build.dtype, step, model=reference, tokenizer=tokenizer,
            chat_template=chat_template,
        )  # fmt: skip
    from mlafx.compile.v4_compiled_step import compile_v4_step

    cache_dir = Path(build.compile_cache_dir) if build.compile_cache_dir is not None else None
    compiled = compile_v4_step(
        reference, options.block_size, cache_dir=cache_dir, release_replaced_weights=True
    )
    return StepSource(
        cfg, build.dtype, compiled, model=reference, compiled=compiled, tokenizer=tokenizer,
        chat_template=chat_template,
    )  # fmt: skip
