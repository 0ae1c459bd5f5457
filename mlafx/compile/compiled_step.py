"""The compiled step: one AOTInductor package per layer kind, run for every layer of that kind.

    cos, sin = rope_cos_sin(positions)                  (host, as the reference model)
    x        = embedding(input_ids)                     (host; MiniCPM3: times scale_emb)
    for each layer i:  x = package[kind(i)](x, positions, cos, sin, caches of layer i, meta)
                       (a LayerStep graph: captured, MLA-lowered and compiled once per kind,
                       loaded once per layer with that layer's weights)
    logits   = linear_packed(rms_norm(x[logits_indices]), lm_head)   (host, one custom op;
                                                                      MiniCPM3: norm / divisor)

Compile cost is per layer *kind* (DeepSeek: dense and MoE), not per layer, so a 61-layer
model compiles about as fast as a 2-layer one. Capture, lowering and compilation read the
layer's weights in place and copy none of them (the stages share them, ``graph_utils.copy_graph``;
AOTInductor keeps them out of the shared library, ``package_constants_in_so=False``): the
weights are handed to each loaded package with ``load_constants``. Packages are code only,
cached on disk by config (less the layer count), the layer's structure, dtype, block size and
versions, so the next engine start, and every model sharing a layer kind, loads them.

Two processes may start on an empty cache together: a package is built under a lock and
written through a unique temporary file renamed into place; each process takes first the
kinds nobody else is building, and waits only when none is left (``package_lock.py``). A
lowering that fails verification is an error naming the layer kind and its sites, and nothing
is cached; ``allow_unlowered=True`` serves the captured (unlowered, much slower) layer
instead, loudly and without caching it.

``lower_step`` lowers the whole step as one program: what the pt2 and ONNX artifacts ship.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F

from mlafx.compile.aoti_runner import PackageRunner
from mlafx.compile.layer_kinds import LayerKind, kind_of_layers, layer_kinds
from mlafx.compile.package_lock import free_first, package_lock
from mlafx.config import ModelConfig
from mlafx.graph.capture import (
    LAYER_PREFIX,
    capture_layer,
    capture_step,
    layer_dynamic_shapes,
    sample_layer,
    sample_step,
    size_oblivious,
    step_dynamic_shapes,
)
from mlafx.models.deepseek import MLAForCausalLM, caches_by_layer
from mlafx.models.layers import rms_norm, scale_embedding, scale_logits_input
from mlafx.models.rope import rope_cos_sin, rope_inv_freq, rope_scale
from mlafx.models.step import CACHE_LAYOUT_VERSION, StepMetadata
from mlafx.passes.derived_constants import packed_name, with_derived_constants
from mlafx.passes.pipeline import LoweringResult, lower_step_graph, lowering_source_sha256

log = logging.getLogger(__name__)


class LoweringError(RuntimeError):
    """The lowered graph failed verification: compiling it would serve wrong results."""


def default_cache_dir() -> Path:
    """``$MLAFX_CACHE_DIR`` if set (the test suite points it inside the repo), else
    ``~/.cache/mlafx/compiled``."""
    configured = os.environ.get("MLAFX_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "mlafx" / "compiled"


# Weights stay outside the shared library, handed over by load_constants. And every weight
# stays a constant: by default inductor inlines 1-D tensors of <= 8 elements (a small
# model's router correction bias, RoPE frequencies) into the code as literals, which would
# bake one model's values into a package that the key shares with every model of the config.
INDUCTOR_CONFIGS = MappingProxyType(
    {
        "aot_inductor.package_constants_in_so": False,
        "always_keep_tensor_constants": True,
    }
)

# Config fields no decoder layer's graph depends on: a layer package serves every depth.
_NOT_IN_LAYER = (
    "num_hidden_layers",
    "mlp_layer_types",
    "vocab_size",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_ids",
)


def package_versions() -> dict[str, object]:
    import mlafx
    from mlafx.kernels import _build_info  # the kernels the package will call (gitignored)

    return {
        "torch": torch.__version__,
        "mlafx": mlafx.__version__,
        "kernels": _build_info.CSRC_SHA256,
        "layout": CACHE_LAYOUT_VERSION,
        "lowering": lowering_source_sha256(),  # model, capture and passes sources
        "inductor": dict(INDUCTOR_CONFIGS),
    }


def package_key(config: ModelConfig, kind: LayerKind, dtype: torch.dtype, block_size: int) -> str:
    layer_config = {k: v for k, v in config.to_dict().items() if k not in _NOT_IN_LAYER}
    facts = {
        "config": layer_config,
        "layer": kind.signature,
        "dtype": str(dtype),
        "block_size": block_size,
        **package_versions(),
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def package_path(
    model: MLAForCausalLM, kind: LayerKind, block_size: int, cache_dir: Path | None = None
) -> Path:
    """Where the package of ``model``'s layer kind ``kind`` lives in the on-disk cache."""
    key = package_key(model.config, kind, model.dtype, block_size)
    return (cache_dir or default_cache_dir()) / f"layer-{key}.pt2"


