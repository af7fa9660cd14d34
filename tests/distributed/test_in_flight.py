"""The scheduler's in-flight mechanism (no processes): requests whose micro-batch has not returned
get no grant and are never preempted; commit brings them back; aborts in flight are skipped."""

from __future__ import annotations

import pytest

from carpool.core.block_manager import BlockManager
from carpool.core.scheduler import SCHEDULERS, ScheduledBatch, make_scheduler
from carpool.request import Request, RequestStatus
from carpool.sampling_params import SamplingParams


def make(rid: str, n: int) -> Request:
    return Request(rid, list(range(10, 10 + n)), SamplingParams(max_tokens=8))


def sample_all(batch, ready) -> None:
    for r in ready:
        r.append_token(7, 0.0)


@pytest.mark.parametrize("policy", list(SCHEDULERS))
def test_in_flight_requests_are_skipped_until_commit(policy):
    sched = make_scheduler(policy, BlockManager(64, 4), 16, 8)
    requests = [make(str(i), 6) for i in range(4)]
    for r in requests:
        sched.add_request(r)
    first = sched.schedule()
    assert first.requests
    sched.mark_in_flight(first)
    second = sched.schedule()
    assert not set(map(id, first.requests)) & set(map(id, second.requests))
    sched.mark_in_flight(second)
    sample_all(first, sched.commit(first))
    assert not sched.in_flight & set(first.requests)
    third = sched.schedule()
    assert not set(map(id, second.requests)) & set(map(id, third.requests))


def in_flight_batch(*requests: Request) -> ScheduledBatch:
    batch = ScheduledBatch()
    for r in requests:
        batch.add(r, 1)
    return batch


def test_victim_is_the_newest_request_not_in_flight():
    sched = make_scheduler("sarathi", BlockManager(4, 4), 64, 8)  # 16 slots
    old, new = make("old", 8), make("new", 8)
    for r in (old, new):
        sched.add_request(r)
    batch = sched.schedule()  # 2 + 2 blocks: the cache is full
    sample_all(batch, sched.commit(batch))  # 9 tokens each: a decode needs a third block
    sched.mark_in_flight(in_flight_batch(new))  # `new` is out in another micro-batch
    nxt = sched.schedule()
    # `old` cannot grow. Without a pipeline `new` (the newest) would be preempted; it is in
    # flight, so `old` yields itself instead.
    assert new.status is RequestStatus.RUNNING and new.block_ids and new not in nxt.preempted
    assert nxt.preempted == [old] and old.status is RequestStatus.WAITING
    assert not nxt.requests


def test_without_a_pipeline_the_newest_is_preempted():
    sched = make_scheduler("sarathi", BlockManager(4, 4), 64, 8)
    old, new = make("old", 8), make("new", 8)
    for r in (old, new):
        sched.add_request(r)
    batch = sched.schedule()
    sample_all(batch, sched.commit(batch))
    nxt = sched.schedule()
    assert nxt.preempted == [new] and nxt.requests == [old]


def test_abort_in_flight_is_skipped_by_commit():
    sched = make_scheduler("sarathi", BlockManager(16, 4), 64, 8)
    a, b = make("a", 5), make("b", 5)
    for r in (a, b):
        sched.add_request(r)
    batch = sched.schedule()
    sched.mark_in_flight(batch)
    sched.finish(a, RequestStatus.FINISHED_ABORTED)
    assert a not in sched.in_flight and a.block_ids == []
    ready = sched.commit(batch)
    assert ready == [b] and a.num_computed_tokens == 0 and not sched.in_flight
