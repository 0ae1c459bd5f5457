"""Build the model for a config and dtype, then fill its weights (checkpoint or dummy)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

import torch

from mlafx.config import ModelConfig
from mlafx.config.gguf_file import GgufFile, is_gguf, open_gguf
from mlafx.config.model_config import load_hf_config_dict
from mlafx.config.stored_quantization import (
    BlockFp8,
    PackedInt4,
    StoredQuantization,
    stored_quantization,
)
from mlafx.models.block_fp8_checkpoint import (
    Fp8Plan,
    install_fp8_modules,
    load_block_fp8,
    plan_block_fp8,
)
from mlafx.models.deepseek import MLAForCausalLM
from mlafx.models.gguf_checkpoint import install_gguf_modules, load_gguf, plan_gguf
from mlafx.models.packed_int4_checkpoint import (
    PackedPlan,
    install_packed_modules,
    load_packed_int4,
    plan_packed_int4,
)
from mlafx.models.quantized import Quantization, Quantizer

log = logging.getLogger(__name__)

LoadFormat = Literal["auto", "dummy"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(
            f"dtype {name!r} is not supported; use one of {', '.join(DTYPES)}"
        ) from None


def servable_stored_quantization(
    model_dir: str | Path,
) -> StoredQuantization | GgufFile | None:
    """The quantized format checkpoint ``model_dir`` is stored in (None: unquantized); one
    ``ConfigError`` line for a format mlafx does not serve. A GGUF file: its ``GgufFile``."""
    if is_gguf(model_dir):
        return open_gguf(model_dir)
    return stored_quantization(load_hf_config_dict(model_dir))


def build_model(
    cfg: ModelConfig,
    dtype: str,
    load_format: LoadFormat,
    model_dir: str | Path | None = None,
    *,
    seed: int = 0,
    progress: bool = True,
    quantization: Quantization | None = None,
) -> MLAForCausalLM:
    """An eval-mode model in ``dtype`` (router weights stay float32) with its weights filled.

    The module tree is built on the meta device, so no tensor is allocated twice.
    ``load_format="auto"`` hands the meta tensors to ``load_safetensors_weights``: a checkpoint
    tensor already in the target's dtype and shape becomes the target, mapped from the file
    (never allocated); the others are allocated and copied in (fused experts, casts).
    ``"dummy"`` allocates and fills one tensor at a time with seeded random values.
    ``quantization`` ("int8" | "int4", ``models/quantized.py``) quantizes each linear and
    expert stack as soon as it is loaded or drawn, so the full-precision model never exists.
    A checkpoint stored quantized (its ``quantization_config``,
    ``config/stored_quantization.py``) loads its quantized modules from their own bytes
    (``models/packed_int4_checkpoint.py``, ``models/block_fp8_checkpoint.py``);
    ``quantization`` then applies to the rest.
    """
    from mlafx.models.weights import (
        Elsewhere,
        checkpoint_files,
        init_dummy_weights,
        load_safetensors_weights,
    )

    if load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format {load_format!r} is not supported; use 'auto' or 'dummy'")
    with torch.device("meta"):
        model = MLAForCausalLM(cfg)
    model.to(torch_dtype(dtype))
    model.keep_float32()
    checkpoint = None
    if load_format == "auto":
        if model_dir is None:
            raise ValueError("load_format='auto' needs a model directory with safetensors weights")
        checkpoint = Path(model_dir)
        if is_gguf(checkpoint):
            return _build_from_gguf(model, cfg, checkpoint, progress, quantization)
    packed: Fp8Plan | PackedPlan | None = None
    if checkpoint is not None:
        stored = servable_stored_quantization(checkpoint)
        if isinstance(stored, BlockFp8):
            fp8 = plan_block_fp8(model, checkpoint_files(checkpoint), cfg.num_hidden_layers, stored)
            install_fp8_modules(model, fp8)
            packed = fp8
        elif isinstance(stored, PackedInt4):
            files = checkpoint_files(checkpoint)
            int4 = plan_packed_int4(model, files, cfg.num_hidden_layers, stored)
            install_packed_modules(model, int4)
            packed = int4
    quantizer = None if quantization is None else Quantizer(model, quantization)
    on_filled = None if quantizer is None else quantizer.finish
    if checkpoint is None:
        init_dummy_weights(model, seed=seed, on_filled=on_filled)
    else:
        elsewhere = None
        if packed is not None:
            elsewhere = Elsewhere(frozenset(packed.keys), frozenset(packed.targets()))
        load_safetensors_weights(
            model,
            checkpoint,
            num_hidden_layers=cfg.num_hidden_layers,
            progress=progress,
            on_filled=on_filled,
            elsewhere=elsewhere,
        )
        if isinstance(packed, Fp8Plan):
            load_block_fp8(model, packed, progress=progress)
        elif packed is not None:
            load_packed_int4(model, packed, progress=progress)
    if quantizer is not None:
        quantizer.check_done()
    return _finished(model)


def _finished(model: MLAForCausalLM) -> MLAForCausalLM:
    model.reset_rope()  # a non-persistent buffer: not in the state_dict, not in checkpoints
    unfilled = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if unfilled:
        raise RuntimeError(f"tensors left on the meta device after loading: {unfilled[:5]}")
    return model.eval().requires_grad_(False)


def _build_from_gguf(
    model: MLAForCausalLM,
    cfg: ModelConfig,
    path: str | Path,
    progress: bool,
    quantization: Quantization | None,
) -> MLAForCausalLM:
    """The model over a GGUF file's tensors (``models/gguf_checkpoint.py``)."""
    if quantization is not None:
        raise ValueError(
            f"quantization={quantization!r} does not apply to a GGUF file: its tensors run in "
            "the types the file stores (see the README's GGUF section)"
        )
    gguf = open_gguf(path)
    plan = plan_gguf(model, gguf, cfg)
    install_gguf_modules(model, plan)
    load_gguf(model, plan, cfg, progress=progress)
    return _finished(model)
