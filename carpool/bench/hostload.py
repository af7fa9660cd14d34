"""Is anything else using this machine's CPUs? Measurements on a shared host are only valid when not.

Other processes' CPU use = (busy time of all CPUs, from /proc/stat) - (this process's CPU time).
`ContentionMonitor` is a driver stop callback that ends a run once others have used more than
`max_cores` for `patience` consecutive checks, so the caller can wait (`wait_for_quiet`) and run
again instead of reporting numbers inflated by someone else's job. Where /proc/stat is missing
(not Linux) both are no-ops.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable


def _busy_seconds() -> float | None:
    """Busy CPU seconds of the whole host since boot (all CPUs), or None if unknown."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    v = [int(x) for x in fields[1:9]] + [0] * (9 - len(fields))
    user, nice, system, _idle, _iowait, irq, softirq, steal = v[:8]
    # steal: the hypervisor ran something else while this VM wanted the CPU -- contention too
    busy = user + nice + system + irq + softirq + steal
    return busy / os.sysconf("SC_CLK_TCK")


class OtherCpu:
    """Cores used by other processes between successive `sample()` calls."""

    def __init__(self):
        self._last = (time.monotonic(), _busy_seconds(), time.process_time())

    @property
    def available(self) -> bool:
        return self._last[1] is not None

    def sample(self) -> float:
        now, busy, mine = time.monotonic(), _busy_seconds(), time.process_time()
        t0, b0, m0 = self._last
        self._last = (now, busy, mine)
        if busy is None or b0 is None or now - t0 <= 0:
            return 0.0
        return max(0.0, ((busy - b0) - (mine - m0)) / (now - t0))


class ContentionMonitor:
    """Stop callback: a reason once other processes used > `max_cores` for `patience` checks in a
    row. Checks closer together than `min_interval` are merged (jiffies are coarse)."""

    def __init__(self, max_cores: float = 0.5, patience: int = 2, min_interval: float = 0.5,
                 cpu: OtherCpu | None = None):
        self.max_cores, self.patience, self.min_interval = max_cores, patience, min_interval
        self.cpu = cpu or OtherCpu()
        self._since = time.monotonic()
        self.strikes = 0
        self.peak = 0.0

    def __call__(self, timelines=None, now: float | None = None) -> str | None:
        if not self.cpu.available or time.monotonic() - self._since < self.min_interval:
            return None
        self._since = time.monotonic()
        others = self.cpu.sample()
        self.peak = max(self.peak, others)
        self.strikes = self.strikes + 1 if others > self.max_cores else 0
        if self.strikes >= self.patience:
            return f"host contended: other processes used {others:.1f} CPU cores"
        return None


def wait_for_quiet(max_cores: float = 0.2, quiet_for: float = 5.0, timeout: float = 900.0,
                   log: Callable[[str], None] | None = None) -> bool:
    """Block until other processes used <= `max_cores` for `quiet_for` seconds in a row.
    False (after `timeout`) if that never happened; True at once where /proc/stat is missing."""
    cpu = OtherCpu()
    if not cpu.available:
        return True
    start = quiet_start = time.monotonic()
    told = False
    while True:
        time.sleep(1.0)
        now = time.monotonic()
        if cpu.sample() > max_cores:
            quiet_start = now
            if log and not told:
                log("  waiting for the host to be quiet (other processes are using the CPUs)...")
                told = True
        elif now - quiet_start >= quiet_for:
            return True
        if now - start > timeout:
            return False


def combine(*checks):
    """One stop callback from several: the first reason wins."""
    checks = [c for c in checks if c is not None]

    def check(timelines, now):
        for c in checks:
            reason = c(timelines, now)
            if reason:
                return reason
        return None

    return check
