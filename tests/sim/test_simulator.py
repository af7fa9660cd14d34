"""The simulator against hand-computed timelines, using a cost model that is a known formula."""

from __future__ import annotations

import pytest

from carpool.core.step_cost import BatchShape
from carpool.sim.cost_model import FormulaCostModel
from carpool.sim.simulator import ReplicaConfig, SimRequest, simulate

# t(iteration) = 0.010 + 0.001 * tokens
COST = FormulaCostModel(fixed=0.010, per_token=0.001)


def times(result):
    return {r.request_id: [round(t, 6) for t in r.token_times] for r in result.requests}


def test_single_request_timeline():
    res = simulate([SimRequest(0.0, 10, 3)], ReplicaConfig(max_num_batched_tokens=512), COST)
    # prefill 10 tokens: 0.020; then two decodes of 0.011 each.
    assert times(res) == {"sim-0": [0.02, 0.031, 0.042]}
    r = res.requests[0]
    assert r.first_scheduled_time == 0.0 and r.finished_time == pytest.approx(0.042)
    assert res.unfinished == 0 and res.stage_busy == [[pytest.approx(0.042)]]


@pytest.mark.parametrize("policy, expected", [
    # budget 8; A: prompt 10, 2 outputs; B: prompt 4, 2 outputs; both at t=0.
    # sarathi: [A:8] 0.018 | [A:2, B:4] 0.016 -> A1,B1 @0.034 | [A:1, B:1] 0.012 -> A2,B2 @0.046
    ("sarathi", {"sim-0": [0.034, 0.046], "sim-1": [0.034, 0.046]}),
    # vllm: whole prompts; A alone (10 > budget, nothing else may join): 0.020 -> A1 @0.020;
    # [B:4] prefill-only 0.014 -> B1 @0.034; decodes [A,B] 0.012 -> A2,B2 @0.046
    ("vllm", {"sim-0": [0.02, 0.046], "sim-1": [0.034, 0.046]}),
    # orca: [A:10] 0.020 -> A1; [A:1 decode, B:4 prompt] 0.015 -> A2,B1 @0.035; [B:1] 0.011 @0.046
    ("orca", {"sim-0": [0.02, 0.035], "sim-1": [0.035, 0.046]}),
    # request-level: [A:10] alone (B does not fit the cap beside it) -> A1 @0.020; A decodes alone
    # to the end: A2 @0.031; then [B:4] 0.014 -> B1 @0.045; [B:1] 0.011 -> B2 @0.056
    ("request-level", {"sim-0": [0.02, 0.031], "sim-1": [0.045, 0.056]}),
])
def test_two_requests_per_policy(policy, expected):
    work = [SimRequest(0.0, 10, 2), SimRequest(0.0, 4, 2)]
    res = simulate(work, ReplicaConfig(scheduler=policy, max_num_batched_tokens=8), COST)
    assert times(res) == expected


def test_arrival_waits_for_the_running_iteration():
    # B arrives at 0.005 while A's prefill (0.020) runs; it joins the next iteration.
    work = [SimRequest(0.0, 10, 2), SimRequest(0.005, 4, 1)]
    res = simulate(work, ReplicaConfig(max_num_batched_tokens=64), COST)
    # [A:10] 0.020 -> A1 @0.020 | [A:1, B:4] 0.015 -> A2, B1 @0.035
    assert times(res) == {"sim-0": [0.02, 0.035], "sim-1": [0.035]}
    assert res.requests[1].first_scheduled_time == pytest.approx(0.020)


def test_idle_gap_until_next_arrival():
    work = [SimRequest(0.0, 5, 1), SimRequest(1.0, 5, 1)]
    res = simulate(work, ReplicaConfig(), COST)
    assert times(res) == {"sim-0": [0.015], "sim-1": [1.015]}
    assert res.bubble_fraction() == pytest.approx(1 - 0.030 / 1.015)


