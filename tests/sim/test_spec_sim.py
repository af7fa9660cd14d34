"""Speculative decoding in the simulator: drawn verification over the real scheduler's grants."""

from __future__ import annotations

import json
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.cli import main
from carpool.sim.cost_model import FormulaCostModel
from carpool.sim.simulator import ReplicaConfig, SimRequest, simulate
from carpool.spec.acceptance import PROBE_EVERY
from tests.core.test_cost_profile import write_profile
from tests.helpers import examples

# t(iteration) = 0.010 + 0.001 * tokens: a draft costs what any other token costs
COST = FormulaCostModel(fixed=0.010, per_token=0.001)


def decode_steps(res) -> list:
    return [mb for mb in res.micro_batches if mb.batch.num_decode_tokens]


def test_all_drafts_kept_divide_the_decode_steps_by_k_plus_one():
    k, out = 4, 101
    res = simulate([SimRequest(0.0, 10, out)], ReplicaConfig(num_speculative_tokens=k, spec_acceptance=1.0), COST)
    off = simulate([SimRequest(0.0, 10, out)], ReplicaConfig(), COST)
    r = res.requests[0]
    assert r.num_output_tokens == out and res.unfinished == 0
    assert len(decode_steps(off)) == out - 1
    # (out - 1) / (k + 1) = 20 steps, plus the first two steps' shorter drafts (a new request's
    # record earns 2, then 4) and a last step that max_tokens leaves short
    assert math.ceil((out - 1) / (k + 1)) <= len(decode_steps(res)) <= math.ceil((out - 1) / (k + 1)) + 2
    assert res.spec.acceptance_rate == 1.0
    assert res.spec.num_accepted_tokens == out - 1 - len(decode_steps(res))
    # each step is priced as scheduled, drafts included, and all its tokens arrive at its end
    for mb in res.micro_batches:
        assert mb.end - mb.start == pytest.approx(0.010 + 0.001 * mb.batch.total_tokens)
    assert len(set(r.token_times)) == len(res.micro_batches)
    assert r.finished_time < off.requests[0].finished_time


