"""`carpool simulate` end to end: workloads, metrics and capacity through the simulator."""

from __future__ import annotations

import json

import pytest

from carpool.cli import main
from carpool.data import PROFILES_DIR
from carpool.sim.cost_model import FormulaCostModel
from carpool.sim.run import chrome_trace, iterations, timelines
from carpool.sim.simulator import ReplicaConfig, SimRequest, simulate
from tests.core.test_cost_profile import write_profile


def test_adapters_feed_the_metrics_pipeline():
    from carpool.harness.metrics import summarize

    res = simulate([SimRequest(0.0, 10, 3), SimRequest(0.01, 5, 2)], ReplicaConfig(),
                   FormulaCostModel(fixed=0.01, per_token=0.001, num_stages=2))
    tl, its = timelines(res), iterations(res)
    summary, per_request = summarize(tl, its)
    assert summary.num_completed == 2 and summary.output_tokens == 5
    assert per_request[0].ttft == pytest.approx(res.requests[0].token_times[0])
    trace = chrome_trace(res)
    assert len(trace["traceEvents"]) == 2 * len(res.micro_batches)
    assert {e["tid"] for e in trace["traceEvents"]} == {0, 1}


def test_simulate_gpu_cli(tmp_path, capsys):
    out = tmp_path / "sim"
    rc = main(["simulate", "--cost-model", "gpu", "--gpu", "a100", "--model-shape", "llama-2-70b", "--tp", "4",
               "--pp", "2", "--gpus-per-node", "4", "--profiles-dir", str(PROFILES_DIR), "--schedulers", "sarathi,orca",
               "--lengths", "uniform", "--prompt-range", "64,1024", "--output-range", "8,64", "--num-requests", "60",
               "--qps", "2", "--output", str(out)])
    assert rc == 0
    report = json.loads((out / "simulation.json").read_text())
    assert set(report["schedulers"]) == {"sarathi", "orca"}
    for entry in report["schedulers"].values():
        assert entry["summary"]["num_completed"] == 60
        assert 0 <= entry["pipeline"]["bubble_fraction"] < 1
    assert (out / "sarathi" / "trace.json").exists() and (out / "orca" / "requests.csv").exists()
    assert (out / "tbt_cdf.png").exists() and (out / "token_timeline.png").exists()
    assert "attention modelled" in capsys.readouterr().out


def test_simulate_profile_cli_with_capacity(tmp_path):
    prof = tmp_path / "profile.csv"
    write_profile(prof)
    out = tmp_path / "sim"
    rc = main(["simulate", "--profile", str(prof), "--schedulers", "sarathi", "--num-requests", "40",
               "--lengths", "fixed", "--prompt-len", "200", "--output-len", "20", "--capacity", "relaxed",
               "--capacity-tolerance", "0.2", "--output", str(out)])
    assert rc == 0
    cap = json.loads((out / "simulation.json").read_text())["schedulers"]["sarathi"]["capacity"]["relaxed"]
    assert cap["capacity"] > 0 and cap["lower"] is not None
    assert (out / "capacity.png").exists()


def test_simulate_bad_inputs(tmp_path, capsys):
    assert main(["simulate", "--profile", str(tmp_path / "missing.csv"), "--output", str(tmp_path)]) == 2
    assert "carpool profile" in capsys.readouterr().err
    assert main(["simulate", "--cost-model", "gpu", "--model-shape", "gpt-9", "--output", str(tmp_path)]) == 2
    assert "unknown model shape" in capsys.readouterr().err
