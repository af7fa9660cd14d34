"""Metrics on hand-built timelines: every number is worked out by hand."""

from __future__ import annotations

import csv
import json

import pytest

from carpool.harness.metrics import (Distribution, IterationRecord, RequestTimeline, decode_iteration_median,
                                   load_timelines, summarize, tbts, write_report)


def timeline(rid, arrival, tokens, scheduled=None, **kw):
    return RequestTimeline(rid, arrival, list(tokens), num_prompt_tokens=kw.pop("prompt", 10),
                           first_scheduled_time=scheduled, **kw)


# Request a: arrives at 100, scheduled 100.5, tokens at 101, 101.1, 101.2, 102.2 (a 1 s stall).
# Request b: arrives at 101, scheduled 101, tokens at 101.5, 101.6.
A = timeline("a", 100.0, [101.0, 101.1, 101.2, 102.2], scheduled=100.5, num_preemptions=1)
B = timeline("b", 101.0, [101.5, 101.6], scheduled=101.0)


def test_per_request_numbers():
    summary, per = summarize([A, B], stall_threshold=0.5)
    a, b = per
    assert a.scheduling_delay == pytest.approx(0.5) and b.scheduling_delay == pytest.approx(0.0)
    assert a.ttft == pytest.approx(1.0) and b.ttft == pytest.approx(0.5)
    assert a.e2e_latency == pytest.approx(2.2) and b.e2e_latency == pytest.approx(0.6)
    assert a.tbt_max == pytest.approx(1.0) and a.tbt_p50 == pytest.approx(0.1)
    assert (a.num_stalls, a.stall_time) == (1, pytest.approx(1.0))
    assert (b.num_stalls, b.stall_time) == (0, 0.0)
    assert a.arrival_time == 0.0 and b.arrival_time == 1.0  # relative to the first arrival
    assert a.num_output_tokens == 4 and a.num_preemptions == 1 and a.completed


def test_aggregates():
    summary, _ = summarize([A, B], stall_threshold=0.5)
    assert summary.num_requests == summary.num_completed == 2
    assert summary.output_tokens == 6 and summary.prompt_tokens == 20
    assert summary.duration == pytest.approx(2.2)  # 100 -> 102.2
    assert summary.output_tokens_per_s == pytest.approx(6 / 2.2)
    assert summary.requests_per_s == pytest.approx(2 / 2.2)
    # TBTs: 0.1, 0.1, 1.0 (a) and 0.1 (b)
    assert summary.tbt.count == 4
    assert summary.tbt.p50 == pytest.approx(0.1)
    assert summary.tbt.max == pytest.approx(1.0)
    assert summary.tbt.mean == pytest.approx(1.3 / 4)
    # linear interpolation: p99 of [0.1, 0.1, 0.1, 1.0] at rank 2.97 -> 0.1 + 0.97 * 0.9
    assert summary.tbt.p99 == pytest.approx(0.1 + 0.97 * 0.9)
    assert summary.ttft.p50 == pytest.approx(0.75) and summary.ttft.max == pytest.approx(1.0)
    assert summary.scheduling_delay.p50 == pytest.approx(0.25)
    assert (summary.num_stalls, summary.stall_time) == (1, pytest.approx(1.0))
    assert summary.num_preemptions == 1


def test_distribution_percentiles():
    d = Distribution.of(range(1, 101))  # 1..100
    assert (d.p50, d.p90, d.p99, d.max) == (pytest.approx(50.5), pytest.approx(90.1), pytest.approx(99.01), 100)
    assert Distribution.of([]) == Distribution() and Distribution.of([None]).count == 0


def test_tbts_and_single_token_requests():
    assert tbts(A) == pytest.approx([0.1, 0.1, 1.0])
    one = timeline("c", 0.0, [0.3])
    summary, (m,) = summarize([one])
    assert tbts(one) == [] and m.tbt_p50 is None and m.tbt_max is None
    assert summary.tbt.count == 0 and summary.tbt.p99 is None
    assert m.ttft == pytest.approx(0.3)


