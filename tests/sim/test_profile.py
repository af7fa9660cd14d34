"""`carpool profile` and `carpool fidelity` end to end on a tiny random Llama."""

from __future__ import annotations

import csv
import json
import math

import pytest

from carpool.cli import main
from carpool.core.cost_profile import ProfiledCostModel
from carpool.core.step_cost import BatchShape
from carpool.sim.profile import profile_grid
from tests.model.test_hf_folder import write_checkpoint

TINY = ["--dtype", "float32", "--num-threads", "1", "--kv-cache-memory", "64MiB"]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory, engine_fp32) -> str:
    folder = tmp_path_factory.mktemp("tiny_profiled")
    write_checkpoint(folder, "llama", engine_fp32.tokenizer)  # max_position_embeddings 512
    return str(folder)


def test_grid_is_clipped_to_the_model_length():
    full, short = profile_grid(8192), profile_grid(512)
    assert max(full["prefill_prefix"]) + max(full["prefill_chunk"]) <= 8192
    assert max(short["prefill_prefix"]) + max(short["prefill_chunk"]) <= 512
    assert max(short["decode_context"]) < 512 and max(short["linear"]) <= 512
    quick = profile_grid(8192, quick=True)
    for key, values in quick.items():
        assert set(values) <= set(full[key]) and values[-1] == full[key][-1], key
        assert len(values) < len(full[key]) or len(full[key]) <= 2


def test_profile_then_fidelity(tiny_model, tmp_path):
    profile = tmp_path / "profile.csv"
    assert main(["profile", "--model", tiny_model, *TINY, "--quick", "--repeats", "1",
                 "--output", str(profile)]) == 0
    with profile.open() as f:
        ops = {row["op"] for row in csv.DictReader(f)}
    assert {"linear", "prefill_attn", "decode_attn", "sample", "overhead", "calibration"} <= ops
    assert "decode_step" not in ops  # fp32: no fused decode path to time
    model = ProfiledCostModel.load(profile)
    assert math.isfinite(model.calibration) and model.calibration > 0
    small = model.stage_time(BatchShape(decode_contexts=(100,), num_sampled=1), 0)
    big = model.stage_time(BatchShape(prefills=((256, 0),), decode_contexts=(100,) * 8, num_sampled=9), 0)
    assert 0 < small < big

    out = tmp_path / "fidelity"
    assert main(["fidelity", "--profile", str(profile), "--model", tiny_model, *TINY,
                 "--schedulers", "sarathi,vllm", "--num-requests", "8", "--prompt-range", "16,200",
                 "--output-range", "4,12", "--qps", "4", "--output", str(out)]) == 0
    results = json.loads((out / "fidelity.json").read_text())["results"]
    assert [r["scheduler"] for r in results] == ["sarathi", "vllm"]
    for r in results:
        assert r["iterations"] > 0 and r["simulated_iterations"] > 0
        assert 0 <= r["iteration_error_p50"] <= r["iteration_error_p90"]
        assert set(r["latency"]) == {"ttft_p50", "ttft_p99", "tbt_p50", "tbt_p99"}
        assert all(v["real"] > 0 and v["simulated"] > 0 for v in r["latency"].values())
    assert "| sarathi, profile |" in (out / "fidelity.md").read_text()
