"""The shared-host guard: other processes' CPU use, and when a run counts as contended."""

from __future__ import annotations

import os
import time

from carpool.bench.hostload import ContentionMonitor, OtherCpu, combine


class FakeCpu:
    available = True

    def __init__(self, values):
        self.values = list(values)

    def sample(self):
        return self.values.pop(0)


def test_other_cpu_is_a_core_count():
    cpu = OtherCpu()
    end = time.monotonic() + 0.3
    while time.monotonic() < end:  # busy here: not counted as others' (whatever else the host runs)
        pass
    assert 0.0 <= cpu.sample() <= (os.cpu_count() or 1) + 0.5


def test_monitor_needs_consecutive_strikes():
    mon = ContentionMonitor(max_cores=0.5, patience=2, min_interval=0.0, cpu=FakeCpu([0.9, 0.1, 0.9, 0.0, 1.2, 1.5]))
    results = [mon([], 0.0) for _ in range(6)]
    assert results[:5] == [None] * 5 and "1.5 CPU cores" in results[5] and mon.peak == 1.5


def test_combine_first_reason_wins():
    check = combine(None, lambda t, n: None, lambda t, n: "slo", lambda t, n: "host")
    assert check([], 0.0) == "slo" and combine()([], 0.0) is None
