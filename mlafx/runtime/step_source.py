"""What an engine serves (``StepSource``), and the three ways to get one: a preset or
checkpoint (``model_source``: the reference model, its compiled step, or tensor-parallel
workers), an exported artifact (``artifact_source``), a ``transformers`` model object
(``transformers_source``). ``LLM.__init__`` serves any of them with a ``ServingOptions``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlafx.config import ModelConfig, ServedConfig, check_fits_in_memory
from mlafx.config.presets import PRESETS
from mlafx.models.loader import (
    DTYPES,
    LoadFormat,
    build_model,
    servable_stored_quantization,
    torch_dtype,
)
from mlafx.models.quantized import Quantization, check_quantization
from mlafx.models.step import StepFn
from mlafx.parallel import WorkerGroup, check_shardable, start_workers
from mlafx.parallel.quantized_shards import format_blocks
from mlafx.runtime.chat_template import ChatTemplate, load_chat_template
from mlafx.runtime.options import ServingOptions
from mlafx.runtime.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from mlafx.compile.compiled_step import CompiledStep
    from mlafx.compile.v4_compiled_step import CompiledV4Step
    from mlafx.export.artifact import LoadedArtifact
    from mlafx.models.deepseek import MLAForCausalLM
    from mlafx.models.deepseek_v4.model import DeepseekV4ForCausalLM


@dataclass(frozen=True)
class StepSource:
    """A step callable with its config and dtype, and what it came from."""

    config: ServedConfig
    dtype: str  # "float32" | "bfloat16" | "float16"
    step_fn: StepFn
    # the reference model (None: artifact, workers)
    model: MLAForCausalLM | DeepseekV4ForCausalLM | None = None
    # the compiled step, when the engine serves one
    compiled: CompiledStep | CompiledV4Step | None = None
    artifact: LoadedArtifact | None = None
    workers: WorkerGroup | None = None  # tensor-parallel ranks (they are the step)
    tokenizer: Any | None = None
    chat_template: ChatTemplate | None = None


@dataclass(frozen=True)
class ModelOptions:
    """How ``LLM(model, ...)`` builds its step from a preset or checkpoint (the ``LLM``
    docstring says what each does)."""

    load_format: LoadFormat = "auto"
    hf_overrides: dict[str, Any] | None = None
    dtype: str = "bfloat16"
    quantization: Quantization | None = None
    progress: bool = True
    compile: bool = True
    compile_cache_dir: str | Path | None = None
    allow_unlowered: bool = False
    tensor_parallel_size: int = 1
    tensor_parallel_local_ranks: int | None = None


def split_options(kwargs: dict[str, Any]) -> tuple[ModelOptions, ServingOptions]:
    """``LLM``'s keyword arguments as the two option sets; an unknown one is a TypeError
    naming it."""
    model_keys = {f.name for f in dataclasses.fields(ModelOptions)}
    serving_keys = {f.name for f in dataclasses.fields(ServingOptions)}
    unknown = sorted(set(kwargs) - model_keys - serving_keys)
    if unknown:
        raise TypeError(f"LLM() got unexpected keyword argument(s): {', '.join(unknown)}")
    return (
        ModelOptions(**{k: v for k, v in kwargs.items() if k in model_keys}),
        ServingOptions(**{k: v for k, v in kwargs.items() if k in serving_keys}),
    )


def check_batch_invariant(compile: bool) -> None:
    """``batch_invariant`` needs the compiled step (quantized weights of every kind are fine:
    int8/int4 on load, compressed-tensors int4, block FP8 and GGUF's types all run on kernels
    that give a row the same bits at any row count in the mode)."""
    if not compile:
        raise ValueError(
            "batch_invariant needs compile=True: the reference model runs ATen's own matmuls, "
            "whose sums follow the batch's shape"
        )


def check_model_options(
    model: str | Path, build: ModelOptions, options: ServingOptions
) -> ModelConfig:
    """Every check that needs no weights (config, options, combinations, memory), before
    anything is allocated; the model's config."""
    cfg = ModelConfig.from_model(model, build.hf_overrides)
    torch_dtype(build.dtype)  # validates the name
    check_quantization(build.quantization)
    if options.batch_invariant:
        check_batch_invariant(build.compile)
    tp = build.tensor_parallel_size
    if build.tensor_parallel_local_ranks is not None and tp == 1:
        raise ValueError("tensor_parallel_local_ranks needs tensor_parallel_size > 1")
    if tp != 1:
        check_shardable(cfg, tp)
    options.resolved_max_model_len(cfg)
    if build.load_format == "auto" and isinstance(model, str) and model in PRESETS:
        raise ValueError(
            f"preset {model!r} has no weights on this machine; use load_format='dummy' "
            "or a local checkpoint directory"
        )
    stored = None
    if build.load_format == "auto" and model not in PRESETS:
        stored = servable_stored_quantization(model)  # an unserved format fails here
    if tp != 1:
        check_shardable(cfg, tp, format_blocks(build.quantization, stored))
    # the weights plus the cache must fit
    blocks = options.num_blocks(cfg, build.dtype)
    check_fits_in_memory(cfg, build.dtype, blocks * options.block_size, build.quantization, stored)
    return cfg


