"""`carpool bench spec`: one tiny run end to end (JSON and plot), its prompts, and the projection."""

from __future__ import annotations

import json

import pytest

from carpool.bench.spec import EDITS, editing_requests, projection, random_prompts, tokens_per_step
from carpool.cli import main
from carpool.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def result(tmp_path_factory, model_path):
    out = tmp_path_factory.mktemp("spec")
    rc = main(["bench", "spec", "--model", model_path, "--output", str(out), "--num-functions", "1",
               "--max-tokens", "24", "--repeats", "1", "--num-random", "1", "--random-tokens", "8",
               "--burst-size", "2", "--kv-cache-memory", "256MiB"])
    assert rc == 0
    return out, json.loads((out / "spec.json").read_text())


@pytest.mark.slow  # three engines from the embedded model, every workload: ~20 s
def test_writes_json_and_plot(result):
    out, r = result
    assert (out / "spec.png").stat().st_size > 10_000
    w = r["workloads"]
    assert set(w) == {"editing", "random", "burst", "draft"}
    assert r["speculative_config"]["method"] == "ngram" and r["repeats"] == 1
    assert w["random"]["repetition_penalty"] == 1.3 and w["random"]["on"]["output_tokens"] == 8
    for name in ("editing", "random", "burst"):
        assert {"off", "on", "ratio", "same_outputs", "target", "met"} <= set(w[name])
        assert w[name]["off"]["draft_tokens"] == 0 and w[name]["off"]["accepted_tokens"] == 0
        assert w[name]["ratio"] > 0 and 0 <= w[name]["same_outputs"] <= 1
    single = w["editing"]["on"]
    assert single["requests"] == 1 and single["output_tokens"] <= 24 and single["decode_tokens_per_s"] > 0
    assert single["ttft_s"]["count"] == 1
    # the answer starts by copying the function, which prompt lookup guesses
    assert single["accepted_tokens"] > 0 and single["tokens_per_step"] > 1
    assert 0 < single["accepted_fraction_of_output"] < 1
    burst = w["burst"]
    assert burst["on"]["requests"] == 2 and burst["off"]["largest_gap_s"] > 0
    assert 0 <= burst["off_same_as_alone"] <= 1 and "off_same_as_alone" not in w["editing"]
    assert burst["met"] == (burst["ratio"] >= 1.3 and burst["on"]["largest_gap_s"] <= burst["off"]["largest_gap_s"])
    d = w["draft"]
    assert len(d["verify_step_s"]) == 9 and d["verify_cost_ratio"][0] == 1.0
    assert [p["k"] for p in d["projection"]] == list(range(1, 9))
    assert d["self_draft"]["on"]["draft_tokens"] > 0 and d["draft_cost_ratio"] == 0.1
    assert d["ngram_acceptance"] == single["acceptance_rate"] and len(d["projection_at_ngram_acceptance"]) == 8


@pytest.mark.slow  # two engines, 16 short answers: ~15 s
def test_repeated_questions_draft_from_earlier_answers_with_suffix(tmp_path, model_path):
    rc = main(["bench", "spec", "--model", model_path, "--output", str(tmp_path), "--workloads", "repeat",
               "--method", "suffix", "--max-tokens", "24", "--repeats", "1", "--kv-cache-memory", "256MiB"])
    assert rc == 0
    r = json.loads((tmp_path / "spec.json").read_text())
    assert r["speculative_config"]["method"] == "suffix" and set(r["workloads"]) == {"repeat"}
    on = r["workloads"]["repeat"]["on"]
    assert on["requests"] == 8 and on["output_tokens"] <= 8 * 24
    # the second time each question comes, its answer is in the tree: most of it is drafted
    assert on["accepted_tokens"] >= 4 * 12 and on["tokens_per_step"] > 1


def test_editing_prompts_hold_their_function(model_path):
    tokenizer = load_tokenizer(model_path)
    requests = editing_requests(tokenizer, len(EDITS) + 1)
    assert len({len(p) for p, _ in requests[:len(EDITS)]}) == len(EDITS)  # all different
    for i, (prompt, params) in enumerate(requests):
        edit = EDITS[i % len(EDITS)]
        text = tokenizer.decode(prompt)
        assert edit.code in text and edit.change in text
        assert params.max_tokens == len(tokenizer.encode(edit.code, add_special_tokens=False)) + 32
        assert params.temperature == 0
    assert all(15 <= len(e.code.splitlines()) <= 40 for e in EDITS)
    assert [p.max_tokens for _, p in editing_requests(tokenizer, 2, cap=50)] == [50, 50]


def test_random_prompts_come_from_the_seed():
    a = random_prompts(49152, 3, 256, seed=7)
    assert a == random_prompts(49152, 3, 256, seed=7)
    assert a != random_prompts(49152, 3, 256, seed=8)
    for p in a:
        assert len(p) == len(set(p)) == 256 and all(1000 <= t < 49152 for t in p)


def test_projection_formula():
    assert tokens_per_step(0.0, 5) == 1.0 and tokens_per_step(1.0, 5) == 6.0
    assert tokens_per_step(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    # free verification and drafts: the speedup is the tokens per step
    rows = projection([1.0, 1.0, 1.0], acceptance=1.0, draft_cost_ratio=0.0)
    assert [r["speedup"] for r in rows] == [2.0, 3.0]
    # k = 2 at acceptance 0.5: 1.75 tokens for 2 * 0.1 of drafting plus a verification at 1.5x
    rows = projection([2.0, 2.5, 3.0], acceptance=0.5, draft_cost_ratio=0.1)
    assert rows[1]["verify_cost_ratio"] == 1.5 and rows[1]["speedup"] == pytest.approx(1.75 / 1.7)


def test_unknown_workload_fails_before_loading_the_model(capsys):
    assert main(["bench", "spec", "--workloads", "editing,typo"]) == 2
    assert "typo" in capsys.readouterr().err
