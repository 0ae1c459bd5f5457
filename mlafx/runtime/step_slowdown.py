"""Engine steps that run far slower than the engine's own recent steps of the same size.

On a busy machine (a second service, a build in another terminal) the engine's threads
share their cores, and its steps take longer though nothing about the work changed. The
monitor keeps each step size's recent times (steps are grouped by powers of two of their
tokens and sequences, so a long prefill is never compared with a decode step), counts a step
as slow when it takes ``factor`` times that group's median, and logs at most one warning per
``log_every_s`` with what to do. ``LLM.get_metrics()`` and ``/metrics`` carry the counts.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable

log = logging.getLogger(__name__)


def step_size_group(num_tokens: int, num_seqs: int) -> tuple[int, int]:
    """Steps whose tokens and sequences lie within the same powers of two."""
    return (max(num_tokens, 0).bit_length(), max(num_seqs, 0).bit_length())


class StepSlowdownMonitor:
    def __init__(
        self,
        *,
        threads: Callable[[], int],
        window: int = 128,
        min_samples: int = 16,
        factor: float = 2.0,
        log_every_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``threads``: the engine's thread count when a warning is written (for its hint)."""
        self.threads = threads
        self.window = window
        self.min_samples = min_samples
        self.factor = factor
        self.log_every_s = log_every_s
        self.clock = clock
        self.times: dict[tuple[int, int], deque[float]] = {}
        self.num_slow_steps = 0
        self.last_ratio = 0.0  # the latest step's time / its group's median (0: too few yet)
        self._last_log: float | None = None
        self._slow_since_log = 0

    def record(self, num_tokens: int, num_seqs: int, seconds: float) -> bool:
        """Add one step; True when it was slow."""
        times = self.times.setdefault(step_size_group(num_tokens, num_seqs), deque())
        slow = False
        if len(times) >= self.min_samples:
            median = statistics.median(times)
            self.last_ratio = seconds / median if median > 0 else 0.0
            slow = self.last_ratio >= self.factor
        else:
            self.last_ratio = 0.0
        times.append(seconds)
        if len(times) > self.window:
            times.popleft()
        if slow:
            self.num_slow_steps += 1
            self._slow_since_log += 1
            self._maybe_log()
        return slow

    def _maybe_log(self) -> None:
        now = self.clock()
        if self._last_log is not None and now - self._last_log < self.log_every_s:
            return
        threads = self.threads()
        hint = (
            f"; if the machine stays busy, --threads {threads - 1} leaves a core to the other work"
            if threads > 1
            else ""
        )
        log.warning(
            "engine steps run %.1fx slower than their recent median (%d slow step(s) since "
            "the last report): another process is probably using the cores this engine's %d "
            "thread(s) run on; outputs are unaffected%s",
            self.last_ratio,
            self._slow_since_log,
            threads,
            hint,
        )
        self._last_log = now
        self._slow_since_log = 0