def model_source(
    model: str | Path, cfg: ModelConfig, build: ModelOptions, options: ServingOptions
) -> StepSource:
    """The step of a preset or checkpoint: tensor-parallel workers, or the model built here
    and served as it is (``compile=False``) or captured, lowered and compiled."""
    checkpoint = None if model in PRESETS else model
    text: dict[str, Any] = {
        "tokenizer": None if checkpoint is None else load_tokenizer(checkpoint),
        "chat_template": None if checkpoint is None else load_chat_template(checkpoint),
    }
    if build.tensor_parallel_size != 1:
        workers = start_workers(
            cfg,
            world_size=build.tensor_parallel_size,
            model_dir=None if checkpoint is None else str(checkpoint),
            load_format=build.load_format,
            dtype=build.dtype,
            seed=options.seed,
            block_size=options.block_size,
            num_blocks=options.num_blocks(cfg, build.dtype),
            compile=build.compile,
            compile_cache_dir=build.compile_cache_dir,
            local_ranks=build.tensor_parallel_local_ranks,
            quantization=build.quantization,
        )
        return StepSource(cfg, build.dtype, workers, workers=workers, **text)
    reference = build_model(
        cfg,
        build.dtype,
        build.load_format,
        checkpoint,
        seed=options.seed,
        progress=build.progress,
        quantization=build.quantization,
    )
    if not build.compile:
        return StepSource(cfg, build.dtype, reference, model=reference, **text)
    from mlafx.compile.compiled_step import compile_step

    compiled = compile_step(
        reference,
        options.block_size,
        cache_dir=None if build.compile_cache_dir is None else Path(build.compile_cache_dir),
        allow_unlowered=build.allow_unlowered,
        release_replaced_weights=True,
    )
    return StepSource(cfg, build.dtype, compiled, model=reference, compiled=compiled, **text)


def artifact_source(path: str | Path, engine: str | None) -> StepSource:
    """An artifact written by ``mlafx.export``: its runner, config, dtype and tokenizer."""
    from mlafx.export.artifact import load_artifact

    loaded = load_artifact(path, engine)
    directory = loaded.tokenizer_dir
    tokenizer = None if directory is None else load_tokenizer(directory)
    return StepSource(
        loaded.config,
        loaded.dtype,
        loaded.step,
        artifact=loaded,
        tokenizer=tokenizer,
        chat_template=(
            None if directory is None or tokenizer is None else load_chat_template(directory)
        ),
    )


def transformers_source(
    hf_model: Any,
    hf_overrides: dict[str, Any] | None,
    options: ServingOptions,
    compile: bool,
    compile_cache_dir: str | Path | None,
    allow_unlowered: bool,
) -> StepSource:
    """mlafx's model over a ``transformers`` object's own tensors, served as it is or
    compiled (``options`` checked first); no tokenizer."""
    from mlafx.models.from_transformers import model_from_transformers

    model = model_from_transformers(hf_model, hf_overrides)
    dtype = next(n for n, d in DTYPES.items() if d == model.lm_head.weight.dtype)
    options.resolved_max_model_len(model.config)
    options.num_blocks(model.config, dtype)  # validates the cache size before compiling
    block_size = options.block_size
    if not compile:
        return StepSource(model.config, dtype, model, model=model)
    from mlafx.compile.compiled_step import compile_step

    cache_dir = None if compile_cache_dir is None else Path(compile_cache_dir)
    compiled = compile_step(model, block_size, cache_dir=cache_dir, allow_unlowered=allow_unlowered)
    return StepSource(model.config, dtype, compiled, model=model, compiled=compiled)