def test_pipeline_stages_overlap_micro_batches():
    # Two stages, each half of the formula. A and B arrive together with budget 10:
    # mb1 = [A:10] stage times 0.010 each: stage0 [0, .010], stage1 [.010, .020] -> A1 @0.020.
    # Stage 0 frees at .010 with B waiting (A in flight): mb2 = [B:10] stage0 [.010, .020],
    # stage1 [.020, .030] -> B1 @0.030. Then A (done at .020) decodes: mb3 [A:1] 0.0055 per stage:
    # stage0 [.020, .0255], but stage1 is busy with B until .030: [.030, .0355]; A2 @0.0355.
    cost = FormulaCostModel(fixed=0.010, per_token=0.001, num_stages=2)
    work = [SimRequest(0.0, 10, 2), SimRequest(0.0, 10, 1)]
    res = simulate(work, ReplicaConfig(max_num_batched_tokens=10), cost)
    assert times(res) == {"sim-0": [0.02, 0.0355], "sim-1": [0.03]}
    assert res.micro_batches[2].waited == pytest.approx(0.0045)
    # no request was ever in two micro-batches at once
    for a in res.micro_batches:
        for b in res.micro_batches:
            if a is not b and a.start < b.end and b.start < a.end:
                assert not {r.request_id for r in a.batch.requests} & {r.request_id for r in b.batch.requests}


def test_uneven_micro_batches_make_bubbles():
    cost = FormulaCostModel(fixed=0.0, per_token=0.001, num_stages=2)
    even = simulate([SimRequest(0.0, 8, 1) for _ in range(4)], ReplicaConfig(max_num_batched_tokens=8), cost)
    uneven = simulate([SimRequest(0.0, n, 1) for n in (8, 1, 8, 1)], ReplicaConfig(max_num_batched_tokens=8), cost)
    assert even.bubble_fraction() < uneven.bubble_fraction()
    assert sum(uneven.request_pipeline_wait.values()) > sum(even.request_pipeline_wait.values())


def test_preemption_and_block_accounting():
    # 6 blocks of 4 slots; three requests of 8 + 8 tokens cannot all stay resident.
    work = [SimRequest(0.0, 8, 8) for _ in range(3)]
    res = simulate(work, ReplicaConfig(num_blocks=6, block_size=4, max_num_batched_tokens=32), COST)
    assert res.unfinished == 0
    assert sum(r.num_preemptions for r in res.requests) > 0
    assert all(r.num_output_tokens == 8 for r in res.requests)


def test_replicas_share_load():
    work = [SimRequest(0.0, 10, 2) for _ in range(4)]
    one = simulate(work, ReplicaConfig(max_num_batched_tokens=10), COST)
    two = simulate(work, ReplicaConfig(max_num_batched_tokens=10), COST, num_replicas=2)
    assert max(r.finished_time for r in two.requests) < max(r.finished_time for r in one.requests)


def test_bad_requests_are_rejected():
    with pytest.raises(ValueError, match="max_model_len"):
        simulate([SimRequest(0.0, 100, 1)], ReplicaConfig(max_model_len=50), COST)
    with pytest.raises(ValueError, match=">= 1"):
        simulate([SimRequest(0.0, 0, 1)], ReplicaConfig(), COST)


@pytest.mark.slow
def test_ten_thousand_requests_take_seconds():
    import random
    import time

    rng = random.Random(0)
    t, work = 0.0, []
    for _ in range(10_000):
        t += rng.expovariate(20.0)
        work.append(SimRequest(t, rng.randint(50, 1500), rng.randint(10, 300)))
    start = time.perf_counter()
    res = simulate(work, ReplicaConfig(max_num_batched_tokens=512, num_blocks=20000), COST, num_replicas=4)
    assert res.unfinished == 0 and len(res.requests) == 10_000
    assert time.perf_counter() - start < 60  # the issue asks for seconds; this bounds a regression


def test_batch_shape_of_scheduled_batch():
    from carpool.core.scheduler import ScheduledBatch
    from carpool.request import Request
    from carpool.sampling_params import SamplingParams

    a = Request("a", list(range(10)), SamplingParams())
    b = Request("b", list(range(5)), SamplingParams())
    b.num_computed_tokens = 5
    b.token_ids.append(1)
    batch = ScheduledBatch()
    batch.add(b, 1)
    batch.add(a, 6)
    shape = BatchShape.of(batch)
    assert shape == BatchShape(prefills=((6, 0),), decode_contexts=(6,), num_sampled=1)


