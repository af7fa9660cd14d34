"""Drafts in the scheduler: granted last from what the budget leaves, never at a prefill's or a
decode's expense, verified and rolled back without leaking a block (a fake model loop)."""

from __future__ import annotations

import copy
import random

from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.core.block_manager import BlockManager, blocks_for
from carpool.core.scheduler import make_scheduler
from carpool.core.step_cost import BatchShape, StepCostModel
from carpool.request import Request, RequestStatus
from carpool.sampling_params import SamplingParams
from carpool.spec.acceptance import SpecState
from tests.helpers import examples


def target_token(request: Request) -> int:
    """The fake model's next token: a function of the tokens so far, as a real model's is."""
    return (sum(request.token_ids[-3:]) * 7 + len(request.token_ids)) % 5


def grants(batch) -> list[tuple[str, int, bool]]:
    return [(r.request_id, n - len(d), decode) for r, n, decode, d in
            zip(batch.requests, batch.num_tokens, batch.is_decode, batch.drafts)]


def run(sched, requests: list[Request], rng: random.Random, max_steps: int = 2000) -> int:
    """The engine's loop over a fake model; checks each step's invariants. Returns draft tokens kept."""
    for r in requests:
        sched.add_request(r)
    kept_total = 0
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            break
        twin = copy.deepcopy(sched)  # the same state without proposals
        for r in twin.running:
            r.spec_token_ids = []
        expected = grants(twin.schedule())
        batch = sched.schedule()
        assert sorted(grants(batch)) == sorted(expected)  # drafts change nothing but themselves
        # (whole-prompt policies may run one prompt over the budget alone)
        assert not batch.num_draft_tokens or batch.total_tokens <= sched.max_num_batched_tokens
        for r, d, decode in zip(batch.requests, batch.drafts, batch.is_decode):
            assert not d or (decode and d == r.spec_token_ids[:len(d)])
        kept_total += verify(sched, batch, rng)
        for r in list(sched.running):
            assert r.num_computed_tokens <= r.num_tokens
            held = max(r.num_tokens, sched.tokens_to_reserve(r, 0))  # rejected drafts' blocks went back
            assert len(r.block_ids) <= blocks_for(held, sched.block_manager.block_size)
    assert not sched.has_unfinished_requests()
    return kept_total


def verify(sched, batch, rng: random.Random) -> int:
    """commit + the engine's _emit and _propose, with the fake model."""
    ready = sched.commit(batch)
    kept_total = 0
    for request, drafts in zip(ready, batch.drafts_of(ready)):
        position = 0
        while True:
            token = target_token(request)
            request.append_token(token, 0.0)
            if request.num_output_tokens >= request.sampling_params.max_tokens:
                sched.finish(request, RequestStatus.FINISHED_LENGTH)
                break
            if position < len(drafts) and token == drafts[position]:
                sched.accept_draft(request)
                kept_total += 1
                position += 1
                continue
            break
        if drafts:
            sched.end_verification(request)
        if request.status is RequestStatus.RUNNING:
            room = request.sampling_params.max_tokens - request.num_output_tokens - 1
            k = min(rng.randint(0, 4), room)
            # Half the time the right guess, else a random one.
            guess, probe = [], copy.copy(request)
            probe.token_ids = list(request.token_ids)
            for _ in range(k):
                t = target_token(probe) if rng.random() < 0.7 else rng.randrange(5)
                guess.append(t)
                probe.token_ids.append(t)
            request.spec_token_ids = guess
    return kept_total


@settings(max_examples=examples(60))
@given(seed=st.integers(0, 10**6), budget=st.integers(4, 48), num_blocks=st.integers(12, 60),
       lengths=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12)), min_size=1, max_size=8),
       policy=st.sampled_from(["sarathi", "vllm", "orca", "chunked-only", "hybrid-only", "request-level"]))
def test_drafts_take_only_what_is_left_and_every_block_is_freed(seed, budget, num_blocks, lengths, policy):
    bm = BlockManager(num_blocks, 4, enable_prefix_caching=seed % 2 == 0)
    max_len = num_blocks * 4
    sched = make_scheduler(policy, bm, budget, 8, max_len)
    reqs = [Request(str(i), [(i * 31 + j) % 5 for j in range(min(p, max_len - m - 1))],
                    SamplingParams(max_tokens=m)) for i, (p, m) in enumerate(lengths) if p < max_len - m]
    run(sched, reqs, random.Random(seed))
    assert bm.holders() == {}
    for r in reqs:
        assert r.num_output_tokens == r.sampling_params.max_tokens
        # the fake model's tokens, each computed from the tokens before it: drafts kept none wrong
        probe = Request("p", r.prompt_token_ids, r.sampling_params)
        for t in r.output_token_ids:
            assert t == target_token(probe)
            probe.token_ids.append(t)


