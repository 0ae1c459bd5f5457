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

import torch

from mlafx.graph.capture import capture_step, sample_step, step_dynamic_shapes
from mlafx.kernels.gemm_ops import pack_linear_weight
from mlafx.models.deepseek import MLAForCausalLM
from mlafx.models.step import CACHE_LAYOUT_VERSION, StepMetadata
from mlafx.passes.lower_linears import packed_constant_source
from mlafx.passes.pipeline import LoweringResult, lower_step_graph

log = logging.getLogger(__name__)


def default_cache_dir() -> Path:
    """``$MLAFX_CACHE_DIR`` if set (the test suite points it inside the repo), else
    ``~/.cache/mlafx/compiled``."""
    configured = os.environ.get("MLAFX_CACHE_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "mlafx" / "compiled"


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
        "graph_code": _graph_code_digest(),
    }
    return hashlib.sha256(json.dumps(facts, sort_keys=True, default=str).encode()).hexdigest()[:20]


def _graph_code_digest() -> str:
    """SHA-256 of the Python that decides the compiled graph (the model, the capture and the
    passes), so a package compiled by other code is never loaded."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for folder in ("models", "graph", "passes"):
        for source in sorted((root / folder).glob("*.py")):
            digest.update(source.name.encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()


@dataclass
class CompiledStep:
    """Callable like the model: ``step(input_ids, positions, caches, meta, logits_indices)``."""

    runner: object
    lowering: LoweringResult | None
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


def compile_step(
    model: MLAForCausalLM, block_size: int, *, cache_dir: Path | None = None
) -> CompiledStep:
    """Capture, lower and AOT-compile the model's step (or load the cached package)."""
    cache_dir = cache_dir or default_cache_dir()
    package = cache_dir / f"step-{package_key(model, block_size)}.pt2"
    start = time.perf_counter()
    lowering = None
    if not package.exists():
        log.warning(
            "compiling the step for %s (block size %d); cached at %s",
            model.config.model_type,
            block_size,
            package,
        )
        sample, caches = sample_step(model, block_size)
        captured = capture_step(model, block_size)
        lowering = lower_step_graph(captured.module(), sample, caches, time.perf_counter() - start)
        args = (sample.input_ids, sample.positions, caches, sample.meta, sample.logits_indices)
        with torch.fx.experimental._config.patch(backed_size_oblivious=True), torch.no_grad():
            lowered = torch.export.export(
                lowering.graph,
                args,
                dynamic_shapes=step_dynamic_shapes(model.config.num_hidden_layers),
                strict=False,
            )
        package.parent.mkdir(parents=True, exist_ok=True)
        tmp = package.with_suffix(".tmp.pt2")
        torch._inductor.aoti_compile_and_package(
            lowered,
            package_path=str(tmp),
            inductor_configs={"aot_inductor.package_constants_in_so": False},
        )
        tmp.replace(package)  # atomic: a crashed compile never leaves a half package
        log.warning("  compiled in %.1f s", time.perf_counter() - start)
    runner = torch._inductor.aoti_load_package(str(package))
    wanted = runner.get_constant_fqns()
    _derive_packed_weights(model, wanted)
    weights = _constants(model)
    missing = sorted(set(wanted) - set(weights))
    if missing:
        raise RuntimeError(f"compiled step {package.name} expects unknown constants {missing[:5]}")
    runner.load_constants(
        {k: weights[k] for k in wanted}, check_full_update=True, user_managed=True
    )
    return CompiledStep(runner, lowering, package, time.perf_counter() - start)


def _derive_packed_weights(model: MLAForCausalLM, wanted: list[str]) -> None:
    """Make the packed copies the lowered linears read (``<weight>_packed``) as model
    buffers, packed from the checkpoint's weights at load time (never stored)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for name in wanted:
        source = packed_constant_source(name)
        if source is None or source not in params or _has_buffer(model, name):
            continue
        owner_path, _, attr = name.rpartition(".")
        with torch.no_grad():
            packed = pack_linear_weight(params[source].detach())
        model.get_submodule(owner_path).register_buffer(attr, packed, persistent=False)


def _has_buffer(model: torch.nn.Module, name: str) -> bool:
    owner_path, _, attr = name.rpartition(".")
    return attr in dict(model.get_submodule(owner_path).named_buffers(recurse=False))


def _constants(model: MLAForCausalLM) -> dict[str, torch.Tensor]:
    """The weights and buffers by their FQN, as the package names its constants."""
    return {
        **{k: v for k, v in model.named_parameters(remove_duplicate=False)},
        **{k: v for k, v in model.named_buffers(remove_duplicate=False)},
    }
