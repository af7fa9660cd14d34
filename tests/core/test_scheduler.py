"""SarathiScheduler driven by a fake model loop: invariants checked every iteration."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from carpool.core.block_manager import BlockManager, blocks_for
from carpool.core.scheduler import SarathiScheduler, ScheduledBatch, make_scheduler
from carpool.request import Request, RequestStatus
from carpool.sampling_params import SamplingParams
from tests.helpers import examples

FAKE_TOKEN = 7


def make_request(rid: str, prompt_len: int, max_tokens: int) -> Request:
    return Request(rid, list(range(100, 100 + prompt_len)), SamplingParams(max_tokens=max_tokens))


class Harness:
    """The engine's loop with the model replaced by 'append FAKE_TOKEN to every ready request'."""

    def __init__(self, num_blocks: int, block_size: int, budget: int, max_num_seqs: int):
        self.bm = BlockManager(num_blocks, block_size)
        self.sched = make_scheduler("sarathi", self.bm, budget, max_num_seqs)
        assert isinstance(self.sched, SarathiScheduler)
        self.budget = budget
        self.requests: list[Request] = []
        self.aborted: set[str] = set()
        self.iterations = 0
        self.batches: list[ScheduledBatch] = []

    # -------------------------------------------------------------- driving
    def add(self, request: Request) -> None:
        self.requests.append(request)
        self.sched.add_request(request)

    def live(self) -> list[Request]:
        return list(self.sched.running) + list(self.sched.waiting)

    def abort(self, request: Request) -> None:
        self.sched.finish(request, RequestStatus.FINISHED_ABORTED)
        self.aborted.add(request.request_id)
        assert request.block_ids == []
        assert request not in self.sched.running and request not in self.sched.waiting

    def step(self) -> ScheduledBatch:
        sched = self.sched
        before_running = list(sched.running)
        before_decodes = [r for r in before_running if r.is_decode]
        before_waiting = list(sched.waiting)
        preempts_before = sched.num_preemptions

        batch = sched.schedule()
        self.batches.append(batch)
        self.check_batch(batch, before_running, before_decodes, before_waiting, preempts_before)

        expected_ready = [r for r, n in zip(batch.requests, batch.num_tokens)
                          if r.num_computed_tokens + n == r.num_tokens]
        ready = sched.commit(batch)
        assert ready == expected_ready
        for r in self.live():
            assert 0 <= r.num_computed_tokens <= r.num_tokens
        for r in ready:
            assert r.status is RequestStatus.RUNNING
            assert r.num_computed_tokens == r.num_tokens
            assert r.num_output_tokens < r.sampling_params.max_tokens
            r.append_token(FAKE_TOKEN, float(self.iterations))
            if r.num_output_tokens >= r.sampling_params.max_tokens:
                sched.finish(r, RequestStatus.FINISHED_LENGTH)
                assert r.block_ids == []
        self.iterations += 1
        self.check_state()
        return batch

    # -------------------------------------------------------------- checks
    def check_batch(self, batch, before_running, before_decodes, before_waiting, preempts_before):
        sched, bm = self.sched, self.bm
        assert len(batch.requests) == len(batch.num_tokens)
        assert batch.total_tokens <= self.budget
        assert all(n >= 1 for n in batch.num_tokens), batch.num_tokens
        assert len({id(r) for r in batch.requests}) == len(batch.requests), "request twice in batch"
        assert sched.num_preemptions - preempts_before == len(batch.preempted)

        # Liveness: with unfinished work the batch is never empty.
        if before_running or before_waiting:
            assert len(batch) > 0, "nothing scheduled although requests are unfinished"

        for r, n in zip(batch.requests, batch.num_tokens):
            assert r.status is RequestStatus.RUNNING
            assert r in sched.running
            assert n <= r.num_uncomputed_tokens
            # Its blocks already cover the KV the step will write.
            assert len(r.block_ids) * bm.block_size >= r.num_computed_tokens + n
            assert r in before_running or r in before_waiting

        # Decodes first, then prefill chunks.
        flags = [r.is_decode for r in batch.requests]
        assert flags == sorted(flags, reverse=True), flags
        assert batch.num_decode_tokens == sum(flags)

        # Every decode that was running and not preempted got exactly its one token.
        preempted_ids = {id(r) for r in batch.preempted}
        for r in before_decodes:
            if id(r) in preempted_ids:
                continue
            assert r in batch, f"running decode {r.request_id} was skipped"
            assert batch.num_tokens[batch.requests.index(r)] == 1

        # Preempted requests lost their KV and went back to waiting, unless the same pass
        # re-admitted them from the front of the queue, in which case they start over from 0.
        for r in batch.preempted:
            assert r in before_running
            assert r.num_computed_tokens == 0
            assert r.num_preemptions >= 1
            if r in batch:
                assert r.status is RequestStatus.RUNNING and r in sched.running
                n = batch.num_tokens[batch.requests.index(r)]
                assert len(r.block_ids) == blocks_for(n, bm.block_size)
            else:
                assert r.status is RequestStatus.WAITING
                assert r in sched.waiting and r not in sched.running
                assert r.block_ids == []

        # Requests admitted from the queue were taken FCFS from its front. Preempted requests
        # were pushed to the front one by one, so the queue the admission loop saw was:
        queue = list(reversed(batch.preempted)) + before_waiting
        admitted = [r for r in sched.running if r not in before_running or r in batch.preempted]
        assert all(a is q for a, q in zip(admitted, queue)) and len(admitted) <= len(queue)
        assert [r for r in batch.requests if r in admitted] == admitted
        assert list(sched.waiting) == queue[len(admitted):]

        # Budget use: if no one was preempted and budget is left over, every prefill got all it
        # wanted and the head of the queue could not be admitted.
        left = self.budget - batch.total_tokens
        if not batch.preempted and left > 0:
            for r, n in zip(batch.requests, batch.num_tokens):
                assert n == r.num_uncomputed_tokens
            if sched.waiting:
                head = sched.waiting[0]
                assert (len(sched.running) >= sched.max_num_seqs
                        or not bm.can_allocate(head, min(head.num_uncomputed_tokens, left)))

    def check_state(self):
        sched, bm = self.sched, self.bm
        running, waiting = list(sched.running), list(sched.waiting)
        assert len(running) <= sched.max_num_seqs
        assert len(running) <= self.budget
        ids = [id(r) for r in running + waiting]
        assert len(ids) == len(set(ids)), "request both running and waiting (or twice)"
        for r in running:
            assert r.status is RequestStatus.RUNNING
        for r in waiting:
            assert r.status is RequestStatus.WAITING
            assert r.block_ids == [] and r.num_computed_tokens == 0
        for r in self.requests:
            if r.is_finished:
                assert r.block_ids == []
                assert r not in sched.running and r not in sched.waiting
        owners = bm.holders()
        live = running + waiting
        owned = [b for r in live for b in r.block_ids]
        assert len(owned) == len(set(owned)), "block owned by two live requests"
        assert owners == {b: {r.request_id} for r in live for b in r.block_ids}
        assert bm.num_free_blocks + len(owners) == bm.num_blocks
        for r in running:
            # A running request holds blocks for its computed tokens (and not wildly more).
            assert len(r.block_ids) * bm.block_size >= r.num_computed_tokens
            assert len(r.block_ids) <= blocks_for(r.num_tokens, bm.block_size)

    def check_done(self):
        sched, bm = self.sched, self.bm
        assert not sched.has_unfinished_requests()
        assert bm.num_free_blocks == bm.num_blocks
        assert bm.holders() == {}
        for r in self.requests:
            assert r.is_finished
            assert r.block_ids == []
            if r.request_id in self.aborted:
                assert r.status is RequestStatus.FINISHED_ABORTED
            else:
                assert r.status is RequestStatus.FINISHED_LENGTH
                assert r.num_output_tokens == r.sampling_params.max_tokens
                assert r.output_token_ids == [FAKE_TOKEN] * r.sampling_params.max_tokens
                assert r.token_ids[: r.num_prompt_tokens] == r.prompt_token_ids
                assert len(r.token_times) == r.sampling_params.max_tokens

    def run_until_done(self, max_iterations: int) -> None:
        while self.sched.has_unfinished_requests():
            assert self.iterations < max_iterations, "scheduler did not finish: livelock?"
            self.step()
        self.check_done()


