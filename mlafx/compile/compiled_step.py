"""The compiled step: capture -> MLA passes -> AOTInductor package, loaded in process.

The engine's compiled path and the shipped artifact are the same AOTInductor package, so
"identical to the compiled engine" holds by construction. Weights stay outside the shared
library (``aot_inductor.package_constants_in_so=False``) and are handed over with
``load_constants``: the package holds code only, keyed on disk by config, dtype, block
size and versions, so a second engine start loads it instead of recompiling.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch

from mlafx.compile.aoti_runner import PackageRunner
from mlafx.graph.capture import capture_step, sample_step, step_dynamic_shapes
from mlafx.models.deepseek import MLAForCausalLM
from mlafx.models.step import CACHE_LAYOUT_VERSION, StepMetadata
from mlafx.passes.derived_constants import with_derived_constants
from mlafx.passes.pipeline import LoweringResult, lower_step_graph, lowering_source_sha256

log = logging.getLogger(__name__)


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


def package_key(model: MLAForCausalLM, block_size: int) -> str:
    import mlafx
    from mlafx.kernels import _build_info  # the kernels the package will call (gitignored)

    cfg = model.config
    facts = {
        "config": cfg.to_dict(),
        "dtype": str(model.lm_head.weight.dtype),
        "block_size": block_size,
        "torch": torch.__version__,
        "mlafx": mlafx.__version__,
        "kernels": _build_info.CSRC_SHA256,
        "layout": CACHE_LAYOUT_VERSION,
        "lowering": lowering_source_sha256(),  # model, capture and passes sources
        "inductor": dict(INDUCTOR_CONFIGS),
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:20]


@dataclass(frozen=True)
class LoweredStep:
    """The lowered step as an ExportedProgram (dynamic extents), with the pass report and
    the sample arguments it was traced with."""

    program: torch.export.ExportedProgram
    lowering: LoweringResult
    sample_args: tuple


@dataclass
class CompiledStep:
    """Callable like the model: ``step(input_ids, positions, caches, meta, logits_indices)``."""

    reads_key_rows = False  # StepFn: its kernels read the per-sequence fields, not the key rows
    runner: object
    lowering: LoweringResult | None  # None when the package came from the cache
    package: Path
    compile_seconds: float

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: list[torch.Tensor],
        meta: StepMetadata,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        return self.runner(input_ids, positions, caches, meta, logits_indices)


def lower_step(model: MLAForCausalLM, block_size: int) -> LoweredStep:
    """Capture the model's step, run the MLA passes, and re-export the lowered graph with
    the step's dynamic extents (the program every artifact format starts from)."""
    start = time.perf_counter()
    sample, caches = sample_step(model, block_size)
    captured = capture_step(model, block_size)
    lowering = lower_step_graph(captured.module(), sample, caches, time.perf_counter() - start)
    args = (sample.input_ids, sample.positions, caches, sample.meta, sample.logits_indices)
    with torch.fx.experimental._config.patch(backed_size_oblivious=True), torch.no_grad():
        program = torch.export.export(
            lowering.graph,
            args,
            dynamic_shapes=step_dynamic_shapes(model.config.num_hidden_layers),
            strict=False,
        )
    return LoweredStep(program, lowering, args)


def build_aoti_package(program: torch.export.ExportedProgram, package: Path) -> None:
    """AOT-compile ``program`` into ``package`` (code only: the weights stay outside the
    shared library and are handed over at load time by :func:`load_aoti_package`)."""
    package.parent.mkdir(parents=True, exist_ok=True)
    tmp = package.with_suffix(".tmp.pt2")
    torch._inductor.aoti_compile_and_package(
        program,
        package_path=str(tmp),
        inductor_configs=dict(INDUCTOR_CONFIGS),  # a copy: inductor adds its own keys to it
    )
    tmp.replace(package)  # atomic: a crashed compile never leaves a half package


def load_aoti_package(package: Path, constants: dict[str, torch.Tensor]) -> PackageRunner:
    """Load an AOTInductor package and hand it its weights (``load_constants``, shared with
    the caller: ``user_managed=True``). Every constant the package names must be given."""
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


def package_path(model: MLAForCausalLM, block_size: int, cache_dir: Path | None = None) -> Path:
    """Where the model's AOTInductor package lives in the on-disk cache."""
    return (cache_dir or default_cache_dir()) / f"step-{package_key(model, block_size)}.pt2"


def compile_package(model: MLAForCausalLM, block_size: int, package: Path) -> LoweredStep:
    """Lower the model's step and AOT-compile it into ``package`` (logged: ~20 s or more)."""
    start = time.perf_counter()
    log.warning(
        "compiling the step for %s (block size %d) into %s",
        model.config.model_type,
        block_size,
        package,
    )
    lowered = lower_step(model, block_size)
    build_aoti_package(lowered.program, package)
    log.warning("  compiled in %.1f s", time.perf_counter() - start)
    return lowered


def aoti_package(model: MLAForCausalLM, block_size: int, cache_dir: Path | None = None) -> Path:
    """The model's AOTInductor package in the on-disk cache, compiled first if missing."""
    package = package_path(model, block_size, cache_dir)
    if not package.exists():
        compile_package(model, block_size, package)
    return package


def compile_step(
    model: MLAForCausalLM, block_size: int, *, cache_dir: Path | None = None
) -> CompiledStep:
    """Capture, lower and AOT-compile the model's step (or load the cached package)."""
    start = time.perf_counter()
    package = package_path(model, block_size, cache_dir)
    lowering = None
    if not package.exists():
        lowering = compile_package(model, block_size, package).lowering
    runner = load_aoti_package(package, model_constants(model))
    return CompiledStep(runner, lowering, package, time.perf_counter() - start)


def model_constants(model: MLAForCausalLM) -> dict[str, torch.Tensor]:
    """The weights and buffers by their FQN, as the package names its constants."""
    return {
        **{k: v for k, v in model.named_parameters(remove_duplicate=False)},
        **{k: v for k, v in model.named_buffers(remove_duplicate=False)},
    }