@dataclass(frozen=True)
class LoweredGraph:
    """A lowered graph as an ExportedProgram (dynamic extents), with the pass report and the
    sample arguments it was traced with."""

    program: torch.export.ExportedProgram
    lowering: LoweringResult
    sample_args: tuple


@dataclass(frozen=True)
class LayerPackage:
    kind: LayerKind
    package: Path
    lowering: LoweringResult | None  # None when the package came from the cache
    unlowered: bool = False  # the captured layer (allow_unlowered): not cached, deleted once loaded


def _checked(lowering: LoweringResult, what: str) -> LoweringResult:
    if lowering.verify_error is not None:
        sites = ", ".join(f"{s.sdpa.name} (layer {s.layer})" for s in lowering.sites) or "none"
        raise LoweringError(
            f"{what}: the lowered graph failed verification at MLA site(s) {sites}: "
            f"{lowering.verify_error}. Nothing was cached. LLM(..., allow_unlowered=True) "
            "serves the captured graph instead (the reference attention: far slower)."
        )
    return lowering


def _export(
    graph: torch.nn.Module, args: tuple, dynamic_shapes: Any
) -> torch.export.ExportedProgram:
    with size_oblivious(), torch.no_grad():
        return torch.export.export(graph, args, dynamic_shapes=dynamic_shapes, strict=False)


def lower_layer(
    model: MLAForCausalLM, kind: LayerKind, block_size: int, *, allow_unlowered: bool = False
) -> LoweredGraph:
    """Capture the first layer of ``kind``, run the MLA passes, verify, and re-export the
    lowered graph with the step's dynamic extents. Raises ``LoweringError`` when verification
    fails, unless ``allow_unlowered`` (then the program is the captured layer)."""
    start = time.perf_counter()
    sample = sample_layer(model, block_size, kind.layers[0])
    captured = capture_layer(model, kind.layers[0], block_size)
    lowering = lower_step_graph(
        captured.module(), sample, sample.caches, time.perf_counter() - start
    )
    if lowering.verify_error is not None and allow_unlowered:
        log.error(
            "layer kind %s: the lowered graph failed verification (%s); serving the captured "
            "graph UNLOWERED (reference attention, not cached)",
            kind.name,
            lowering.verify_error,
        )
    else:
        _checked(lowering, f"layer kind {kind.name} (layers {list(kind.layers)})")
    args = sample.args(sample.caches)
    dynamic = layer_dynamic_shapes(len(sample.caches), selection=sample.selected is not None)
    return LoweredGraph(_export(lowering.graph, args, dynamic), lowering, args)


def lower_step(model: MLAForCausalLM, block_size: int) -> LoweredGraph:
    """Capture the whole step, run the MLA passes, verify (``LoweringError`` on failure) and
    re-export the lowered graph with the step's dynamic extents: the program the pt2 and ONNX
    artifacts start from."""
    start = time.perf_counter()
    sample, caches = sample_step(model, block_size)
    captured = capture_step(model, block_size)
    lowering = lower_step_graph(captured.module(), sample, caches, time.perf_counter() - start)
    _checked(lowering, "the step")
    args = sample.args(caches)
    program = _export(lowering.graph, args, step_dynamic_shapes(model.config.num_caches))
    return LoweredGraph(program, lowering, args)


def build_aoti_package(program: torch.export.ExportedProgram, package: Path) -> None:
    """AOT-compile ``program`` into ``package`` (code only: the weights stay outside the
    shared library and are handed over at load time). Written through a unique temporary
    file renamed into place: a crashed or concurrent compile never leaves a half package."""
    package.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=package.parent, prefix=f".{package.stem}.", suffix=".tmp.pt2")
    os.close(fd)
    try:
        torch._inductor.aoti_compile_and_package(
            program,
            package_path=tmp,
            inductor_configs=dict(INDUCTOR_CONFIGS),  # a copy: inductor adds its own keys
        )
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp made it private; a cache may be shared
        os.replace(tmp, package)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def layer_package(
    model: MLAForCausalLM,
    kind: LayerKind,
    block_size: int,
    cache_dir: Path | None = None,
    *,
    allow_unlowered: bool = False,
) -> LayerPackage:
    """The package of layer kind ``kind`` from the cache, compiled first if missing."""
    found = _layer_package(model, kind, block_size, cache_dir, allow_unlowered, wait=True)
    assert found is not None  # waited for the lock
    return found