# ------------------------------------------------------------------ property-based


@st.composite
def workloads(draw):
    block_size = draw(st.integers(1, 8))
    num_blocks = draw(st.integers(1, 24))
    capacity = num_blocks * block_size
    budget = draw(st.integers(1, 64))
    max_num_seqs = draw(st.integers(1, 8))
    n_requests = draw(st.integers(1, 10))
    specs = []
    for _ in range(n_requests):
        total = draw(st.integers(2, min(capacity, 80))) if capacity >= 2 else None
        if total is None:
            # One slot only: prompt of 1 and a single output token (its KV is never written).
            prompt_len, out_len = 1, 1
        else:
            prompt_len = draw(st.integers(1, total - 1))
            out_len = total - prompt_len
        arrival = draw(st.integers(0, 30))
        specs.append((prompt_len, out_len, arrival))
    abort_prob = draw(st.sampled_from([0.0, 0.0, 0.05, 0.2]))
    seed = draw(st.integers(0, 2**32 - 1))
    return block_size, num_blocks, budget, max_num_seqs, specs, abort_prob, seed


def run_workload(block_size, num_blocks, budget, max_num_seqs, specs, abort_prob, seed):
    rng = random.Random(seed)
    h = Harness(num_blocks, block_size, budget, max_num_seqs)
    pending = sorted(enumerate(specs), key=lambda p: p[1][2])
    total_tokens = sum(p + o for p, o, _ in specs)
    max_iterations = 200 + 40 * total_tokens
    while pending or h.sched.has_unfinished_requests():
        assert h.iterations < max_iterations, "scheduler did not finish: livelock?"
        while pending and pending[0][1][2] <= h.iterations:
            i, (p, o, _) = pending.pop(0)
            h.add(make_request(f"r{i}", p, o))
        if not h.sched.has_unfinished_requests():
            h.iterations += 1  # idle tick until the next arrival
            continue
        if abort_prob and rng.random() < abort_prob:
            h.abort(rng.choice(h.live()))
            h.check_state()
            if not h.sched.has_unfinished_requests():
                continue
        h.step()
    h.check_done()
    return h


