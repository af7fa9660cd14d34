"""`carpool bench pipeline`: the bubble accounting on hand-made timings, and a tiny end-to-end run."""

from __future__ import annotations

import json

import pytest
import torch

from carpool.bench.pipeline import bubble_report
from carpool.cli import main


def timings() -> dict:
    """Two stages; micro-batches 0-2 form one busy period, 3 another (after an idle gap)."""
    mbs = [  # (submit, pipeline empty, stage 0 interval, stage 1 interval, requests)
        (0.0, True, (0.0, 1.0), (1.0, 1.5), ["a"]),
        (0.1, False, (1.0, 1.5), (1.5, 2.5), ["b"]),
        (1.5, False, (1.6, 2.0), (2.5, 3.0), ["a"]),
        (10.0, True, (10.0, 10.5), (10.6, 11.0), ["c"]),
    ]
    return {
        "tensor_parallel_size": 1, "pipeline_parallel_size": 2,
        "ranks": [{"rank": 1, "stage": 0, "tp_rank": 0, "timings": [(i, *m[2]) for i, m in enumerate(mbs)]},
                  {"rank": 0, "stage": 1, "tp_rank": 0, "timings": [(i, *m[3]) for i, m in enumerate(mbs)]}],
        "micro_batches": [{"micro_batch": i, "submit_time": m[0], "pipeline_was_empty": m[1],
                           "request_ids": m[4], "num_tokens": 10} for i, m in enumerate(mbs)],
    }


def test_bubble_report_by_hand():
    r = bubble_report(timings())
    assert r["num_micro_batches"] == 4 and r["num_busy_periods"] == 2
    assert r["stage_time_s"] == pytest.approx(3.0 + 1.0)
    for st in r["stages"]:
        assert st["busy_s"] == pytest.approx(2.4) and st["idle_s"] == pytest.approx(1.6)
    assert r["bubble_fraction"] == pytest.approx(3.2 / 8.0)
    # a: stage-1 fill before mb 0 (1.0 s) + stage 0 waiting for mb 2's plan (0.1 s); b: none;
    # c: stage-1 fill of the second busy period (0.6 s). The 6.5 s without load count nowhere.
    assert r["per_request_bubble_ms"]["p50"] == pytest.approx(600)
    assert r["per_request_bubble_ms"]["max"] == pytest.approx(1100)
    assert [b for m in r["per_micro_batch"] for b in m["bubble_ms"]] == pytest.approx(
        [0, 1000, 0, 0, 100, 0, 0, 600])
    first = bubble_report(timings(), until=1.5)  # micro-batches 0-2 only
    assert first["num_micro_batches"] == 3 and first["stage_time_s"] == pytest.approx(3.0)
    assert first["bubble_fraction"] == pytest.approx((3.0 - 1.9 + 3.0 - 2.0) / 6.0)


@pytest.mark.slow
def test_bench_pipeline_end_to_end(tmp_path, tiny_llama):
    threads = torch.get_num_threads()
    try:
        rc = main(["bench", "pipeline", "--model", tiny_llama, "--dtype", "float32", "-pp", "2",
                   "--num-threads", "1", "--schedulers", "sarathi,vllm", "--num-requests", "6",
                   "--qps", "50", "--prompt-range", "8,64", "--output-range", "2,6",
                   "--max-num-batched-tokens", "32", "--kv-cache-memory", "16MiB", "--max-other-cpu", "-1",
                   "--output", str(tmp_path)])
    finally:
        torch.set_num_threads(threads)
    assert rc == 0
    for name in ("sarathi", "vllm"):
        result = json.loads((tmp_path / f"pp2_tp1_t1_{name}.json").read_text())
        s, p = result["summary"], result["pipeline"]
        assert s["num_completed"] == 6 and s["output_tokens"] == result["workload"]["output_len"]["mean"] * 6
        assert p["num_micro_batches"] > 0 and 0 <= p["bubble_fraction"] <= 1
        assert [st["stage"] for st in p["stages"]] == [0, 1]
        assert p["per_request_bubble_ms"]["count"] == 6
        assert result["other_cpu_cores"] is not None and result["pipeline_while_arriving"]["num_micro_batches"] > 0
    assert "| sarathi | 2 |" in (tmp_path / "pp2_tp1_t1_table.md").read_text()
