"""The C++ extension as a build artefact: loading, staleness checks, threads, ISA hygiene."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from mlafx.kernels import extension
from mlafx.kernels.extension import ExtensionLoadError, library_path, load_extension
from tests.system_tools import require


def test_stale_sources_fail_loudly_with_hint(monkeypatch):
    info = pytest.importorskip("mlafx.kernels._build_info")
    monkeypatch.setattr(info, "CSRC_SHA256", "0" * 64)
    with pytest.raises(ExtensionLoadError, match=r"stale.*make build.*--no-build-isolation"):
        load_extension()


def test_other_torch_version_fails_loudly_with_hint(monkeypatch):
    info = pytest.importorskip("mlafx.kernels._build_info")
    monkeypatch.setattr(info, "TORCH_VERSION", "0.0.0")
    with pytest.raises(ExtensionLoadError, match=r"built against torch 0\.0\.0.*make build"):
        load_extension()


def test_missing_build_fails_loudly_with_hint(monkeypatch):
    monkeypatch.setattr(extension, "BUILD_INFO_MODULE", "mlafx.kernels._no_such_build_info")
    with pytest.raises(ExtensionLoadError, match="not been built.*make build"):
        load_extension()


def test_the_per_step_mode_switch_does_not_reverify_the_build(monkeypatch):
    # The engine enters batch_invariant_mode every step; hashing csrc/ each time cost 4-5 ms
    # of a 12 ms decode step. Once loaded, the mode ops must not look at the sources again.
    extension.cpu_isa()  # loads (and verifies) once

    def rehash(*_args: object) -> str:
        raise AssertionError("the build was verified again")

    monkeypatch.setattr(extension, "csrc_sha256", rehash)
    with extension.batch_invariant_mode(True):
        assert extension.batch_invariant()
    assert not extension.batch_invariant()


def test_load_library_alone_registers_the_ops():
    # What a process running an AOTInductor artifact does: no mlafx import, only the .so.
    # Fakes are Python-side, so only the C++ schema and CPU kernel are expected here.
    script = (
        "import sys, torch\n"
        "torch.ops.load_library(sys.argv[1])\n"
        "print(torch.ops.mlafx.write_latent_cache.default._schema)\n"
        "print(torch.ops.mlafx.cpu_isa())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script, str(library_path())],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    schema, isa = result.stdout.splitlines()
    assert schema.startswith("mlafx::write_latent_cache(Tensor kv_c, Tensor k_pe, Tensor(a!)")
    assert isa in ("avx512_amx", "avx512_bf16", "avx2", "portable")


def test_parallel_for_uses_torch_threads():
    # Fails when the extension is built or linked without -fopenmp: at::parallel_for then
    # compiles to a serial loop and every kernel silently runs on one core.
    if torch.get_num_threads() < 2:
        pytest.skip("torch runs single-threaded here")
    assert extension.parallel_num_threads() == torch.get_num_threads()


# Mnemonic prefixes of VEX/EVEX (AVX, AVX-512) and AMX tile instructions.
_GUARDED = ("v", "tile", "tdp", "ldtilecfg", "sttilecfg")
# Operands only AVX-512 has: zmm, mask registers, xmm/ymm 16-31.
_AVX512_ONLY = re.compile(r"%zmm|%k[0-7]\b|%[xy]mm(?:1[6-9]|[23][0-9])")


def test_no_avx512_code_outside_avx512_sources():
    """Only code from *_avx512.cpp (namespace mlafx::avx512, ATen's at::vec::AVX512) and
    *_avx2.cpp (namespace mlafx::avx2) may use VEX/EVEX or AMX tile instructions: anything
    else runs, or may run, before the CPU check, and an inline function the linker picked
    from an AVX2/AVX-512 object would crash older CPUs."""
    objdump = require("objdump")
    disassembly = subprocess.run(
        [objdump, "-d", "-C", "--no-show-raw-insn", str(library_path())],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    # Demangled template functions carry their return type first ("void mlafx::avx512::f<8>(...)").
    allowed = re.compile(
        r"^(?:[^\s<>(]+(?:<[^()]*>)?[\s*&]+)?(?:mlafx::avx512::|mlafx::avx2::|at::vec::AVX512::)"
    )
    avx2 = re.compile(r"^(?:[^\s<>(]+(?:<[^()]*>)?[\s*&]+)?mlafx::avx2::")
    offenders: set[str] = set()
    avx512_in_avx2: set[str] = set()
    function = ""
    for line in disassembly.splitlines():
        header = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if header:
            function = header.group(1)
            continue
        fields = line.split("\t")
        if len(fields) >= 2 and fields[1].startswith(_GUARDED) and not allowed.match(function):
            offenders.add(function)
        # The AVX2 tier runs on CPUs without AVX-512: no zmm or mask registers there.
        if len(fields) >= 2 and avx2.match(function) and re.search(_AVX512_ONLY, fields[1]):
            avx512_in_avx2.add(function)
    assert not offenders, f"vector-extension code outside the AVX2/AVX-512 sources: {offenders}"
    assert not avx512_in_avx2, f"AVX-512 code in the AVX2 sources: {avx512_in_avx2}"