@settings(max_examples=examples(250), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_keep_invariants_and_finish(w):
    run_workload(*w)


@settings(max_examples=examples(100), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(block_size=st.integers(1, 4), budget=st.integers(1, 16), max_num_seqs=st.integers(2, 8),
       n=st.integers(2, 6), seed=st.integers(0, 1000))
def test_tight_caches_force_preemption_yet_finish(block_size, budget, max_num_seqs, n, seed):
    """Every request fits alone, but a few together do not: preemption must resolve it."""
    rng = random.Random(seed)
    num_blocks = rng.randint(2, 6)
    capacity = num_blocks * block_size
    h = Harness(num_blocks, block_size, budget, max_num_seqs)
    for i in range(n):
        total = rng.randint(max(2, capacity // 2), capacity) if capacity >= 2 else 2
        p = rng.randint(1, total - 1)
        h.add(make_request(f"r{i}", p, total - p))
    h.run_until_done(200 + 40 * capacity * n)


# ------------------------------------------------------------------ deterministic


def test_make_scheduler_rejects_unknown_name():
    with pytest.raises(ValueError, match="unknown scheduler"):
        make_scheduler("nope", BlockManager(4, 4), 8, 4)


def test_max_num_seqs_capped_by_budget():
    s = make_scheduler("sarathi", BlockManager(4, 4), 3, 10)
    assert s.max_num_seqs == 3


def test_small_cache_preempts_and_finishes():
    # 4 blocks of 4 = 16 slots; each request needs up to 5 + 8 - 1 = 12 slots, so two cannot
    # both run to completion together.
    h = Harness(num_blocks=4, block_size=4, budget=8, max_num_seqs=4)
    for i in range(3):
        h.add(make_request(f"r{i}", 5, 8))
    h.run_until_done(500)
    assert h.sched.num_preemptions > 0
    assert any(r.num_preemptions > 0 for r in h.requests)
    assert any(b.preempted for b in h.batches)
    # Recompute-style preemption still produced each full output.
    for r in h.requests:
        assert r.num_output_tokens == 8


def test_preemption_evicts_newest_running_request():
    h = Harness(num_blocks=3, block_size=2, budget=16, max_num_seqs=4)
    a, b = make_request("a", 2, 4), make_request("b", 2, 4)
    h.add(a)
    h.add(b)
    batch = h.step()  # both prompts in one step: 2 blocks
    assert batch.requests == [a, b] and batch.num_tokens == [2, 2]
    assert a.num_output_tokens == 1 and b.num_output_tokens == 1
    batch = h.step()  # both decode: each needs a second block, only one is free
    assert batch.preempted == [b]
    assert batch.requests == [a] and batch.num_tokens == [1]
    assert b.status is RequestStatus.WAITING and h.sched.waiting[0] is b
    assert b.num_computed_tokens == 0 and b.block_ids == []
    assert b.num_preemptions == 1
    # b keeps its generated token and recomputes prompt + output when readmitted.
    assert b.token_ids == [100, 101, FAKE_TOKEN]
    h.run_until_done(100)


def test_fcfs_admission_and_chunk_sizes():
    budget = 10
    h = Harness(num_blocks=64, block_size=4, budget=budget, max_num_seqs=8)
    a, b, c = make_request("a", 7, 3), make_request("b", 6, 3), make_request("c", 25, 2)
    for r in (a, b, c):
        h.add(r)

    batch = h.step()
    # a's whole prompt (7), then b gets what is left of the budget (3); c waits.
    assert batch.requests == [a, b] and batch.num_tokens == [7, 3]
    assert list(h.sched.waiting) == [c]
    assert a.num_output_tokens == 1 and b.num_output_tokens == 0

    batch = h.step()
    # a decodes first (1), then b finishes its prompt (3), then c is admitted with 10 - 4 = 6.
    assert batch.requests == [a, b, c] and batch.num_tokens == [1, 3, 6]
    assert b.num_output_tokens == 1

    batch = h.step()
    # a and b decode; c continues its prompt with the remaining 8 of budget. a has 3 outputs.
    assert batch.requests == [a, b, c] and batch.num_tokens == [1, 1, 8]
    assert a.status is RequestStatus.FINISHED_LENGTH

    batch = h.step()
    # b decodes and finishes; c gets min(remaining 11, 9) = 9.
    assert batch.requests == [b, c] and batch.num_tokens == [1, 9]
    assert b.status is RequestStatus.FINISHED_LENGTH

    batch = h.step()
    # c's last 2 prompt tokens; the rest of the budget goes unused with an empty queue.
    assert batch.requests == [c] and batch.num_tokens == [2]
    assert c.num_output_tokens == 1
    batch = h.step()
    assert batch.requests == [c] and batch.num_tokens == [1]
    assert c.status is RequestStatus.FINISHED_LENGTH
    h.check_done()


def test_chunks_are_min_of_remaining_prompt_and_budget():
    for budget in (1, 3, 5, 16):
        h = Harness(num_blocks=32, block_size=4, budget=budget, max_num_seqs=4)
        r = make_request("a", 13, 1)
        h.add(r)
        chunks = []
        while h.sched.has_unfinished_requests():
            batch = h.step()
            chunks.extend(batch.num_tokens)
        expected = []
        left = 13
        while left:
            expected.append(min(left, budget))
            left -= expected[-1]
        assert chunks == expected


def test_max_num_seqs_limits_admission_in_order():
    h = Harness(num_blocks=64, block_size=4, budget=64, max_num_seqs=2)
    reqs = [make_request(f"r{i}", 3, 2) for i in range(4)]
    for r in reqs:
        h.add(r)
    batch = h.step()
    assert batch.requests == reqs[:2]
    assert list(h.sched.waiting) == reqs[2:]
    h.step()  # r0, r1 decode their last token and finish
    batch = h.step()
    assert batch.requests == reqs[2:]
    h.run_until_done(20)


def test_head_of_line_waiting_blocks_later_requests():
    # The head of the queue does not fit the free blocks; a smaller later request must not jump it.
    h = Harness(num_blocks=4, block_size=4, budget=64, max_num_seqs=4)
    big = make_request("big", 14, 2)
    h.add(big)
    h.step()
    blocker = make_request("blocker", 8, 2)
    small = make_request("small", 1, 1)
    h.add(blocker)
    h.add(small)
    batch = h.step()
    assert blocker not in batch and small not in batch
    assert list(h.sched.waiting) == [blocker, small]
    h.run_until_done(50)


def test_abort_waiting_and_running_releases_blocks():
    h = Harness(num_blocks=8, block_size=2, budget=4, max_num_seqs=4)
    a, b = make_request("a", 6, 4), make_request("b", 3, 4)
    h.add(a)
    h.add(b)
    h.step()  # a gets 4 of its 6 prompt tokens; b waits
    assert a.status is RequestStatus.RUNNING and len(a.block_ids) == 2
    assert b.status is RequestStatus.WAITING
    h.abort(b)
    h.abort(a)
    h.check_state()
    assert h.bm.num_free_blocks == 8
    assert not h.sched.has_unfinished_requests()
    assert h.sched.schedule().requests == []


def test_ordered_puts_decodes_first_stably():
    p1, p2 = make_request("p1", 5, 2), make_request("p2", 3, 2)
    d1, d2 = make_request("d1", 2, 3), make_request("d2", 2, 3)
    for d in (d1, d2):
        d.num_computed_tokens = 2
        d.append_token(FAKE_TOKEN, 0.0)
        assert d.is_decode
    batch = ScheduledBatch()
    for r, n in ((p1, 4), (d1, 1), (p2, 3), (d2, 1)):
        batch.add(r, n)
    out = batch.ordered()
    assert out.requests == [d1, d2, p1, p2] and out.num_tokens == [1, 1, 4, 3]
    assert out.num_decode_tokens == 2 and out.num_prefill_tokens == 7 and out.total_tokens == 9


def test_preempt_refunds_a_victim_already_in_the_batch():
    bm = BlockManager(4, 2)
    sched = make_scheduler("sarathi", bm, 16, 4)
    a, b = make_request("a", 3, 2), make_request("b", 3, 2)
    sched.add_request(a)
    sched.add_request(b)
    batch = ScheduledBatch()
    assert sched.admit(a, 3, batch) and sched.admit(b, 3, batch)
    assert bm.num_free_blocks == 0 and batch.total_tokens == 6
    sched.preempt(b, batch)
    assert b not in batch and batch.requests == [a] and batch.preempted == [b]
    assert sched.budget_left(batch) == 16 - 3
    assert list(sched.waiting) == [b] and b.status is RequestStatus.WAITING
    assert sched.running == [a]
    assert b.block_ids == [] and b.num_computed_tokens == 0 and sched.num_preemptions == 1
    assert bm.num_free_blocks == 2


def test_grant_running_evicts_newest_until_it_fits():
    bm = BlockManager(4, 2)
    sched = make_scheduler("sarathi", bm, 16, 4)
    a, b, c = make_request("a", 2, 4), make_request("b", 2, 4), make_request("c", 2, 4)
    batch = ScheduledBatch()
    for r in (a, b, c):
        sched.add_request(r)
        assert sched.admit(r, 2, batch)
    sched.commit(batch)
    # a wants 6 more tokens (3 more blocks); c then b are evicted, in that order.
    batch = ScheduledBatch()
    assert sched.grant_running(a, 6, batch)
    assert batch.requests == [a] and batch.preempted == [c, b]
    assert list(sched.waiting) == [b, c]  # the older victim is first in line
    assert len(a.block_ids) == 4
    # A request that cannot fit even alone evicts itself and reports it.
    batch = ScheduledBatch()
    assert sched.grant_running(a, 7, batch) is False
    assert batch.preempted == [a] and list(sched.waiting) == [a, b, c]
    assert bm.num_free_blocks == 4
