"""Artifact directories: write one (:func:`export_model`, :func:`export`), check and load
one (:func:`load_artifact`).

    DIR/manifest.json        what the directory holds and needs (manifest.py)
    DIR/weights.safetensors  the weights, for every format (weights.py)
    DIR/layer-<k>.pt2        aoti: the AOTInductor packages the compiled engine runs, one per
                             layer kind (code only; manifest step.layer_kinds)
    DIR/step.pt2             pt2:  the torch.export program, weights as inputs (pt2_step.py)
    DIR/step.onnx            onnx: the functional step; its initializers point into
                             weights.safetensors (onnx_export.py)
    DIR/tokenizer.json       when the model has one (a GGUF's: rebuilt from its metadata)
    DIR/tokenizer_config.json, chat_template.jinja   with it, when the model has them

Pickled data: none in weights.safetensors, manifest.json or step.onnx. Each ``layer-<k>.pt2`` of
an aoti artifact is a zip holding a shared library that runs native code when loaded; a
``torch.export`` archive (pt2) is JSON and raw bytes, but torch unpickles any tensor
constant stored in pickle form. Loading is safe against modified or corrupted files
because :func:`~mlafx.export.manifest.verify_artifact` checks every file's sha256 against
the manifest before a loader opens it; the manifest itself is trusted, so only serve
artifacts from a source you would run code from.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mlafx.compile.compiled_step import (
    CompiledStep,
    LayerPackage,
    layer_package,
    lower_step,
    model_constants,
)
from mlafx.compile.layer_kinds import LayerKind, layer_kinds
from mlafx.config import ModelConfig
from mlafx.config.gguf_tokenizer import save_gguf_tokenizer
from mlafx.export.isa import aoti_cpu_requirements
from mlafx.export.manifest import (
    FORMATS,
    MANIFEST_FILE,
    ArtifactError,
    Manifest,
    file_entries,
    verify_artifact,
)
from mlafx.export.weights import WEIGHTS_FILE, load_weights, save_weights
from mlafx.models.deepseek import MLAForCausalLM
from mlafx.models.fp8 import is_fp8
from mlafx.models.loader import DTYPES, LoadFormat, build_model
from mlafx.models.quantized import Quantization, check_quantization, is_quantized
from mlafx.models.step import StepFn

log = logging.getLogger(__name__)
TOKENIZER_FILE = "tokenizer.json"
CHAT_TEMPLATE_FILES = ("tokenizer_config.json", "chat_template.jinja")
# which runner serves each format; "onnxruntime" is the only engine for ONNX
ENGINES = {"aoti": "torch", "pt2": "torch", "onnx": "onnxruntime"}


@contextlib.contextmanager
def _phase(name: str) -> Iterator[None]:
    """Log a long phase's start and duration (export phases take seconds to minutes)."""
    log.warning("mlafx export: %s ...", name)
    start = time.perf_counter()
    yield
    log.warning("mlafx export: %s done in %.1f s", name, time.perf_counter() - start)


def export(
    model: str | Path,
    output: str | Path,
    format: str = "aoti",
    *,
    load_format: LoadFormat = "auto",
    hf_overrides: dict[str, Any] | None = None,
    dtype: str = "bfloat16",
    quantization: Quantization | None = None,
    block_size: int = 16,
    seed: int = 0,
    progress: bool = True,
    compile_cache_dir: str | Path | None = None,
) -> Manifest:
    """Build the model as ``mlafx.LLM`` would (same arguments) and write its artifact of
    ``format`` (``"aoti"``, ``"pt2"`` or ``"onnx"``) to the new directory ``output``."""
    from mlafx.config.presets import PRESETS

    _check_format(format)
    check_quantization(quantization)
    if format == "onnx":
        _check_onnx_dtype(dtype)  # before the (slow) model build
        _check_onnx_quantization(quantization is not None, False)
    cfg = ModelConfig.from_model(model, hf_overrides)
    if load_format == "auto" and isinstance(model, str) and model in PRESETS:
        raise ValueError(f"preset {model!r} has no weights here; use load_format='dummy'")
    model_dir = None if isinstance(model, str) and model in PRESETS else Path(model)
    with _phase(f"building {cfg.model_type} ({cfg.num_hidden_layers} layers, {dtype})"):
        built = build_model(
            cfg, dtype, load_format, model_dir, seed=seed, progress=progress,
            quantization=quantization,
        )  # fmt: skip
    with tempfile.TemporaryDirectory() as scratch:
        tokenizer = None
        if model_dir is not None and model_dir.suffix == ".gguf":  # rebuilt from the metadata
            if save_gguf_tokenizer(model_dir, Path(scratch)):
                tokenizer = Path(scratch) / TOKENIZER_FILE
        elif model_dir is not None and (model_dir / TOKENIZER_FILE).is_file():
            tokenizer = model_dir / TOKENIZER_FILE
        return export_model(
            built,
            Path(output),
            format,
            block_size=block_size,
            tokenizer=tokenizer,
            compile_cache_dir=None if compile_cache_dir is None else Path(compile_cache_dir),
        )


