"""Each scheduling policy's defining behaviour, on a fake model loop (no weights)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.core.block_manager import BlockManager
from carpool.core.scheduler import SCHEDULERS, ScheduledBatch, make_scheduler
from carpool.request import Request, RequestStatus
from carpool.sampling_params import SamplingParams
from tests.helpers import examples

POLICIES = sorted(SCHEDULERS)


def make_requests(lengths: list[tuple[int, int]]) -> list[Request]:
    return [Request(f"r{i}", list(range(10, 10 + p)), SamplingParams(max_tokens=o))
            for i, (p, o) in enumerate(lengths)]


def drive(policy: str, requests: list[Request], budget: int, num_blocks: int, block_size: int = 4,
          max_num_seqs: int = 64, arrive_every: int = 0, max_iterations: int = 5000
          ) -> list[tuple[ScheduledBatch, set[str], list[Request]]]:
    """Run to completion; each record is (batch, ids running before it, requests running before it)."""
    bm = BlockManager(num_blocks, block_size)
    sched = make_scheduler(policy, bm, budget, max_num_seqs, max_model_len=num_blocks * block_size)
    pending = list(requests)
    records = []
    it = 0
    while pending or sched.has_unfinished_requests():
        if pending and (arrive_every == 0 or it % arrive_every == 0):
            sched.add_request(pending.pop(0))
            if arrive_every == 0:
                while pending:
                    sched.add_request(pending.pop(0))
        before = list(sched.running)
        batch = sched.schedule()
        records.append((batch, {r.request_id for r in before}, [r for r in before if r.is_decode]))
        for r in sched.commit(batch):
            r.append_token(7, float(it))
            if r.num_output_tokens >= r.sampling_params.max_tokens:
                sched.finish(r, RequestStatus.FINISHED_LENGTH)
        it += 1
        assert it < max_iterations, f"{policy} did not finish"
    assert bm.num_free_blocks == num_blocks
    assert all(r.num_output_tokens == r.sampling_params.max_tokens for r in requests)
    return records


LENGTHS = [(30, 6), (5, 12), (17, 3), (44, 8), (9, 9), (21, 5)]


def test_sarathi_keeps_budget_and_every_decode():
    for batch, _, decodes in drive("sarathi", make_requests(LENGTHS), budget=16, num_blocks=200):
        assert batch.total_tokens <= 16
        assert all(d in batch for d in decodes)


def test_vllm_never_mixes_prefill_and_decode():
    records = drive("vllm", make_requests(LENGTHS), budget=64, num_blocks=200, arrive_every=3)
    for batch, _, _ in records:
        assert not (batch.num_prefill_tokens and batch.num_decode_tokens)
    # Prompts go whole: a prefill grant always completes the prompt.
    assert any(batch.num_prefill_tokens for batch, _, _ in records)
    for batch, _, _ in records:
        for r, n in zip(batch.requests, batch.num_tokens):
            if not r.is_decode:
                assert n == r.num_prompt_tokens
    # Prefill-prioritising: an iteration with decodes available still runs a waiting prompt first.
    assert any(batch.num_prefill_tokens and decodes for batch, _, decodes in records)


def test_request_level_admits_nothing_while_a_batch_runs():
    for batch, running_before, _ in drive("request-level", make_requests(LENGTHS), budget=64, num_blocks=200,
                                          arrive_every=2):
        if running_before:
            assert {r.request_id for r in batch.requests} <= running_before
            assert batch.num_prefill_tokens == 0


def test_orca_never_preempts_even_when_memory_is_tight():
    reqs = make_requests(LENGTHS)
    records = drive("orca", reqs, budget=64, num_blocks=20)  # 80 slots for 169 tokens in all
    assert not any(batch.preempted for batch, _, _ in records)
    assert all(r.num_preemptions == 0 for r in reqs)
    # Mixes whole prompts with running decodes.
    assert any(batch.num_prefill_tokens and batch.num_decode_tokens for batch, _, _ in records)


def test_sarathi_does_preempt_under_the_same_pressure():
    reqs = make_requests(LENGTHS)
    drive("sarathi", reqs, budget=64, num_blocks=20)
    assert sum(r.num_preemptions for r in reqs) > 0


def test_chunked_only_alternates_without_mixing():
    records = drive("chunked-only", make_requests(LENGTHS), budget=8, num_blocks=200, arrive_every=2)
    kinds = []
    for batch, _, _ in records:
        assert not (batch.num_prefill_tokens and batch.num_decode_tokens)
        assert batch.total_tokens <= 8
        kinds.append("p" if batch.num_prefill_tokens else "d")
    assert "p" in kinds and "d" in kinds
    # Whenever decodes were waiting, a prefill iteration is followed by a decode iteration.
    for (b1, _, _), (b2, _, decodes2) in zip(records, records[1:]):
        if b1.num_prefill_tokens and decodes2:
            assert b2.num_decode_tokens and not b2.num_prefill_tokens


def test_hybrid_only_mixes_whole_prompts():
    records = drive("hybrid-only", make_requests(LENGTHS), budget=16, num_blocks=200, arrive_every=2)
    for batch, _, decodes in records:
        assert all(d in batch for d in decodes)
        for r, n in zip(batch.requests, batch.num_tokens):
            if not r.is_decode:
                assert n == r.num_uncomputed_tokens  # never a partial chunk
    # A prompt of 44 tokens exceeds the budget of 16 and still runs, whole.
    assert any(batch.total_tokens > 16 for batch, _, _ in records)


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=examples(25), deadline=None)
@given(lengths=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 10)), min_size=1, max_size=8),
       budget=st.integers(8, 64), arrive_every=st.integers(0, 3))
def test_every_policy_finishes_everything_and_frees_all_blocks(policy, lengths, budget, arrive_every):
    # 60 blocks x 4 = 240 slots: enough for the largest request alone (prompt 40 + 10 outputs).
    drive(policy, make_requests(lengths), budget=budget, num_blocks=60, arrive_every=arrive_every)


@pytest.fixture(scope="module")
def greedy_by_policy(engine_fp32):
    from tests.helpers import run_greedy, scheduler_config
    from tests.test_engine import varied_prompts

    prompts = varied_prompts(engine_fp32.tokenizer, 8)
    out = {}
    for policy in POLICIES:
        with scheduler_config(engine_fp32, budget=64, policy=policy):
            out[policy] = run_greedy(engine_fp32, prompts, 8)
    # The SLO-following budget: chunk lengths follow measured step times (a 30 ms target on a
    # model whose steps take ~10-100 ms gives chunks from 1 token up).
    with scheduler_config(engine_fp32, budget=512, policy="sarathi", target_tbt=0.03) as engine:
        out["sarathi:dynamic"] = run_greedy(engine, prompts, 8)
        out["sarathi:dynamic chunk lengths"] = sorted({n for s in engine.iteration_stats for n in [s.num_prefill_tokens]})
    return out


@pytest.mark.slow
def test_slo_following_sarathi_gives_the_same_greedy_outputs(greedy_by_policy):
    assert len(greedy_by_policy["sarathi:dynamic chunk lengths"]) > 3  # it did chunk in varied sizes
    assert greedy_by_policy["sarathi:dynamic"] == greedy_by_policy["sarathi"]


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
def test_all_policies_give_the_same_greedy_outputs(greedy_by_policy, policy):
    assert greedy_by_policy[policy] == greedy_by_policy["sarathi"]
