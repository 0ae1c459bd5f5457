"""Builds the C++ extension ``mlafx._C``; all other metadata lives in pyproject.toml.

Build it against the torch already installed (the ABI must match exactly):
    pip install --no-build-isolation -e .        (or: make build)

ISA dispatch. ``mlafx/kernels/csrc/*_avx512.cpp`` are compiled with AVX-512 (+BF16) flags,
``*_avx2.cpp`` with AVX2 + FMA + F16C, every other source portably (no -march), so the one
library loads on any x86-64 CPU; C++ picks the AVX-512 / AVX2 functions at run time
(``csrc/cpu_features.h``). The flags are chosen per
source by wrapping the compiler's single-source ``_compile`` — which is why ninja is off:
torch's ninja backend writes one set of flags for the whole extension.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

ROOT = Path(__file__).resolve().parent
KERNELS = ROOT / "mlafx" / "kernels"
CSRC = KERNELS / "csrc"
BUILD_INFO = Path("mlafx") / "kernels" / "_build_info.py"

# -O3: cpp_extension adds no optimisation level of its own (only Python's sysconfig CFLAGS,
# which vary by interpreter build). -fopenmp on compile *and* link: at::parallel_for is an
# inline template that expands to `#pragma omp parallel` in our objects; without it the loop
# silently runs on one thread. The link resolves to torch's bundled libgomp.so.1 at load time
# (same soname), so there is one thread pool, sized by torch.set_num_threads.
# -Wno-unknown-pragmas: torch's headers carry clang-only `#pragma unroll`, one warning each.
COMMON_CXX_FLAGS = ["-O3", "-fopenmp", "-Wno-unknown-pragmas"]
LINK_FLAGS = ["-fopenmp"]

# CPU_CAPABILITY names the inline namespace of at::vec::Vectorized (as in ATen's own per-ISA
# kernel builds), so the 16-wide and the portable Vectorized never collide at link time.
PORTABLE_FLAGS = ["-DCPU_CAPABILITY=DEFAULT"]
AVX512_FLAGS = [
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512dq",
    "-mavx512bf16",
    "-mavx512vnni",  # VPDPBUSD (quant_dot_avx512.cpp, behind use_avx512_vnni())
    "-mf16c",
    "-mfma",
    "-DCPU_CAPABILITY_AVX512",
    "-DCPU_CAPABILITY=AVX512",
]
# GCC 12 warns on every AVX-512 shift intrinsic (its `_mm512_undefined_epi32()` operand; GCC
# bug 105593, fixed in 13), which would bury real warnings.
AVX512_WARNING_FLAGS = ["-Wno-maybe-uninitialized"]
AVX512_SUFFIX = "_avx512.cpp"
# The AVX2 tier (namespace mlafx::avx2, behind use_avx2()). -ffp-contract=off: GCC would fuse
# _mm256_mul_ps + _mm256_add_ps into an FMA, and the kernels must round every multiply and add
# separately to stay bit-identical with the portable code (which baseline x86-64 never fuses).
AVX2_FLAGS = [
    "-mavx2",
    "-mfma",
    "-mf16c",
    "-ffp-contract=off",
    "-DCPU_CAPABILITY_AVX2",
    "-DCPU_CAPABILITY=AVX2",
]
AVX2_SUFFIX = "_avx2.cpp"
# `*_amx_avx512.cpp` also get the AMX tile instructions (Sapphire Rapids and later); like the
# AVX-512 sources they are only called after the run-time check (cpu_features.h), which also
# asks Linux for permission to use the tile state.
AMX_FLAGS = ["-mamx-tile", "-mamx-bf16", "-mamx-int8"]
AMX_SUFFIX = "_amx_avx512.cpp"


def _load_source_hash():
    # By path, not `import mlafx...`: the package imports torch and the extension being built.
    spec = importlib.util.spec_from_file_location("_mlafx_source_hash", KERNELS / "source_hash.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _sources() -> list[str]:
    paths = sorted(CSRC.glob("*.cpp"))
    # AVX2 and AVX-512 objects go last on the link line. Inline functions from shared headers
    # (c10, ATen, libstdc++) are emitted in every object that does not inline them, and the
    # linker keeps the first copy; listing the portable objects first means that kept copy is
    # never one compiled with AVX2/AVX-512 enabled, which would crash the portable path on
    # older CPUs.
    paths.sort(key=lambda p: (p.name.endswith(AVX2_SUFFIX), p.name.endswith(AVX512_SUFFIX)))
    return [str(p.relative_to(ROOT)) for p in paths]


class BuildExtensionPerSourceISA(BuildExtension):
    """torch's BuildExtension with per-source ISA flags, writing ``_build_info.py``."""

    def __init__(self, *args, **kwargs):
        kwargs["use_ninja"] = False  # see the module docstring
        super().__init__(*args, **kwargs)

    def build_extensions(self) -> None:
        # BuildExtension wraps whatever `_compile` it finds and calls it with the final flag
        # list, so wrapping first lets us append to that list per source.
        compile_source = self.compiler._compile

        def compile_with_isa_flags(obj, src, ext, cc_args, extra_postargs, pp_opts):
            if src.endswith(AMX_SUFFIX):
                isa_flags = AVX512_FLAGS + AMX_FLAGS + AVX512_WARNING_FLAGS
            elif src.endswith(AVX512_SUFFIX):
                isa_flags = AVX512_FLAGS + AVX512_WARNING_FLAGS
            elif src.endswith(AVX2_SUFFIX):
                isa_flags = AVX2_FLAGS
            else:
                isa_flags = PORTABLE_FLAGS
            compile_source(obj, src, ext, cc_args, list(extra_postargs) + isa_flags, pp_opts)

        self.compiler._compile = compile_with_isa_flags
        super().build_extensions()

    def run(self) -> None:
        # Hash before compiling: the record must describe the sources that were compiled.
        csrc_sha256 = _load_source_hash().csrc_sha256(CSRC)
        super().run()
        text = (
            '"""Written by setup.py when mlafx._C was built; read by the loader. Not in git."""\n'
            f"TORCH_VERSION = {torch.__version__!r}\n"
            f"CSRC_SHA256 = {csrc_sha256!r}\n"
        )
        # Into the source tree (editable installs import from there) and, for wheels, into
        # build_lib (build_py has already copied the package by the time build_ext runs).
        targets = {ROOT / BUILD_INFO}
        if self.build_lib:
            targets.add(Path(self.build_lib).resolve() / BUILD_INFO)
        for target in targets:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(text)


setup(
    ext_modules=[
        CppExtension(
            name="mlafx._C",
            sources=_sources(),
            # Headers: so that sdists carry them (sources are added automatically).
            depends=[str(p.relative_to(ROOT)) for p in sorted(CSRC.glob("*.h"))],
            extra_compile_args={"cxx": COMMON_CXX_FLAGS},
            extra_link_args=LINK_FLAGS,
            # Only the dispatcher is used, never libtorch_python: the same .so is then
            # loadable with torch.ops.load_library in processes that run AOTInductor code.
            py_limited_api=True,
        )
    ],
    cmdclass={"build_ext": BuildExtensionPerSourceISA},
)
