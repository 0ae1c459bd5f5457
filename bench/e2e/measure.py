"""Timing and memory probes: medians over repeats, the first call kept apart (for
``torch.compile`` it is the compile), and the process's peak resident memory per phase."""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Timing:
    first_s: float  # the first call (warm-up; a compile happens here)
    median_s: float  # median of the timed repeats after the warm-up calls
    times_s: tuple[float, ...]


def time_calls(run: Callable[[], object], *, repeats: int, warmup: int = 1) -> Timing:
    """Call ``run`` ``warmup + repeats`` times under ``inference_mode``; warmup >= 1."""
    times = []
    with torch.inference_mode():
        for _ in range(max(warmup, 1) + repeats):
            start = time.perf_counter()
            run()
            times.append(time.perf_counter() - start)
    timed = times[max(warmup, 1) :]
    return Timing(times[0], statistics.median(timed), tuple(timed))


_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")
# the peak before the last ``outside_peak_rss`` block (the kernel's counter restarts after it)
_carried_peak = 0


def reset_peak_rss() -> bool:
    """Restart the kernel's peak-RSS counter (Linux); False where that is not possible, and
    the peak is then the process's since it started."""
    global _carried_peak
    _carried_peak = 0
    return _restart_kernel_peak()


def _restart_kernel_peak() -> bool:
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """Peak resident memory since the last ``reset_peak_rss`` (VmHWM), else since start; what
    ``outside_peak_rss`` blocks held is not counted where the counter can be restarted."""
    return max(_carried_peak, _kernel_peak_bytes())


def _kernel_peak_bytes() -> int:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


@contextmanager
def outside_peak_rss() -> Iterator[None]:
    """Memory held only inside the block (a bandwidth probe's 512 MB buffer, freed at its end)
    is not counted in ``peak_rss_bytes``: the peak so far is kept, and the kernel's counter
    restarts when the block ends."""
    global _carried_peak
    _carried_peak = peak_rss_bytes()
    try:
        yield
    finally:
        _restart_kernel_peak()
