"""Which CPU instruction sets an AOTInductor package needs, and whether this CPU has them.

Inductor compiles the step's C++ with the flags of the vector ISA it picked (``-mavx512f
...``) and, by default, ``-march=native``: the shared library may use any instruction of
the machine that compiled it. The required set is therefore every ISA extension flag of
the compiling CPU when ``-march=native`` was used, else the ``-m`` flags. Flags use the
names of ``/proc/cpuinfo``.
"""

from __future__ import annotations

import json
import logging
import re
import zipfile
from pathlib import Path

log = logging.getLogger(__name__)

# /proc/cpuinfo flags that name instruction-set extensions (not bugs or power features)
_ISA_FLAG = re.compile(
    r"^(sse\w*|ssse3|avx\w*|fma\w*|f16c|bmi\d|amx\w*|adx|popcnt|movbe|sha_ni|vaes|"
    r"vpclmulqdq|gfni|lzcnt|abm|asimd\w*|sve\w*)$"
)
# gcc -m<name> -> /proc/cpuinfo name, where they differ beyond '-' -> '_'
_GCC_TO_CPUINFO = {
    "avx512vnni": "avx512_vnni",
    "avx512bf16": "avx512_bf16",
    "avx512fp16": "avx512_fp16",
    "avx512vbmi2": "avx512_vbmi2",
    "avx512bitalg": "avx512_bitalg",
    "avx512vpopcntdq": "avx512_vpopcntdq",
    "avxvnni": "avx_vnni",
    "sse4.1": "sse4_1",
    "sse4.2": "sse4_2",
    "bmi": "bmi1",
}


def host_cpu_flags() -> set[str] | None:
    """This CPU's flags from ``/proc/cpuinfo`` (None where there is no such file)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return None


def isa_flags(flags: set[str]) -> set[str]:
    return {f for f in flags if _ISA_FLAG.match(f)}


def _compile_flags(package: Path) -> tuple[str, list[str]]:
    """The package's ``AOTI_CPU_ISA`` and the gcc flags of its kernel compile command."""
    isa, flags = "", list[str]()
    with zipfile.ZipFile(package) as archive:
        for name in archive.namelist():
            if name.endswith("wrapper_metadata.json"):
                isa = json.loads(archive.read(name)).get("AOTI_CPU_ISA", "")
            elif name.endswith(".cpp") and not flags:
                for line in archive.read(name).decode(errors="replace").splitlines():
                    if line.startswith("// g++ "):
                        flags = [f for f in line.split() if f.startswith(("-m", "-march"))]
                        break
    return isa, flags


def aoti_cpu_requirements(package: Path) -> dict[str, object]:
    """The manifest's ``cpu`` entry for an AOTInductor package compiled on this machine."""
    isa, flags = _compile_flags(package)
    required = {
        _GCC_TO_CPUINFO.get(f[2:], f[2:].replace("-", "_"))
        for f in flags
        if f.startswith("-m") and not f.startswith("-march")
    }
    if "-march=native" in flags:
        host = host_cpu_flags()
        if host is None:
            raise RuntimeError("compiled with -march=native but this CPU's flags are unknown")
        required |= isa_flags(host)
    return {"aoti_cpu_isa": isa, "compile_flags": flags, "required_flags": sorted(required)}


def missing_cpu_flags(required: list[str]) -> list[str] | None:
    """The required flags this CPU lacks (None when this CPU's flags cannot be read)."""
    host = host_cpu_flags()
    if host is None:
        log.warning("cannot read this CPU's flags; relying on the package loader's own check")
        return None
    return sorted(set(required) - host)
