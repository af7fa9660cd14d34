"""Serving metrics from plain timelines: the one code path for benchmarks and simulators.

Input is what any producer can record: per request its arrival, first-scheduled time (if known),
the time of every output token and its preemptions; per iteration its start, duration and token
mix. Nothing here knows how they were produced (engine in process, HTTP client, simulator).

Definitions (times in seconds):
  scheduling delay = first_scheduled - arrival (None when the producer cannot see it, e.g. HTTP)
  TTFT             = first token - arrival
  TBT              = gaps between consecutive tokens of a request (n tokens -> n-1 TBTs)
  end-to-end       = last token (or finished time) - arrival
  stall            = a TBT above `stall_threshold`; default 5x the reference decode iteration
                     time: the one given, else the median decode-only iteration, else the median TBT
Percentiles interpolate linearly between order statistics (numpy's default). Throughput counts
output tokens (and completed requests) over the span from the first arrival to the last token.
"""

from __future__ import annotations

import csv
import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np

DEFAULT_STALL_FACTOR = 5.0


@dataclass
class RequestTimeline:
    """What happened to one request. Times share one clock (any origin)."""

    request_id: str
    arrival_time: float
    token_times: list[float]
    num_prompt_tokens: int = 0
    first_scheduled_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_expected_tokens: int | None = None  # the output length asked for, if fixed
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (0 where not visible)

    @property
    def completed(self) -> bool:
        if self.error is not None or not self.token_times:
            return False
        return self.num_expected_tokens is None or len(self.token_times) >= self.num_expected_tokens

    def shifted(self, origin: float) -> RequestTimeline:
        """The same timeline with `origin` subtracted from every time (for reports)."""
        sub = lambda t: None if t is None else t - origin
        return RequestTimeline(self.request_id, self.arrival_time - origin, [t - origin for t in self.token_times],
                               self.num_prompt_tokens, sub(self.first_scheduled_time), sub(self.finished_time),
                               self.num_preemptions, self.num_expected_tokens, self.error, self.num_cached_tokens)


@dataclass
class IterationRecord:
    """One engine iteration: when it ran and what it carried."""

    start_time: float
    duration: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_requests: int = 0
    num_preempted: int = 0
    predicted_duration: float | None = None  # an SLO-following policy's prediction when it planned it
    slo_unreachable: bool = False  # its decodes alone were predicted over the policy's target


def tbts(timeline: RequestTimeline) -> list[float]:
    t = timeline.token_times
    return [b - a for a, b in zip(t, t[1:])]


@dataclass
class Distribution:
    """Summary of a sample; every field is None when the sample is empty."""

    count: int = 0
    mean: float | None = None
    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    max: float | None = None

    @classmethod
    def of(cls, values) -> Distribution:
        a = np.asarray([v for v in values if v is not None], dtype=float)
        if a.size == 0:
            return cls()
        p50, p90, p99 = np.percentile(a, [50, 90, 99])
        return cls(int(a.size), float(a.mean()), float(p50), float(p90), float(p99), float(a.max()))


@dataclass
class RequestMetrics:
    """Per-request numbers derived from a timeline (times relative to the run's origin)."""

    request_id: str
    arrival_time: float
    num_prompt_tokens: int
    num_output_tokens: int
    scheduling_delay: float | None
    ttft: float | None
    e2e_latency: float | None
    tbt_p50: float | None
    tbt_max: float | None
    num_stalls: int
    stall_time: float
    num_preemptions: int
    completed: bool
    error: str | None = None
    num_cached_tokens: int = 0


@dataclass
class Summary:
    num_requests: int
    num_completed: int
    num_errors: int
    duration: float  # first arrival -> last token
    prompt_tokens: int
    output_tokens: int
    cached_prompt_tokens: int  # of prompt_tokens, those whose KV came from the prefix cache
    output_tokens_per_s: float
    requests_per_s: float
    scheduling_delay: Distribution
    ttft: Distribution
    tbt: Distribution
    e2e_latency: Distribution
    stall_threshold: float | None
    stall_threshold_source: str
    num_stalls: int
    stall_time: float
    num_preemptions: int
    iterations: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def decode_iteration_median(iterations: list[IterationRecord]) -> float | None:
    """Median time of iterations that carried decodes and no prompt tokens."""
    d = [it.duration for it in iterations if it.num_prefill_tokens == 0 and it.num_decode_tokens > 0]
    return float(np.median(d)) if d else None


def resolve_stall_threshold(timelines: list[RequestTimeline], iterations: list[IterationRecord],
                            stall_threshold: float | None = None, decode_time: float | None = None,
                            factor: float = DEFAULT_STALL_FACTOR) -> tuple[float | None, str]:
    if stall_threshold is not None:
        return stall_threshold, "given"
    if decode_time is not None:
        return factor * decode_time, f"{factor:g}x reference decode iteration"
    med = decode_iteration_median(iterations)
    if med is not None:
        return factor * med, f"{factor:g}x median decode-only iteration"
    all_tbts = [g for t in timelines for g in tbts(t)]
    if all_tbts:
        return factor * float(np.median(all_tbts)), f"{factor:g}x median TBT"
    return None, "none (no TBTs)"


def request_metrics(t: RequestTimeline, origin: float, stall_threshold: float | None) -> RequestMetrics:
    gaps = tbts(t)
    stalls = [g for g in gaps if stall_threshold is not None and g > stall_threshold]
    last = t.token_times[-1] if t.token_times else t.finished_time
    return RequestMetrics(
        request_id=t.request_id,
        arrival_time=t.arrival_time - origin,
        num_prompt_tokens=t.num_prompt_tokens,
        num_output_tokens=len(t.token_times),
        scheduling_delay=None if t.first_scheduled_time is None else t.first_scheduled_time - t.arrival_time,
        ttft=t.token_times[0] - t.arrival_time if t.token_times else None,
        e2e_latency=None if last is None or not t.completed else last - t.arrival_time,
        tbt_p50=float(np.median(gaps)) if gaps else None,
        tbt_max=max(gaps) if gaps else None,
        num_stalls=len(stalls),
        stall_time=float(sum(stalls)),
        num_preemptions=t.num_preemptions,
        completed=t.completed,
        error=t.error,
        num_cached_tokens=t.num_cached_tokens,
    )


