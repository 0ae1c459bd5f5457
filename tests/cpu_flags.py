"""What this CPU can run, from /proc/cpuinfo: which ISA paths the kernel tests expect."""

from __future__ import annotations


def cpu_flags() -> set[str]:
    """The flags of the first CPU in /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def has_avx2() -> bool:
    """The CPU has what the kernels' AVX2 tier needs (AVX2, FMA, F16C)."""
    return {"avx2", "fma", "f16c"} <= cpu_flags()
