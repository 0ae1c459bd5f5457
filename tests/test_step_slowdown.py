"""The engine notices steps far slower than its recent steps of the same size."""

from __future__ import annotations

import logging

from mlafx.runtime.step_slowdown import StepSlowdownMonitor, step_size_group


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _monitor(clock: Clock, threads: int = 2) -> StepSlowdownMonitor:
    return StepSlowdownMonitor(threads=lambda: threads, min_samples=4, window=8, clock=clock)


def test_slow_steps_are_counted_against_their_own_size(caplog):
    clock = Clock()
    monitor = _monitor(clock)
    for _ in range(4):
        assert not monitor.record(8, 8, 0.030)  # decode steps of 8 sequences
        assert not monitor.record(1024, 1, 0.900)  # prefill chunks
    assert monitor.last_ratio == 0.0  # 3 earlier prefill chunks: too few to judge the 4th
    assert not monitor.record(8, 8, 0.050)  # 1.7x: not far slower
    with caplog.at_level(logging.WARNING, logger="mlafx.runtime.step_slowdown"):
        assert monitor.record(12, 8, 0.090)  # 3x the decode median (12 tokens: same group)
    assert monitor.num_slow_steps == 1 and monitor.last_ratio == 3.0
    (record,) = caplog.records
    assert "3.0x slower" in record.getMessage() and "--threads 1" in record.getMessage()
    # a prefill chunk is compared with prefill chunks: 0.9 s is its normal time
    assert not monitor.record(1000, 1, 0.950)


def test_warnings_are_rate_limited_and_count_what_they_skipped(caplog):
    clock = Clock()
    monitor = _monitor(clock, threads=1)
    for _ in range(4):
        monitor.record(1, 1, 0.010)
    with caplog.at_level(logging.WARNING, logger="mlafx.runtime.step_slowdown"):
        for _ in range(3):
            assert monitor.record(1, 1, 0.040)
            clock.now += 1.0
        clock.now += 30.0
        assert monitor.record(1, 1, 0.100)
    assert [r.getMessage().split("(")[1].split(" ")[0] for r in caplog.records] == ["1", "3"]
    assert "--threads" not in caplog.records[0].getMessage()  # one thread: nothing to give up
    assert monitor.num_slow_steps == 4


def test_too_few_steps_of_a_size_judge_nothing():
    monitor = _monitor(Clock())
    for seconds in (0.01, 1.0, 5.0):
        assert not monitor.record(3, 1, seconds)
        assert monitor.last_ratio == 0.0
    assert step_size_group(3, 1) == step_size_group(2, 1) != step_size_group(4, 1)
