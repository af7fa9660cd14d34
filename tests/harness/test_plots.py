"""The figures render from hand-built inputs (PNG files with content)."""

from __future__ import annotations

from carpool.harness import plots
from carpool.harness.metrics import RequestTimeline


def runs():
    smooth = [RequestTimeline(str(i), i * 0.5, [i * 0.5 + 0.2 + 0.05 * k for k in range(20)]) for i in range(5)]
    stalled = [RequestTimeline(str(i), i * 0.5, [i * 0.5 + 0.2 + 0.05 * k + (1.0 if k > 10 else 0)
                                                 for k in range(20)]) for i in range(5)]
    return {"sarathi": smooth, "vllm": stalled + [RequestTimeline("w", 0.1, [])]}


def is_png(path):
    return path.is_file() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 5000


def test_figures(tmp_path):
    assert is_png(plots.tbt_cdf(runs(), tmp_path / "cdf.png", slo=0.2))
    assert is_png(plots.token_timeline(runs(), tmp_path / "timeline.png", stall_threshold=0.25, max_requests=4))
    assert is_png(plots.capacity_bars({"strict": {"sarathi": 1.2, "vllm": 0.4}, "relaxed": {"sarathi": 2.0}},
                                      tmp_path / "bars.png"))
    curves = {"sarathi": [{"qps": 0.5, "ttft_p99": 0.3, "tbt_p99": 0.05},
                          {"qps": 1.0, "ttft_p99": 0.9, "tbt_p99": 0.06}],
              "vllm": [{"qps": 0.5, "ttft_p99": 0.2, "tbt_p99": 0.4},
                       {"qps": 1.0, "ttft_p99": None, "tbt_p99": None}]}
    assert is_png(plots.latency_vs_qps(curves, tmp_path / "sub" / "curves.png", tbt_slo=0.1))