def _layer_package(
    model: MLAForCausalLM,
    kind: LayerKind,
    block_size: int,
    cache_dir: Path | None,
    allow_unlowered: bool,
    *,
    wait: bool,
) -> LayerPackage | None:
    """``layer_package``; with ``wait=False``, None while another process holds its lock."""
    package = package_path(model, kind, block_size, cache_dir)
    with package_lock(package, wait=wait) as held:
        if not held:
            return None
        if package.exists():
            return LayerPackage(kind, package, None)
        start = time.perf_counter()
        log.warning(
            "compiling layer kind %s of %s (layers %s, block size %d) into %s",
            kind.name,
            model.config.model_type,
            _ranges(kind.layers),
            block_size,
            package,
        )
        lowered = lower_layer(model, kind, block_size, allow_unlowered=allow_unlowered)
        if lowered.lowering.verify_error is not None:  # unlowered on request: never cached
            fd, stand_in = tempfile.mkstemp(dir=package.parent, suffix=".unlowered.pt2")
            os.close(fd)
            build_aoti_package(lowered.program, Path(stand_in))
            return LayerPackage(kind, Path(stand_in), lowered.lowering, unlowered=True)
        build_aoti_package(lowered.program, package)
        log.warning("  compiled in %.1f s", time.perf_counter() - start)
        return LayerPackage(kind, package, lowered.lowering)


def _ranges(layers: tuple[int, ...]) -> str:
    return f"{layers[0]}..{layers[-1]}" if len(layers) > 2 else ", ".join(map(str, layers))


def load_aoti_package(package: Path, constants: dict[str, torch.Tensor]) -> PackageRunner:
    """Load an AOTInductor package and hand it its weights (``load_constants``, shared with
    the caller: ``user_managed=True``). Every constant the package names must be given or
    derivable (``passes/derived_constants.py``)."""
    runner = PackageRunner(package)
    wanted = runner.get_constant_fqns()
    constants = with_derived_constants(constants, wanted)
    missing = sorted(set(wanted) - set(constants))
    if missing:
        raise RuntimeError(f"compiled step {package.name} expects unknown constants {missing[:5]}")
    runner.load_constants(
        {k: constants[k] for k in wanted}, check_full_update=True, user_managed=True
    )
    return runner


# The step's ends, run on the host: their weights by the whole model's names.
EMBEDDING, FINAL_NORM, LM_HEAD, ROPE = (
    "model.embed_tokens.weight",
    "model.norm.weight",
    "lm_head.weight",
    "rope_inv_freq",
)
LM_HEAD_QUANTIZED = "lm_head.qweight"


