"""Loading the C++ extension ``mlafx._C``, which registers the ``torch.ops.mlafx`` ops.

The ops are defined and implemented in C++ (``TORCH_LIBRARY(mlafx, m)`` in ``csrc/``), so
loading the shared library is all it takes; a process that only runs AOTInductor artifacts
does ``torch.ops.load_library(library_path())`` instead of importing this package.

A missing, mismatched or stale build raises :class:`ExtensionLoadError` with the command that
fixes it. It never falls back to slower code: a silent fallback would make every benchmark
and every comparison with the reference meaningless.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from mlafx.kernels.source_hash import CSRC_DIR, csrc_sha256

EXTENSION_MODULE = "mlafx._C"
BUILD_INFO_MODULE = "mlafx.kernels._build_info"
REBUILD_HINT = "Rebuild it: run `make build` (or `pip install -e . --no-build-isolation`)."


class ExtensionLoadError(ImportError):
    """The C++ extension is missing, built against another torch, or older than its sources."""


def _build_info() -> ModuleType:
    try:
        return importlib.import_module(BUILD_INFO_MODULE)
    except ImportError as error:
        raise ExtensionLoadError(
            f"The mlafx C++ extension has not been built ({BUILD_INFO_MODULE} is missing). "
            + REBUILD_HINT
        ) from error


def verify_build() -> None:
    """Raise :class:`ExtensionLoadError` unless ``mlafx._C`` matches this torch and csrc/."""
    info = _build_info()
    if info.TORCH_VERSION != torch.__version__:
        # Checked before loading: a library built against another torch can fail with an
        # undefined symbol or, worse, load and crash in the dispatcher.
        raise ExtensionLoadError(
            f"The mlafx C++ extension was built against torch {info.TORCH_VERSION}, "
            f"but torch {torch.__version__} is installed. " + REBUILD_HINT
        )
    # Installed wheels ship no csrc/: there is nothing the build could be stale against.
    if CSRC_DIR.is_dir():
        current = csrc_sha256(CSRC_DIR)
        if current != info.CSRC_SHA256:
            message = (
                f"The mlafx C++ extension is stale: {CSRC_DIR} changed since it was built "
                f"(built from sha256 {info.CSRC_SHA256[:12]}, sources now {current[:12]}). "
            )
            # Developers mid-edit on C++ sources may keep running the last good build.
            if os.environ.get("MLAFX_ALLOW_STALE_EXTENSION", "") not in ("", "0"):
                warnings.warn(
                    message + "Using it anyway (MLAFX_ALLOW_STALE_EXTENSION).", stacklevel=2
                )
                return
            raise ExtensionLoadError(message + REBUILD_HINT)


def build_sha256() -> str:
    """The sha256 of the C++ sources the loaded ``mlafx._C`` was built from: whatever is
    measured of the kernels (``mlafx.runtime.attention_costs``) is keyed by it."""
    return str(_build_info().CSRC_SHA256)


def library_path() -> Path:
    """Path of the built ``mlafx._C`` shared library (for ``torch.ops.load_library``)."""
    spec = importlib.util.find_spec(EXTENSION_MODULE)
    if spec is None or spec.origin is None:
        raise ExtensionLoadError(
            f"The mlafx C++ extension ({EXTENSION_MODULE}) is not built. " + REBUILD_HINT
        )
    return Path(spec.origin)


def load_extension() -> ModuleType:
    """Check the build, then load ``mlafx._C`` (idempotent); returns the module."""
    verify_build()
    library_path()  # a clear error if the .so itself is missing
    try:
        return importlib.import_module(EXTENSION_MODULE)
    except ImportError as error:
        raise ExtensionLoadError(
            f"Loading the mlafx C++ extension failed: {error}. " + REBUILD_HINT
        ) from error


_loaded = False


def _ensure_loaded() -> None:
    """``load_extension()`` once per process: the ops below run every engine step, and
    verifying the build hashes every C++ source (~1.4 ms, measured: 3 calls per step added
    4-5 ms to a 12 ms decode step). A library loaded into the process stays what it is, so
    checking it again would tell nothing new."""
    global _loaded
    if not _loaded:
        load_extension()
        _loaded = True


def cpu_isa() -> str:
    """The kernels' code path in this process: ``"avx512_amx"`` (AVX-512 BF16 plus the AMX
    tile unit, which the bf16 attention core uses), ``"avx512_bf16"``, ``"avx2"`` (a CPU
    without AVX-512 BF16: AVX2 attention cores, streaming bf16 products, quantized and FP8
    products; the rest portable or ATen in fp32) or ``"portable"``.

    Fixed when the first op runs; set ``MLAFX_DISABLE_AMX=1`` before that to keep the AVX-512
    path without tiles, ``MLAFX_DISABLE_AVX2=1`` to turn the AVX2 tier off,
    ``MLAFX_AVX2_ONLY=1`` to run the AVX2 tier alone on an AVX-512 CPU,
    ``MLAFX_DISABLE_AVX512=1`` to force the portable path.
    """
    _ensure_loaded()
    return torch.ops.mlafx.cpu_isa()


def parallel_num_threads() -> int:
    """Threads an ``at::parallel_for`` inside the extension runs on (should be
    ``torch.get_num_threads()``; 1 means the build lost OpenMP)."""
    _ensure_loaded()
    return torch.ops.mlafx.parallel_num_threads()


def batch_invariant() -> bool:
    """Whether the kernels run in batch-invariant mode in this process (see
    ``set_batch_invariant``)."""
    _ensure_loaded()
    return torch.ops.mlafx.batch_invariant()


def set_batch_invariant(enabled: bool) -> None:
    """Batch-invariant mode, process-wide (issue 27): each op computes every row of its output
    with arithmetic that does not depend on the call's other rows (attention keys split at
    fixed positions and always merged, every expert group streamed, every linear row
    streamed), so a row's result is bitwise the same in any batch. Slower than the default,
    whose kernel choices follow the batch's shape. The engine runs each step under
    ``batch_invariant_mode``."""
    _ensure_loaded()
    torch.ops.mlafx.set_batch_invariant(bool(enabled))


@contextlib.contextmanager
def batch_invariant_mode(enabled: bool) -> Iterator[None]:
    """``set_batch_invariant(enabled)`` for the block, the previous mode restored after."""
    previous = batch_invariant()
    set_batch_invariant(enabled)
    try:
        yield
    finally:
        set_batch_invariant(previous)