def test_a_lone_decode_takes_its_drafts_and_a_prompt_comes_first():
    bm = BlockManager(64, 4)
    sched = make_scheduler("sarathi", bm, 8, 8)
    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=50))
    sched.add_request(a)
    sched.commit(sched.schedule())
    a.append_token(4, 0.0)
    a.spec_token_ids = [1, 2, 3, 4, 1, 2, 3, 4, 1]
    batch = sched.schedule()
    assert batch.drafts == [[1, 2, 3, 4, 1, 2, 3]]  # 1 + 7 drafts fill the budget of 8
    assert len(a.block_ids) == blocks_for(4 + 1 + 7, 4)
    sched.commit(batch)
    assert a.num_computed_tokens == a.num_tokens == 4  # drafts count only once kept
    a.append_token(9, 0.0)  # the token sampled at the first draft's place: not the draft
    sched.end_verification(a)  # none kept: the blocks only drafts reached go back
    assert len(a.block_ids) == blocks_for(5, 4)
    b = Request("b", [9] * 6, SamplingParams(max_tokens=5))
    sched.add_request(b)
    batch = sched.schedule()
    assert grants(batch) == [("a", 1, True), ("b", 6, False)] and batch.drafts == [[1], []]


def test_drafts_never_preempt():
    bm = BlockManager(2, 4)
    sched = make_scheduler("sarathi", bm, 64, 8)
    a, b = (Request(x, [1, 2, 3], SamplingParams(max_tokens=9)) for x in "ab")
    for r in (a, b):
        sched.add_request(r)
    sched.commit(sched.schedule())
    for r in (a, b):
        r.append_token(4, 0.0)
        r.spec_token_ids = [5, 6, 7]
    batch = sched.schedule()  # each holds one full block: a draft would need a third block
    assert batch.drafts == [[], []] and not batch.preempted and sched.num_preemptions == 0


def fitted(fixed: float, per_token: float) -> StepCostModel:
    """A step-time fit that has seen steps costing `fixed` + `per_token` a token, of many shapes."""
    cost = StepCostModel()
    rng = random.Random(0)
    for _ in range(200):
        shape = BatchShape(tuple((rng.randint(1, 40), rng.randint(0, 60)) for _ in range(rng.randint(0, 3))),
                           tuple(rng.randint(2, 80) for _ in range(rng.randint(0, 20))))
        if shape.num_tokens:
            cost.observe(shape, fixed + per_token * shape.num_tokens)
    return cost


def slo_with_decodes(cost: StepCostModel, target: float, acceptance: float, num_decodes: int, proposal: int):
    bm = BlockManager(256, 4)
    sched = make_scheduler("sarathi", bm, 512, 64, target_tbt=target, cost=cost, strict=False)
    reqs = [Request(str(i), [1, 2, 3], SamplingParams(max_tokens=50)) for i in range(num_decodes)]
    for r in reqs:
        sched.add_request(r)
    sched.commit(sched.schedule())
    for r in reqs:
        r.append_token(4, 0.0)
        r.spec = SpecState(acceptance=acceptance, continuation=acceptance)
        r.spec_token_ids = [7] * proposal
    return sched, sched.schedule()


def test_a_lone_decode_takes_every_draft_that_is_cheap_and_fits_the_target():
    cost = fitted(0.010, 0.0005)  # a decode step is mostly its fixed cost
    sched, batch = slo_with_decodes(cost, 0.030, 0.95, 1, 12)
    assert batch.drafts == [[7] * 12]
    sched, batch = slo_with_decodes(cost, 0.030, 0.7, 1, 12)  # the 7th draft is kept 8% of the time
    assert 4 <= len(batch.drafts[0]) < 12
    sched, batch = slo_with_decodes(cost, 0.0135, 0.7, 1, 12)  # room for ~5 tokens within the target
    assert 1 <= len(batch.drafts[0]) < 12
    assert cost.upper(BatchShape.of(batch)) <= 0.0135
    batch.set_drafts(0, [7] * (len(batch.drafts[0]) + 1))
    assert cost.upper(BatchShape.of(batch)) > 0.0135  # one more would not have fit


def test_a_compute_bound_batch_takes_only_drafts_worth_a_token():
    cost = fitted(0.001, 0.001)  # 16 decodes: 17 ms, a draft costs what a token costs
    _, batch = slo_with_decodes(cost, 0.3, 0.8, 16, 5)
    assert batch.num_draft_tokens == 0  # a draft yields 0.8 tokens for a token's cost: worse than a decode
    _, batch = slo_with_decodes(fitted(0.016, 0.0001), 0.3, 0.8, 16, 4)  # fixed cost dominates
    assert batch.num_draft_tokens == 16 * 4  # (80 tokens: within the small steps, step_cost.SMALL_STEP_TOKENS)