def export_model(
    model: MLAForCausalLM,
    output: Path,
    format: str,
    *,
    block_size: int,
    tokenizer: Path | None = None,
    compile_cache_dir: Path | None = None,
) -> Manifest:
    """Write ``model``'s artifact to ``output`` (which must not exist or be empty). The
    directory appears whole or not at all (written beside it, then renamed)."""
    import mlafx

    dtype = _check_export(model, output, format, block_size)
    staging = output.with_name(f".{output.name}.partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        with _phase("writing the weights"):
            aliases = save_weights(model_constants(model), staging / WEIGHTS_FILE)
        step, cpu = _write_step(model, format, block_size, staging, compile_cache_dir)
        if tokenizer is not None:
            shutil.copyfile(tokenizer, staging / TOKENIZER_FILE)
            for name in CHAT_TEMPLATE_FILES:  # the chat template and its special tokens
                if (tokenizer.parent / name).is_file():
                    shutil.copyfile(tokenizer.parent / name, staging / name)
        with _phase("hashing the files"):
            names = sorted(p.name for p in staging.iterdir() if p.name != MANIFEST_FILE)
            files = file_entries(staging, names)
        manifest = Manifest(
            format=format,
            mlafx_version=mlafx.__version__,
            torch_version=torch.__version__,
            model_config=model.config.to_dict(),
            dtype=dtype,
            block_size=block_size,
            custom_ops={} if format == "onnx" else mlafx_op_schemas(),
            cpu=cpu,
            files=files,
            step=step,
            weight_aliases=aliases,
        )
        manifest.write(staging)
        if output.exists():
            output.rmdir()  # empty, checked above
        staging.rename(output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.warning("mlafx export: wrote %s artifact %s", format, output)
    return manifest


def _check_export(model: MLAForCausalLM, output: Path, format: str, block_size: int) -> str:
    """Refuse what cannot be exported before anything is written; the artifact's dtype name."""
    _check_format(format)
    if not 1 <= block_size <= 256:
        raise ValueError(f"block_size must be in 1..256, got {block_size}")
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise ValueError(f"{output} exists and is not an empty directory; choose a new one")
    dtype = _dtype_name(model.dtype)
    if format == "onnx":
        _check_onnx_dtype(dtype)
        _check_onnx_quantization(is_quantized(model), is_fp8(model))
        if model.config.sparse_attention:
            raise ValueError(
                f"ONNX export of {model.config.model_type} (DSA sparse attention) is not "
                "supported: its indexer top-k and sparse attention have no onnxruntime "
                "translation; export it as aoti or pt2"
            )
    return dtype


def _write_step(
    model: MLAForCausalLM,
    format: str,
    block_size: int,
    staging: Path,
    compile_cache_dir: Path | None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The format's step files in ``staging``: the manifest's ``step`` and ``cpu`` entries."""
    if format == "aoti":
        with _phase("AOTInductor packages, one per layer kind (compiled unless cached)"):
            step: dict[str, Any] = {"layer_kinds": []}
            for k, kind in enumerate(layer_kinds(model)):
                package = layer_package(model, kind, block_size, compile_cache_dir)
                shutil.copyfile(package.package, staging / f"layer-{k}.pt2")
                step["layer_kinds"].append(
                    {"name": kind.name, "file": f"layer-{k}.pt2", "layers": list(kind.layers)}
                )
        # one compiler and one machine built them all: the flags are the same
        return step, aoti_cpu_requirements(staging / step["layer_kinds"][0]["file"])
    cpu: dict[str, Any] = {"required_flags": []}  # portable: no compiled code ships
    with _phase("capturing and lowering the step"):
        lowered = lower_step(model, block_size)
    if format == "pt2":
        from mlafx.export.pt2_step import export_pt2

        with _phase("torch.export program"):
            return export_pt2(lowered, staging), cpu
    from mlafx.export.onnx_export import export_onnx

    with _phase("ONNX (functional step, translated ops, checker)"):
        return export_onnx(lowered, model, block_size, staging, WEIGHTS_FILE), cpu


def mlafx_op_schemas() -> dict[str, str]:
    """``{"mlafx::op": schema}`` of every op the mlafx kernel library registers."""
    import mlafx.kernels  # noqa: F401  (loads the library)

    names = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("mlafx::"))
    schemas = {}
    for name in names:
        op = getattr(torch.ops.mlafx, name.split("::", 1)[1])
        schemas[name] = str(op.default._schema)
    return schemas


@dataclass(frozen=True)
class LoadedArtifact:
    """A verified artifact, ready for the engine: its config, dtype, block size and step
    (``(input_ids, positions, caches, meta, logits_indices) -> logits``)."""

    directory: Path
    manifest: Manifest
    config: ModelConfig
    dtype: str
    block_size: int
    step: StepFn
    engine: str
    load_seconds: float

    @property
    def tokenizer_dir(self) -> Path | None:
        return self.directory if TOKENIZER_FILE in self.manifest.files else None


def load_artifact(directory: str | Path, engine: str | None = None) -> LoadedArtifact:
    """Verify ``directory`` (hashes first, then versions, op schemas and CPU), then load its
    step with ``engine`` (None: the format's own; ``"onnxruntime"`` for ONNX)."""
    start = time.perf_counter()
    directory = Path(directory)
    manifest = verify_artifact(directory)
    expected = ENGINES[manifest.format]
    if engine is not None and engine != expected:
        raise ArtifactError(
            f"engine {engine!r} cannot serve a {manifest.format} artifact (use {expected!r}); "
            "engine='onnxruntime' runs ONNX artifacts"
        )
    step: StepFn
    if manifest.format == "onnx":
        from mlafx.export.onnx_export import OnnxStep

        step = OnnxStep(directory / manifest.step["file"], manifest.step["input_names"])
    else:
        weights = load_weights(directory / WEIGHTS_FILE, manifest.weight_aliases)
        if manifest.format == "aoti":
            packages = [
                LayerPackage(
                    LayerKind(k["name"], "", tuple(k["layers"])), directory / k["file"], None
                )
                for k in manifest.step["layer_kinds"]
            ]
            step = CompiledStep(manifest.config(), weights, packages)
        else:
            from mlafx.export.pt2_step import Pt2Step

            step = Pt2Step(
                directory / manifest.step["file"], weights, manifest.step["weight_names"]
            )
    return LoadedArtifact(
        directory,
        manifest,
        manifest.config(),
        manifest.dtype,
        manifest.block_size,
        step,
        expected,
        time.perf_counter() - start,
    )


def _check_format(format: str) -> None:
    if format not in FORMATS:
        raise ValueError(f"unknown artifact format {format!r}; use one of {', '.join(FORMATS)}")


def _check_onnx_dtype(dtype: str) -> None:
    if dtype != "float32":
        raise ValueError(
            f"ONNX export needs --dtype float32 (got {dtype}): onnxruntime's CPU provider "
            "lacks bfloat16/float16 kernels for the step's ops"
        )


def _check_onnx_quantization(quantized: bool, fp8: bool) -> None:
    if fp8:
        raise ValueError(
            "ONNX export of a block-FP8 checkpoint is not supported: onnxruntime's CPU provider "
            "has no e4m3 matmul; export it as aoti or pt2 (which keep the FP8 bytes)"
        )
    if quantized:
        raise ValueError(
            "ONNX export of a quantized model is not supported: mlafx's int8/int4 linears "
            "quantize activations per group of 32 (W8A8), which stock onnxruntime ops do not "
            "express exactly; export it as aoti or pt2, or export the unquantized model"
        )


def _dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, value in DTYPES.items() if value == dtype)