def iteration_summary(iterations: list[IterationRecord]) -> dict:
    if not iterations:
        return {"count": 0}
    prefill = sum(it.num_prefill_tokens for it in iterations)
    decode = sum(it.num_decode_tokens for it in iterations)
    kinds = {"prefill_only": 0, "decode_only": 0, "hybrid": 0}
    for it in iterations:
        if it.num_prefill_tokens and it.num_decode_tokens:
            kinds["hybrid"] += 1
        elif it.num_prefill_tokens:
            kinds["prefill_only"] += 1
        else:
            kinds["decode_only"] += 1
    return {"count": len(iterations), "prefill_tokens": prefill, "decode_tokens": decode, **kinds,
            "slo_unreachable": sum(bool(it.slo_unreachable) for it in iterations),
            "busy_time": float(sum(it.duration for it in iterations)),
            "duration": asdict(Distribution.of(it.duration for it in iterations)),
            "decode_only_median": decode_iteration_median(iterations)}


def summarize(timelines: list[RequestTimeline], iterations: list[IterationRecord] = (),
              stall_threshold: float | None = None, decode_time: float | None = None,
              stall_factor: float = DEFAULT_STALL_FACTOR) -> tuple[Summary, list[RequestMetrics]]:
    """Aggregate and per-request metrics. `decode_time` (a reference decode iteration time)
    sets the stall threshold to `stall_factor` times it unless `stall_threshold` is given."""
    iterations = list(iterations)
    threshold, source = resolve_stall_threshold(timelines, iterations, stall_threshold, decode_time, stall_factor)
    origin = min((t.arrival_time for t in timelines), default=0.0)
    per_request = [request_metrics(t, origin, threshold) for t in timelines]
    ends = [t.token_times[-1] for t in timelines if t.token_times]
    duration = max(ends) - origin if ends else 0.0
    output_tokens = sum(len(t.token_times) for t in timelines)
    completed = sum(m.completed for m in per_request)
    all_tbts = [g for t in timelines for g in tbts(t)]
    summary = Summary(
        num_requests=len(timelines),
        num_completed=completed,
        num_errors=sum(t.error is not None for t in timelines),
        duration=duration,
        prompt_tokens=sum(t.num_prompt_tokens for t in timelines),
        output_tokens=output_tokens,
        cached_prompt_tokens=sum(t.num_cached_tokens for t in timelines),
        output_tokens_per_s=output_tokens / duration if duration > 0 else 0.0,
        requests_per_s=completed / duration if duration > 0 else 0.0,
        scheduling_delay=Distribution.of(m.scheduling_delay for m in per_request),
        ttft=Distribution.of(m.ttft for m in per_request),
        tbt=Distribution.of(all_tbts),
        e2e_latency=Distribution.of(m.e2e_latency for m in per_request),
        stall_threshold=threshold,
        stall_threshold_source=source,
        num_stalls=sum(m.num_stalls for m in per_request),
        stall_time=float(sum(m.stall_time for m in per_request)),
        num_preemptions=sum(t.num_preemptions for t in timelines),
        iterations=iteration_summary(iterations),
    )
    return summary, per_request


# ---------------------------------------------------------------- files
def _finite(x):
    return None if isinstance(x, float) and not math.isfinite(x) else x


def write_csv(path: Path, rows: list, cls) -> None:
    names = [f.name for f in fields(cls)]
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(names)
        for r in rows:
            w.writerow(["" if getattr(r, n) is None else getattr(r, n) for n in names])


def write_report(out_dir: str | Path, summary: Summary, per_request: list[RequestMetrics],
                 timelines: list[RequestTimeline], iterations: list[IterationRecord], meta: dict | None = None) -> Path:
    """summary.json (aggregate + run metadata), requests.csv, iterations.csv, and timelines.json
    (the raw input, times relative to the first arrival, so metrics and plots can be redone)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    origin = min((t.arrival_time for t in timelines), default=0.0)
    (out / "summary.json").write_text(json.dumps({"meta": meta or {}, "summary": summary.to_dict()},
                                                 indent=2, default=_finite))
    write_csv(out / "requests.csv", per_request, RequestMetrics)
    shifted_its = [IterationRecord(it.start_time - origin, *astuple_rest(it)) for it in iterations]
    write_csv(out / "iterations.csv", shifted_its, IterationRecord)
    (out / "timelines.json").write_text(json.dumps(
        {"timelines": [asdict(t.shifted(origin)) for t in timelines],
         "iterations": [asdict(it) for it in shifted_its]}))
    return out


def astuple_rest(it: IterationRecord) -> tuple:
    return (it.duration, it.num_prefill_tokens, it.num_decode_tokens, it.num_requests, it.num_preempted,
            it.predicted_duration, it.slo_unreachable)


def load_timelines(path: str | Path) -> tuple[list[RequestTimeline], list[IterationRecord]]:
    """Read a timelines.json written by `write_report` (or by any other producer)."""
    try:
        data = json.loads(Path(path).read_text())
        return ([RequestTimeline(**t) for t in data["timelines"]],
                [IterationRecord(**it) for it in data.get("iterations", [])])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: not a timelines file ({e})") from None


def cpu_name() -> str:
    """The CPU a report was measured on (its /proc/cpuinfo model name)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"