def test_stall_threshold_sources():
    its = [IterationRecord(0, 0.02, 0, 2), IterationRecord(0, 0.5, 64, 0), IterationRecord(0, 0.04, 0, 2),
           IterationRecord(0, 0.3, 32, 2)]
    assert decode_iteration_median(its) == pytest.approx(0.03)
    s, _ = summarize([A, B], its)
    assert s.stall_threshold == pytest.approx(0.15) and "decode-only" in s.stall_threshold_source
    assert s.num_stalls == 1  # only the 1 s gap is above 150 ms
    s, _ = summarize([A, B], its, decode_time=0.01)
    assert s.stall_threshold == pytest.approx(0.05) and s.num_stalls == 4  # every gap of 0.1 s too
    s, _ = summarize([A, B], its, stall_threshold=0.05, decode_time=1.0)
    assert s.stall_threshold == 0.05 and s.stall_threshold_source == "given"
    s, _ = summarize([A, B])  # no iterations: 5x median TBT (0.1)
    assert s.stall_threshold == pytest.approx(0.5) and "TBT" in s.stall_threshold_source
    s, _ = summarize([A, B], stall_factor=20)
    assert s.stall_threshold == pytest.approx(2.0) and s.num_stalls == 0


def test_iteration_summary():
    its = [IterationRecord(0, 0.1, 64, 0), IterationRecord(0.1, 0.2, 60, 4), IterationRecord(0.3, 0.05, 0, 4)]
    s, _ = summarize([A], its)
    it = s.iterations
    assert (it["count"], it["prefill_tokens"], it["decode_tokens"]) == (3, 124, 8)
    assert (it["prefill_only"], it["hybrid"], it["decode_only"]) == (1, 1, 1)
    assert it["busy_time"] == pytest.approx(0.35) and it["decode_only_median"] == pytest.approx(0.05)


def test_incomplete_and_failed_requests():
    short = timeline("d", 0.0, [1.0, 2.0], num_expected_tokens=5)
    failed = timeline("e", 0.0, [], error="boom")
    waiting = timeline("f", 0.0, [])  # never scheduled (e.g. a run stopped early)
    s, per = summarize([short, failed, waiting, B])
    assert [m.completed for m in per] == [False, False, False, True]
    assert per[0].e2e_latency is None and per[1].ttft is None and per[2].scheduling_delay is None
    assert s.num_completed == 1 and s.num_errors == 1 and s.ttft.count == 2


def test_origin_does_not_matter():
    shifted = [t.shifted(-1e6) for t in (A, B)]
    s1, p1 = summarize([A, B], stall_threshold=0.5)
    s2, p2 = summarize(shifted, stall_threshold=0.5)
    assert s1.tbt.p99 == pytest.approx(s2.tbt.p99) and s1.ttft.p50 == pytest.approx(s2.ttft.p50)
    assert [m.arrival_time for m in p1] == pytest.approx([m.arrival_time for m in p2])


def test_report_files_round_trip(tmp_path):
    its = [IterationRecord(100.2, 0.1, 64, 0, 1, 0), IterationRecord(100.3, 0.05, 0, 2, 2, 0)]
    s, per = summarize([A, B], its, stall_threshold=0.5)
    out = write_report(tmp_path / "run", s, per, [A, B], its, meta={"label": "x"})
    data = json.loads((out / "summary.json").read_text())
    assert data["meta"]["label"] == "x" and data["summary"]["output_tokens"] == 6
    rows = list(csv.DictReader(open(out / "requests.csv")))
    assert [r["request_id"] for r in rows] == ["a", "b"] and float(rows[0]["ttft"]) == pytest.approx(1.0)
    its_rows = list(csv.DictReader(open(out / "iterations.csv")))
    assert float(its_rows[0]["start_time"]) == pytest.approx(0.2)  # relative to the first arrival
    timelines, iterations = load_timelines(out / "timelines.json")
    s2, _ = summarize(timelines, iterations, stall_threshold=0.5)
    assert s2.tbt == s.tbt and s2.ttft == s.ttft and s2.scheduling_delay == s.scheduling_delay
    assert timelines[0].token_times[0] == pytest.approx(1.0)


def test_bad_timelines_file(tmp_path):
    p = tmp_path / "t.json"
    p.write_text('{"nope": 1}')
    with pytest.raises(ValueError, match="not a timelines file"):
        load_timelines(p)
