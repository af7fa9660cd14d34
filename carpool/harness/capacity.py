"""Capacity: the highest request rate at which a scheduler still meets its latency SLOs.

As in Sarathi-Serve, a rate passes when P99 TBT <= the TBT SLO and P50 scheduling delay <= a
bound (2 s). The TBT SLO is absolute (seconds) or relative to a reference decode iteration time
measured on the same machine: `strict` = 5x, `relaxed` = 25x.

`search_capacity` is pure logic over an `evaluate(qps) -> Evaluation` callable, so it can be
tested with a fake one: starting from a guess it doubles (or halves) the rate until one passes
and one fails, then bisects until the gap is within the resolution asked for. `SLOMonitor` is a
driver stop callback that ends a run as soon as the SLO is certainly missed, so overloaded rates
cost seconds rather than minutes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from carpool.harness.metrics import RequestTimeline, Summary

SLO_FACTORS = {"strict": 5.0, "relaxed": 25.0}
DEFAULT_SCHEDULING_DELAY = 2.0


@dataclass
class SLO:
    name: str
    tbt_p99: float  # seconds
    scheduling_delay_p50: float = DEFAULT_SCHEDULING_DELAY

    def check(self, summary: Summary) -> tuple[bool, str]:
        """(passed, why). A run in which a request failed or did not finish fails."""
        if summary.num_completed < summary.num_requests:
            return False, f"{summary.num_requests - summary.num_completed} request(s) did not complete"
        tbt, delay = summary.tbt.p99, summary.scheduling_delay.p50
        if tbt is not None and tbt > self.tbt_p99:
            return False, f"P99 TBT {tbt * 1e3:.0f} ms > {self.tbt_p99 * 1e3:.0f} ms"
        if delay is not None and delay > self.scheduling_delay_p50:
            return False, f"P50 scheduling delay {delay:.2f} s > {self.scheduling_delay_p50:.2f} s"
        return True, "ok"


def parse_slo(spec: str, reference: float | None, scheduling_delay: float = DEFAULT_SCHEDULING_DELAY) -> SLO:
    """'strict' | 'relaxed' | '<k>x' (k times the reference) | '<seconds>' | '<n>ms'."""
    s = spec.strip().lower()
    try:
        if s in SLO_FACTORS or s.endswith("x"):
            factor = SLO_FACTORS[s] if s in SLO_FACTORS else float(s[:-1])
            if reference is None:
                raise ValueError(f"SLO {spec!r} is relative but no reference decode time was measured")
            value, name = factor * reference, s
        elif s.endswith("ms"):
            value, name = float(s[:-2]) / 1e3, s
        else:
            value, name = float(s.rstrip("s")), s
    except ValueError as e:
        if "relative" in str(e):
            raise
        raise ValueError(f"bad SLO {spec!r}: use strict, relaxed, <k>x, <seconds> or <n>ms") from None
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"bad SLO {spec!r}: must be positive")
    if not scheduling_delay > 0:
        raise ValueError(f"scheduling delay bound must be positive, got {scheduling_delay}")
    return SLO(name, value, scheduling_delay)


@dataclass
class Evaluation:
    qps: float
    passed: bool
    reason: str
    metrics: dict = field(default_factory=dict)  # e.g. tbt_p99, ttft_p50, scheduling_delay_p50
    seconds: float = 0.0  # wall time the evaluation took


@dataclass
class CapacityResult:
    capacity: float  # highest passing rate found; 0.0 if none passed
    lower: float | None  # highest rate that passed
    upper: float | None  # lowest rate that failed (above `lower`)
    evaluations: list[Evaluation]
    converged: bool  # the bracket is within the resolution asked for

    @property
    def resolution(self) -> float | None:
        """Width of the final bracket in QPS (None when one side was never found)."""
        return None if self.lower is None or self.upper is None else self.upper - self.lower

    @property
    def relative_resolution(self) -> float | None:
        return None if self.resolution is None else self.resolution / self.upper

    def to_dict(self) -> dict:
        return {"capacity": self.capacity, "lower": self.lower, "upper": self.upper,
                "resolution": self.resolution, "relative_resolution": self.relative_resolution,
                "converged": self.converged,
                "evaluations": [e.__dict__ for e in self.evaluations]}


def search_capacity(evaluate: Callable[[float], Evaluation], start_qps: float, *, min_qps: float = 0.01,
                    max_qps: float = 1000.0, rel_tol: float = 0.1, max_evals: int = 10,
                    log: Callable[[str], None] | None = None) -> CapacityResult:
    """Expand from `start_qps` by x2 / x0.5 to bracket the capacity, then bisect (geometric
    midpoints) until (upper - lower) / upper <= rel_tol or `max_evals` evaluations are spent.
    Assumes passing is monotone in the rate; evaluations are recorded either way."""
    if not 0 < min_qps <= start_qps <= max_qps:
        raise ValueError(f"need 0 < min_qps <= start_qps <= max_qps, got {min_qps}, {start_qps}, {max_qps}")
    if not 0 < rel_tol < 1:
        raise ValueError(f"rel_tol must be in (0, 1), got {rel_tol}")
    if max_evals < 1:
        raise ValueError(f"max_evals must be >= 1, got {max_evals}")
    lower: float | None = None
    upper: float | None = None
    evaluations: list[Evaluation] = []
    qps = start_qps
    while len(evaluations) < max_evals:
        ev = evaluate(qps)
        evaluations.append(ev)
        if log:
            log(f"  qps {qps:.3f}: {'pass' if ev.passed else 'FAIL'} ({ev.reason}) [{ev.seconds:.0f} s]")
        if ev.passed:
            lower = qps if lower is None else max(lower, qps)
            if upper is not None and upper <= lower:  # not monotone: forget the stale failure
                upper = None
        else:
            upper = qps if upper is None else min(upper, qps)
            if lower is not None and lower >= upper:
                lower = None
        if lower is None:
            if qps <= min_qps:
                break
            qps = max(qps / 2, min_qps)
        elif upper is None:
            if qps >= max_qps:
                break
            qps = min(qps * 2, max_qps)
        else:
            if (upper - lower) / upper <= rel_tol:
                break
            qps = math.sqrt(lower * upper)
    converged = lower is not None and upper is not None and (upper - lower) / upper <= rel_tol
    return CapacityResult(lower or 0.0, lower, upper, evaluations, converged)


class SLOMonitor:
    """Stop callback for drivers: a reason once the SLO is certainly missed, whatever comes next.

    With `total_tbts` = n TBTs in the whole run (known: output lengths are fixed), the linearly
    interpolated P99 exceeds the SLO once n - floor(0.99 (n - 1)) of them are above it; a request silent
    for longer than the SLO already holds such a gap. P50 scheduling delay exceeds the bound once
    more than half of all `num_requests` waited longer than it (scheduled late, or still waiting).
    A request that failed fails the run. Requests that have not arrived are not passed in."""

    def __init__(self, slo: SLO, num_requests: int, total_tbts: int, check_scheduling: bool = True):
        self.slo = slo
        self.num_requests = num_requests
        self.max_slow_tbts = max(1, total_tbts - math.floor(0.99 * (total_tbts - 1)))
        self.max_late = num_requests - (num_requests - 1) // 2
        self.check_scheduling = check_scheduling

    def __call__(self, timelines: list[RequestTimeline], now: float) -> str | None:
        limit = self.slo.tbt_p99
        slow = late = 0
        for t in timelines:
            if t.error is not None:
                return f"request {t.request_id} failed: {t.error}"
            times = t.token_times
            slow += sum(1 for a, b in zip(times, times[1:]) if b - a > limit)
            unfinished = t.num_expected_tokens is None or len(times) < t.num_expected_tokens
            if times and unfinished and now - times[-1] > limit:
                slow += 1
            if self.check_scheduling:
                started = t.first_scheduled_time
                waited = (started if started is not None else now) - t.arrival_time
                if waited > self.slo.scheduling_delay_p50 and (started is not None or not times):
                    late += 1
        if slow >= self.max_slow_tbts:
            return f"{slow} TBTs above {limit * 1e3:.0f} ms: P99 TBT is over the SLO"
        if late >= self.max_late:
            return f"{late} of {self.num_requests} requests waited over {self.slo.scheduling_delay_p50:g} s"
        return None
