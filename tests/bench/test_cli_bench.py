"""`carpool bench serving|burst|ablation|budget-sweep` and `carpool capacity` from the command line:
clear errors for bad values (before any model loads) and tiny end-to-end runs."""

from __future__ import annotations

import json

import pytest

from carpool.cli import main

TINY = ["--num-threads", "2", "--dtype", "float32", "--kv-cache-memory", "64MiB", "--no-contention-check", "--no-plots"]


def run(capsys, *argv):
    try:
        rc = main(list(argv))
    except SystemExit as e:  # argparse
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("argv, message", [
    (["bench", "serving", "--qps", "0"], "--qps"),
    (["bench", "serving", "--qps", "1,x"], "--qps"),
    (["bench", "serving", "--prompt-range", "100,10"], "LO <= HI"),
    (["bench", "serving", "--lengths", "gaussian"], "--lengths"),
    (["bench", "serving", "--arrivals", "gamma", "--burstiness", "-2"], "--burstiness"),
    (["bench", "serving", "--schedulers", "sarathi:0"], "token budget"),
    (["bench", "budget-sweep", "--budgets", "128,abc"], "--budgets"),
    (["capacity", "--duration", "0"], "--duration"),
    (["capacity", "--slo", ""], "--slo"),
])
def test_bad_flag_values(capsys, argv, message):
    rc, _, err = run(capsys, *argv)
    assert rc == 2 and message in err


@pytest.mark.parametrize("argv, message", [
    (["bench", "serving", "--lengths", "trace", "--trace", "/nonexistent/trace.csv"], "not found"),
    (["bench", "serving", "--lengths", "trace", "--trace", "arxiv", "--arrivals", "trace"], "no arrived_at"),
    (["bench", "serving", "--schedulers", "magic"], "unknown scheduler"),
    (["capacity", "--slo", "fast"], "bad SLO"),
    (["capacity", "--schedulers", "sarathi,nope"], "unknown scheduler"),
    (["bench", "budget-sweep", "--capacity-slo", "soon"], "bad SLO"),
])
def test_bad_settings_fail_before_loading_the_model(capsys, argv, message, monkeypatch):
    import carpool.engine

    def no_engine(*a, **k):
        raise AssertionError("the model should not load")

    monkeypatch.setattr(carpool.engine, "LLMEngine", no_engine)
    rc, _, err = run(capsys, *argv)
    assert rc == 2 and message in err and "carpool: error" in err


def test_bad_trace_file_from_cli(capsys, tmp_path):
    bad = tmp_path / "t.csv"
    bad.write_text("prompt,output\n1,2\n")
    rc, _, err = run(capsys, "bench", "serving", "--lengths", "trace", "--trace", str(bad))
    assert rc == 2 and "missing column(s) num_prefill_tokens, num_decode_tokens" in err


@pytest.mark.slow  # ~40 s: the CLI end to end (make test-slow)
def test_serving_end_to_end(capsys, tmp_path):
    out = tmp_path / "serving"
    rc, stdout, err = run(capsys, "bench", "serving", "--schedulers", "sarathi:32,vllm", "--qps", "8",
                          "--num-requests", "4", "--lengths", "uniform", "--prompt-range", "16,48",
                          "--output-range", "3,6", "--output", str(out), *TINY[:-1])
    assert rc == 0, err
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [r["label"] for r in rows] == ["sarathi:32", "vllm:512"]
    assert all(r["completed"] == 4 for r in rows)
    for d in ("sarathi_32", "vllm_512"):
        for f in ("summary.json", "requests.csv", "iterations.csv", "timelines.json"):
            assert (out / d / "qps_8" / f).is_file()
    assert (out / "results.csv").is_file() and (out / "tbt_cdf_qps_8.png").is_file()
    assert (out / "timeline_qps_8.png").is_file()
    assert "| sarathi:32 |" in stdout


@pytest.mark.slow
def test_capacity_end_to_end(capsys, tmp_path):
    out = tmp_path / "cap"
    rc, stdout, err = run(capsys, "capacity", "--schedulers", "sarathi", "--slo", "30s", "--lengths", "fixed",
                          "--prompt-len", "16", "--output-len", "3", "--duration", "1", "--min-requests", "3",
                          "--max-evals", "2", "--start-qps", "4", "--output", str(out), *TINY)
    assert rc == 0, err
    data = json.loads((out / "capacity.json").read_text())
    (res,) = data["results"]
    assert res["label"] == "sarathi:512" and res["slo"] == "30s" and len(res["evaluations"]) == 2
    assert res["capacity"] == 8.0 and res["upper"] is None  # 4 and 8 QPS both pass a 30 s SLO
    assert data["meta"]["reference_decode_time"] > 0 and (out / "capacity.csv").is_file()


def test_target_tbt_without_a_scheduler_list_runs_the_slo_policy():
    """`bench serving --target-tbt-ms` in process runs what `carpool serve` would, not a fixed budget."""
    from carpool.bench.serving import default_spec
    from carpool.config import EngineConfig

    assert default_spec(EngineConfig(target_tbt_ms=500.0)).label == "sarathi:dynamic"
    assert default_spec(EngineConfig()).label == "sarathi"
    assert default_spec(EngineConfig(scheduler="vllm")).label == "vllm"
