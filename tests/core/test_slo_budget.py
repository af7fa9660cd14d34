"""SloSarathiScheduler: prefill sized to a predicted step time, decodes never dropped."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.core.block_manager import BlockManager
from carpool.core.scheduler import SloSarathiScheduler, make_scheduler
from carpool.core.step_cost import FEATURES, BatchShape, StepCostModel
from carpool.request import Request, RequestStatus
from carpool.sampling_params import SamplingParams
from tests.helpers import examples


def fixed_model(weights: list[float]) -> StepCostModel:
    """A model that does not learn: its weights are given and every step is 'observed' elsewhere."""
    m = StepCostModel()
    m.weights = list(weights)
    m.max_tokens_seen = 10_000
    m.observe = lambda shape, seconds: None  # type: ignore[method-assign]
    return m


CPU_LIKE = [0.008, 0.27, 0.0, 0.0, 0.0, 0.01, 0.01, 0.0, 0.04, 0.06, 0.01]  # scaled weights (see _SCALE)


def make(target: float, cost: StepCostModel, budget: int = 4096, num_blocks: int = 2000,
         block_size: int = 16) -> SloSarathiScheduler:
    sched = make_scheduler("sarathi", BlockManager(num_blocks, block_size), budget, 256,
                           max_model_len=num_blocks * block_size, target_tbt=target, cost=cost)
    assert isinstance(sched, SloSarathiScheduler)
    return sched


def request(i: int, prompt: int, out: int) -> Request:
    return Request(f"r{i}", [10 + (i * 31 + j) % 900 for j in range(prompt)], SamplingParams(max_tokens=out))


def run(sched, requests: list[Request], check, arrive_every: int = 1, max_steps: int = 20_000) -> None:
    pending, step = list(requests), 0
    while pending or sched.has_unfinished_requests():
        if pending and step % arrive_every == 0:
            sched.add_request(pending.pop(0))
        decodes_before = [r for r in sched.running if r.is_decode]
        batch = sched.schedule()
        check(sched, batch, decodes_before)
        for r in sched.commit(batch):
            r.append_token(7, float(step))
            if r.num_output_tokens >= r.sampling_params.max_tokens:
                sched.finish(r, RequestStatus.FINISHED_LENGTH)
        step += 1
        assert step < max_steps
    assert all(r.num_output_tokens == r.sampling_params.max_tokens for r in requests)


weights = st.lists(st.floats(0, 1), min_size=len(FEATURES), max_size=len(FEATURES)).map(
    lambda w: [w[0] * 0.02 + 1e-3] + [x * 0.5 for x in w[1:]])


@settings(max_examples=examples(40), deadline=None)
@given(w=weights, target=st.floats(0.005, 0.3),
       lengths=st.lists(st.tuples(st.integers(1, 700), st.integers(1, 12)), min_size=1, max_size=10),
       arrive_every=st.integers(1, 4))
def test_chunks_fill_the_target_and_never_exceed_it_needlessly(w, target, lengths, arrive_every):
    cost = fixed_model(w)
    sched = make(target, cost, num_blocks=1000)

    def check(sched, batch, decodes_before):
        # Every running decode is scheduled (nothing preempts here: memory is ample).
        assert not batch.preempted
        assert {r.request_id for r in decodes_before} <= {r.request_id for r, d in zip(batch.requests, batch.is_decode) if d}
        predicted = cost.upper(BatchShape.of(batch))
        if batch.num_prefill_tokens and predicted > target:
            # Over the target only when forced: no decodes, a single first chunk of MIN_CHUNK at most,
            # and even one token of it would have been over.
            assert batch.num_decode_tokens == 0 and len(batch) == 1
            (r,), (n,) = batch.requests, batch.num_tokens
            assert n <= sched.MIN_CHUNK
            assert cost.upper(BatchShape(((1, r.num_computed_tokens),), (), 0)) > target
        if batch.slo_unreachable and batch.num_decode_tokens:
            decodes = BatchShape(decode_contexts=tuple(r.num_computed_tokens + 1 for r, d in
                                                       zip(batch.requests, batch.is_decode) if d))
            assert cost.upper(decodes) > target or predicted > target
        # Maximal: one more token on the last chunk would pass the target (or there was none to give).
        prefills = [(r, n) for r, n, d in zip(batch.requests, batch.num_tokens, batch.is_decode) if not d]
        if prefills and predicted <= target:
            r, n = prefills[-1]
            if n < r.num_uncomputed_tokens and batch.total_tokens < sched.max_num_batched_tokens:
                shape = BatchShape.of(batch)
                grown = BatchShape(shape.prefills[:-1] + ((n + 1, r.num_computed_tokens),),
                                   shape.decode_contexts, shape.num_sampled)
                assert cost.upper(grown) > target

    run(sched, [request(i, p, o) for i, (p, o) in enumerate(lengths)], check, arrive_every)


def test_decodes_alone_over_the_target_run_alone_and_are_counted():
    cost = fixed_model(CPU_LIKE)
    # 12 ms: 8 ms fixed + ~0.4 ms per decode admits ~9 short-context decodes; as their contexts
    # grow (padded decode attention) the decodes alone outgrow the target.
    sched = make(0.012, cost)
    seen_unreachable = []

    def check(sched, batch, decodes_before):
        if batch.slo_unreachable and batch.num_decode_tokens:
            seen_unreachable.append(batch)
            assert batch.num_prefill_tokens == 0
            assert len(batch) == len(decodes_before)
    run(sched, [request(i, 100, 400) for i in range(12)], check)
    assert seen_unreachable and sched.num_slo_unreachable >= len(seen_unreachable)


def test_a_looser_target_gives_longer_chunks():
    def first_chunk(target):
        sched = make(target, fixed_model(CPU_LIKE))
        sched.add_request(request(0, 3000, 2))
        return sched.schedule().num_prefill_tokens
    chunks = [first_chunk(t) for t in (0.02, 0.05, 0.1, 0.4)]
    assert chunks == sorted(chunks) and chunks[0] < chunks[-1]
    # CPU-like costs: 8 ms + 0.27 ms per token, so a 100 ms target holds ~330 tokens.
    assert 250 < chunks[2] < 400


def test_an_unfitted_model_grows_chunks_from_its_trust_region():
    sched = make(0.1, StepCostModel())
    sched.add_request(request(0, 2000, 2))
    sizes = []
    while sched.has_unfinished_requests():
        batch = sched.schedule()
        sizes.append(batch.total_tokens)
        sched.observe(batch, 0.01 + 2.7e-4 * batch.total_tokens)
        for r in sched.commit(batch):
            r.append_token(7, 0.0)
            if r.num_output_tokens >= 2:
                sched.finish(r, RequestStatus.FINISHED_LENGTH)
    assert sizes[0] == 64 and sizes[1] == 128  # doubling while the fit has seen only small steps
    assert max(sizes) <= 400  # then held near the 100 ms target (~330 tokens)


def test_a_target_applies_to_sarathi_only():
    with pytest.raises(ValueError, match="sarathi"):
        make_scheduler("vllm", BlockManager(10, 16), 64, 8, target_tbt=0.05)
    with pytest.raises(ValueError, match="positive"):
        make_scheduler("sarathi", BlockManager(10, 16), 64, 8, target_tbt=0.0)


def test_random_workloads_finish_with_a_learning_model():
    rng = random.Random(3)
    sched = make(0.05, StepCostModel(), num_blocks=200)  # tight memory: preemptions happen

    def check(sched, batch, decodes_before):
        kept = {r.request_id for r, d in zip(batch.requests, batch.is_decode) if d}
        lost = {r.request_id for r in decodes_before} - kept
        assert lost <= {r.request_id for r in batch.preempted}  # a decode leaves only by preemption
        sched.observe(batch, 0.008 + 2.7e-4 * batch.total_tokens * rng.uniform(0.9, 1.1))
    run(sched, [request(i, rng.randint(10, 600), rng.randint(1, 30)) for i in range(40)], check)