def layer_constants(constants: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """Layer ``layer``'s weights by the names its package uses (``LayerStep``'s)."""
    prefix = f"model.layers.{layer}."
    return {
        LAYER_PREFIX + name[len(prefix) :]: t
        for name, t in constants.items()
        if name.startswith(prefix)
    }


class CompiledStep:
    """Callable like the model: ``step(input_ids, positions, caches, meta, logits_indices)``.
    Its kernels read the per-sequence fields of ``meta``, not the key rows (``StepFn``),
    unless a layer runs unlowered.

    ``constants``: the model's weights and buffers by their FQNs (``model_constants``).
    ``release(name)``, if given, is called for every weight no loaded package and no end of
    the step reads (a source a derived constant replaced), once its layer is loaded: the
    caller drops its own reference and the name leaves ``constants``, so that a source's
    memory goes before the next layer derives its layouts and only one copy of each weight
    stays.
    """

    def __init__(
        self,
        config: ModelConfig,
        constants: dict[str, torch.Tensor],
        packages: list[LayerPackage],
        *,
        release: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self.packages = packages
        self.compile_seconds = 0.0  # set by compile_step
        kinds = kind_of_layers([p.kind for p in packages], config.num_hidden_layers)
        self.layers: list[PackageRunner] = []
        for layer, kind in enumerate(kinds):
            own = layer_constants(constants, layer)
            runner = load_aoti_package(packages[kind].package, own)
            self.layers.append(runner)
            if release is not None:
                kept = set(runner.get_constant_fqns())
                prefix = f"model.layers.{layer}."
                for name in sorted(own.keys() - kept):
                    released = prefix + name[len(LAYER_PREFIX) :]
                    release(released)
                    constants.pop(released)  # the last reference: its memory goes now
            del own
        for package in packages:
            if package.unlowered:
                package.package.unlink(missing_ok=True)
        # an unlowered layer runs the reference attention, which reads the key rows
        self.reads_key_rows = any(p.unlowered for p in packages)
        self.embedding = constants[EMBEDDING]
        self.final_norm = constants[FINAL_NORM]
        self.vocab_size = config.vocab_size
        # lm_head quantized (models/quantized.py): its packed weight as it is; else the packed
        # layout derived from the weight (which is the embedding itself when tied)
        self.lm_head_qweight = constants.get(LM_HEAD_QUANTIZED)
        if self.lm_head_qweight is None:
            lm_head = constants[LM_HEAD]  # [V, D]
            self.lm_head_packed = with_derived_constants(constants, [packed_name(LM_HEAD)])[
                packed_name(LM_HEAD)
            ]
            if release is not None and lm_head is not self.embedding:
                release(LM_HEAD)
                constants.pop(LM_HEAD)
            del lm_head
        inv_freq = constants.get(ROPE)
        self.rope_inv_freq = rope_inv_freq(config) if inv_freq is None else inv_freq
        self.rope_scale = rope_scale(config)

    @property
    def lowerings(self) -> dict[str, LoweringResult]:
        """The pass report of each layer kind compiled by this process (not loaded)."""
        return {p.kind.name: p.lowering for p in self.packages if p.lowering is not None}

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: list[torch.Tensor],
        meta: StepMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        cos, sin = rope_cos_sin(positions, self.rope_inv_freq, self.rope_scale)
        meta_leaves = [getattr(meta, f.name) for f in fields(meta)]
        cfg = self.config
        x = scale_embedding(F.embedding(input_ids, self.embedding), cfg.embedding_scale)
        selected: list[torch.Tensor] = []  # DSA: the last full layer's selection
        for layer, (runner, own) in enumerate(
            zip(self.layers, caches_by_layer(cfg, caches), strict=True)
        ):
            shared = cfg.sparse_attention and not cfg.runs_indexer(layer)
            x, *out = runner.run_flat(
                [x, positions, cos, sin, *own, *meta_leaves, *(selected if shared else [])]
            )
            selected = out or selected
        h = rms_norm(x.index_select(0, logits_indices), self.final_norm, cfg.rms_norm_eps)
        h = scale_logits_input(h, cfg.logits_divisor)
        if self.lm_head_qweight is not None:
            return torch.ops.mlafx.linear_quantized(h, self.lm_head_qweight, self.vocab_size, None)
        return torch.ops.mlafx.linear_packed(h, self.lm_head_packed, self.vocab_size, None)


def compile_step(
    model: MLAForCausalLM,
    block_size: int,
    *,
    cache_dir: Path | None = None,
    allow_unlowered: bool = False,
    release_replaced_weights: bool = False,
) -> CompiledStep:
    """Compile (or load from the cache) one package per layer kind of ``model`` and load it
    for each of its layers. ``release_replaced_weights``: the model gives up the weights the
    compiled step does not read (they become meta tensors: the model no longer runs
    eagerly), for an engine that serves only the compiled step."""
    start = time.perf_counter()
    kinds = layer_kinds(model)
    packages = free_first(
        len(kinds),
        lambda k, wait: _layer_package(
            model, kinds[k], block_size, cache_dir, allow_unlowered, wait=wait
        ),
    )
    step = CompiledStep(
        model.config,
        model_constants(model),
        packages,
        release=(lambda name: release_weight(model, name)) if release_replaced_weights else None,
    )
    step.compile_seconds = time.perf_counter() - start  # compiling (or finding) and loading
    return step


def release_weight(model: torch.nn.Module, name: str) -> None:
    """Replace ``model``'s tensor ``name`` by a meta tensor of its shape (drops the model's
    reference to its memory; running the model eagerly then fails loudly)."""
    owner_path, _, attr = name.rpartition(".")
    owner = model.get_submodule(owner_path) if owner_path else model
    tensor = getattr(owner, attr)
    meta = torch.empty_like(tensor, device="meta")
    if attr in owner._parameters:
        owner._parameters[attr] = torch.nn.Parameter(meta, requires_grad=False)
    else:
        owner._buffers[attr] = meta


def model_constants(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights and buffers by their FQN, as the package names its constants."""
    return {
        **{k: v for k, v in model.named_parameters(remove_duplicate=False)},
        **{k: v for k, v in model.named_buffers(remove_duplicate=False)},
    }