# ------------------------------------------------------------------ prefix caching
def sim_workload(**kw):
    from carpool.harness.workload import WorkloadConfig, build_workload
    from carpool.sim.run import SIM_PROMPTS

    base = dict(num_requests=12, lengths="uniform", min_prompt_len=40, max_prompt_len=200, min_output_len=4,
                max_output_len=16, qps=2.0, seed=3, max_model_len=4096)
    return build_workload(WorkloadConfig(**{**base, **kw}), SIM_PROMPTS)


def prefill_tokens(res) -> int:
    return sum(mb.batch.num_prefill_tokens for mb in res.micro_batches)


def test_shared_system_prompt_is_prefilled_once():
    work = sim_workload(system_prompt_len=320)  # 20 blocks of 16
    on = simulate(work, ReplicaConfig(), COST)
    off = simulate(work, ReplicaConfig(enable_prefix_caching=False), COST)
    assert on.unfinished == off.unfinished == 0
    first = min(on.requests, key=lambda r: r.arrival_time)
    assert first.num_cached_tokens == 0
    assert all(r.num_cached_tokens == 320 for r in on.requests if r is not first)
    assert prefill_tokens(off) - prefill_tokens(on) == 320 * (len(work) - 1)
    assert all(r.num_cached_tokens == 0 for r in off.requests)
    # Same tokens out, sooner.
    assert [r.num_output_tokens for r in on.requests] == [r.num_output_tokens for r in off.requests]
    assert sum(r.token_times[0] - r.arrival_time for r in on.requests) < \
        sum(r.token_times[0] - r.arrival_time for r in off.requests)


def test_conversations_follow_their_previous_turn_and_hit_it():
    work = sim_workload(num_requests=4, turns=3, think_time=0.5)
    assert len(work) == 12 and sum(w.parent is not None for w in work) == 8
    res = simulate(work, ReplicaConfig(), COST)
    assert res.unfinished == 0 and len(res.requests) == 12
    by_index = {int(r.request_id.removeprefix("sim-")): r for r in res.requests}
    position = {w.index: i for i, w in enumerate(work)}
    for i, w in enumerate(work):
        r = by_index[i]
        assert r.num_prompt_tokens == w.prompt_len
        if w.parent is None:
            continue
        prev = by_index[position[w.parent]]
        assert r.arrival_time == pytest.approx(prev.finished_time + w.arrival_time)
        assert r.token_ids[:prev.num_tokens] == prev.token_ids  # previous prompt and answer first
        # All of the previous turn that was computed (all but its last token) comes from the cache.
        assert r.num_cached_tokens == (prev.num_tokens - 1) // 16 * 16


def test_step_jitter_draws_each_step_time_from_the_given_ratios():
    """A profile's measured / fitted ratios scale each simulated step, seeded: all 2.0 doubles
    every step; mixed ratios give the same timeline twice and only times the formula allows."""
    one = simulate([SimRequest(0.0, 10, 3)], ReplicaConfig(max_num_batched_tokens=512, step_jitter=(2.0,)), COST)
    assert times(one) == {"sim-0": [0.04, 0.062, 0.084]}
    config = ReplicaConfig(max_num_batched_tokens=512, step_jitter=(0.5, 1.5), spec_seed=3)
    a, b = (simulate([SimRequest(0.0, 10, 40)], config, COST) for _ in range(2))
    assert times(a) == times(b)
    gaps = {round(t1 - t0, 6) for t0, t1 in zip(a.requests[0].token_times, a.requests[0].token_times[1:])}
    assert gaps == {0.0055, 0.0165}  # a decode step of 0.011 s, times 0.5 or 1.5


def test_step_jitter_must_be_positive():
    with pytest.raises(ValueError, match="step_jitter"):
        simulate([SimRequest(0.0, 10, 3)], ReplicaConfig(step_jitter=(1.0, 0.0)), COST)