def test_no_draft_kept_gives_one_token_per_step_and_drafts_back_off_to_probes():
    out = 201
    res = simulate([SimRequest(0.0, 10, out)], ReplicaConfig(num_speculative_tokens=5, spec_acceptance=0.0), COST)
    steps = decode_steps(res)
    assert len(steps) == out - 1 and res.spec.num_accepted_tokens == 0
    assert all(mb.num_accepted == 0 for mb in steps)
    drafts = [mb.batch.num_draft_tokens for mb in steps]
    assert drafts[0] == 2  # a new request's prior earns two
    tail = drafts[len(drafts) // 2:]
    # backed off: one probe draft every PROBE_EVERY steps, nothing between
    assert set(tail) <= {0, 1} and sum(tail) <= math.ceil(len(tail) / PROBE_EVERY)
    assert sum(tail) >= len(tail) // PROBE_EVERY


def burst(n: int = 24, seed: int = 0) -> list[SimRequest]:
    rng = random.Random(seed)
    return [SimRequest(0.002 * i, rng.randint(30, 400), rng.randint(4, 60)) for i in range(n)]


@pytest.mark.parametrize("cfg", [
    dict(scheduler="sarathi"), dict(scheduler="hybrid-only"), dict(scheduler="chunked-only"),
    dict(scheduler="vllm"), dict(scheduler="orca"),
    dict(scheduler="sarathi", target_tbt=0.2),  # drafts within the predicted step time as well
], ids=lambda c: c["scheduler"] + (":dynamic" if "target_tbt" in c else ""))
@pytest.mark.parametrize("acceptance", [0.0, 0.8, 1.0])
def test_speculation_never_holds_back_prefill(cfg, acceptance):
    """Drafts take only what a step's budget leaves: by every step, at least as many prefill
    tokens have been scheduled with speculation on as with it off."""
    budget = 512 if "target_tbt" in cfg else 128
    cfg = dict(cfg, max_num_batched_tokens=budget, num_blocks=4096)
    off = simulate(burst(), ReplicaConfig(**cfg), COST)
    on = simulate(burst(), ReplicaConfig(**cfg, num_speculative_tokens=4, spec_acceptance=acceptance), COST)
    assert on.unfinished == off.unfinished == 0
    assert sum(mb.batch.num_draft_tokens for mb in on.micro_batches) > 0
    done_off = done_on = 0
    for mb_off, mb_on in zip(off.micro_batches, on.micro_batches):
        done_off += mb_off.batch.num_prefill_tokens
        done_on += mb_on.batch.num_prefill_tokens
        assert done_on >= done_off
    # drafts stay within the budget (a whole prompt over it may still run alone, without drafts)
    assert all(mb.batch.total_tokens <= budget for mb in on.micro_batches if mb.batch.num_draft_tokens)


@settings(max_examples=examples(60), deadline=None)
@given(work=st.lists(st.tuples(st.floats(0.0, 0.05), st.integers(1, 40), st.integers(1, 30)), min_size=1, max_size=6),
       policy=st.sampled_from(["sarathi", "hybrid-only", "chunked-only", "vllm", "orca", "request-level"]),
       k=st.integers(0, 5), acceptance=st.sampled_from([0.0, 0.3, 0.7, 1.0]), num_blocks=st.integers(20, 48),
       max_model_len=st.integers(41, 80), stages=st.integers(1, 2), seed=st.integers(0, 3))
def test_every_block_is_free_at_the_end(work, policy, k, acceptance, num_blocks, max_model_len, stages, seed):
    cfg = ReplicaConfig(scheduler=policy, max_num_batched_tokens=32, block_size=4, num_blocks=num_blocks,
                        max_model_len=max_model_len, num_speculative_tokens=k, spec_acceptance=acceptance,
                        spec_seed=seed)
    res = simulate([SimRequest(*w) for w in work], cfg, FormulaCostModel(num_stages=stages))
    assert res.unfinished == 0
    assert all(not bm.holders() for bm in res.block_managers)
    for r in res.requests:
        assert r.num_output_tokens == r.sampling_params.max_tokens or r.num_tokens == max_model_len
        assert r.num_output_tokens <= r.sampling_params.max_tokens and r.num_tokens <= max_model_len
    if k:
        stats = res.spec
        assert stats.num_accepted_tokens <= stats.num_draft_tokens
        assert stats.num_accepted_tokens == {0.0: 0, 1.0: stats.num_draft_tokens}.get(acceptance,
                                                                                       stats.num_accepted_tokens)
        assert sum(mb.num_accepted for mb in res.micro_batches) == stats.num_accepted_tokens
    else:
        assert res.spec is None and all(not mb.batch.num_draft_tokens for mb in res.micro_batches)


def test_the_same_seed_gives_the_same_run():
    cfg = ReplicaConfig(num_speculative_tokens=3, spec_acceptance=0.6, spec_seed=7)
    a, b = simulate(burst(), cfg, COST, num_replicas=2), simulate(burst(), cfg, COST, num_replicas=2)
    assert [r.token_times for r in a.requests] == [r.token_times for r in b.requests]
    assert a.spec == b.spec and 0 < a.spec.num_accepted_tokens < a.spec.num_draft_tokens


def test_bad_speculation_settings_are_rejected():
    with pytest.raises(ValueError, match="acceptance"):
        simulate([SimRequest(0.0, 4, 4)], ReplicaConfig(num_speculative_tokens=2, spec_acceptance=1.5), COST)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        simulate([SimRequest(0.0, 4, 4)], ReplicaConfig(num_speculative_tokens=-1), COST)


def test_simulate_cli_reports_speculation(tmp_path, capsys):
    prof = tmp_path / "profile.csv"
    write_profile(prof)
    common = ["simulate", "--profile", str(prof), "--num-requests", "20", "--lengths", "fixed", "--prompt-len", "100",
              "--output-len", "40", "--no-plots"]
    assert main([*common, "--spec-tokens", "4", "--spec-acceptance", "0.8", "--output", str(tmp_path / "on")]) == 0
    assert main([*common, "--output", str(tmp_path / "off")]) == 0
    on = json.loads((tmp_path / "on" / "simulation.json").read_text())["schedulers"]["sarathi"]
    off = json.loads((tmp_path / "off" / "simulation.json").read_text())["schedulers"]["sarathi"]
    assert "spec_decode" not in off
    sd = on["spec_decode"]
    assert 0 < sd["num_accepted_tokens"] < sd["num_draft_tokens"]
    assert sd["tokens_per_verification"] == pytest.approx(1 + sd["num_accepted_tokens"] / sd["num_drafts"])
    assert sd["tokens_per_decode"] > 1 and sd["draft_tokens_per_step"] > 0
    assert on["summary"]["num_completed"] == off["summary"]["num_completed"] == 20
    assert on["summary"]["output_tokens"] == off["summary"]["output_tokens"] == 800
    assert "speculation:" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main([*common, "--spec-acceptance", "1.5", "--output", str(tmp_path / "bad")])
    assert "probability" in capsys.readouterr().err
