"""Which requests run in the next iteration, and how many of their tokens.

`Scheduler` owns the shared primitives: the waiting queue, the running list, the block manager,
the per-iteration token budget, and preemption by recompute. A policy is a small subclass that
only decides the order and size of grants in `schedule()`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from carpool.core.block_manager import BlockManager
from carpool.request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    """One iteration's plan: decodes first, then prefill chunks, each with its token grant."""

    requests: list[Request] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    def add(self, request: Request, num_tokens: int) -> None:
        self.requests.append(request)
        self.num_tokens.append(num_tokens)

    def remove(self, request: Request) -> None:
        i = self.requests.index(request)
        del self.requests[i], self.num_tokens[i]

    def __contains__(self, request: Request) -> bool:
        return any(r is request for r in self.requests)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    @property
    def num_decode_tokens(self) -> int:
        return sum(n for r, n in zip(self.requests, self.num_tokens) if r.is_decode)

    @property
    def num_prefill_tokens(self) -> int:
        return self.total_tokens - self.num_decode_tokens

    def ordered(self) -> ScheduledBatch:
        """Decodes first: the model runner batches their attention together."""
        pairs = sorted(zip(self.requests, self.num_tokens), key=lambda p: not p[0].is_decode)
        return ScheduledBatch([r for r, _ in pairs], [n for _, n in pairs], self.preempted)


class Scheduler:
    """Shared state and primitives; subclasses implement `schedule`."""

    name = "base"

    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int):
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        # Every running request needs one token per decode iteration, so more running requests
        # than the budget could never all decode together.
        self.max_num_seqs = min(max_num_seqs, max_num_batched_tokens)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ------------------------------------------------------------ queue management
    def add_request(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Release everything a request holds; safe to call for waiting or running requests."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING and request in self.waiting:
            self.waiting.remove(request)
        self.block_manager.free(request)
        request.status = status
        request.finished_time = time.monotonic()

    def commit(self, batch: ScheduledBatch) -> list[Request]:
        """The batch ran: advance computed tokens; return the requests whose output to sample."""
        ready = []
        for request, n in zip(batch.requests, batch.num_tokens):
            request.num_computed_tokens += n
            if request.num_computed_tokens == request.num_tokens:
                ready.append(request)
        return ready

    # ------------------------------------------------------------ primitives for policies
    def budget_left(self, batch: ScheduledBatch) -> int:
        return self.max_num_batched_tokens - batch.total_tokens

    def preempt(self, victim: Request, batch: ScheduledBatch) -> None:
        """Recompute-style preemption: drop the KV, requeue at the front, refund any grant."""
        self.running.remove(victim)
        if victim in batch:
            batch.remove(victim)
        self.block_manager.free(victim)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        batch.preempted.append(victim)

    def grant_running(self, request: Request, num_tokens: int, batch: ScheduledBatch) -> bool:
        """Give a running request `num_tokens` tokens, preempting the newest running requests
        while blocks run short. False if the request itself had to be preempted."""
        target = request.num_computed_tokens + num_tokens
        while not self.block_manager.allocate(request, target):
            victim = self.running[-1]
            self.preempt(victim, batch)
            if victim is request:
                return False
        batch.add(request, num_tokens)
        return True

    def admit(self, request: Request, num_tokens: int, batch: ScheduledBatch) -> bool:
        """Move the oldest waiting request to running with a first grant, if blocks allow.
        Nothing is admitted in a step that had to preempt: memory is short, and a victim taken
        straight back would only thrash."""
        if len(self.running) >= self.max_num_seqs or batch.preempted:
            return False
        if not self.block_manager.allocate(request, request.num_computed_tokens + num_tokens):
            return False
        self.waiting.popleft()
        request.status = RequestStatus.RUNNING
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        self.running.append(request)
        batch.add(request, num_tokens)
        return True

    def running_decodes(self) -> list[Request]:
        return [r for r in self.running if r.is_decode]

    def running_prefills(self) -> list[Request]:
        return [r for r in self.running if not r.is_decode]

    @staticmethod
    def still_running(requests: Iterable[Request]) -> Iterable[Request]:
        """Iterate a snapshot, skipping requests preempted earlier in the same pass."""
        return (r for r in list(requests) if r.status is RequestStatus.RUNNING)

    def schedule(self) -> ScheduledBatch:
        raise NotImplementedError


class SarathiScheduler(Scheduler):
    """Stall-free hybrid batching (Sarathi-Serve): all running decodes first, then continue
    in-progress prefills, then admit new prompts FCFS, each chunk cut to the budget left."""

    name = "sarathi"

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        for request in self.still_running(self.running_decodes()):
            self.grant_running(request, 1, batch)
        for request in self.still_running(self.running_prefills()):
            n = min(request.num_uncomputed_tokens, self.budget_left(batch))
            if n <= 0:
                break
            self.grant_running(request, n, batch)
        while self.waiting and self.budget_left(batch) > 0:
            request = self.waiting[0]
            n = min(request.num_uncomputed_tokens, self.budget_left(batch))
            if not self.admit(request, n, batch):
                break
        return batch.ordered()


SCHEDULERS: dict[str, type[Scheduler]] = {cls.name: cls for cls in (SarathiScheduler,)}


def make_scheduler(name: str, block_manager: BlockManager, max_num_batched_tokens: int,
                   max_num_seqs: int) -> Scheduler:
    if name not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {name!r}; choose from {', '.join(SCHEDULERS)}")
    return SCHEDULERS[name](block_manager, max_num_batched_tokens, max_num_seqs)
