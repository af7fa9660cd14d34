"""Which requests run in the next iteration, and how many of their tokens.

`Scheduler` owns the shared primitives: the waiting queue, the running list, the block manager,
the per-iteration token budget, and preemption by recompute. A policy is a small subclass that
only decides the order and size of grants in `schedule()`.

Prefix caching lives in the block manager; the scheduler only asks it, when a waiting request
comes up for admission, which cached blocks hold the start of its tokens (`lookup`): the request
takes them and its `num_computed_tokens` starts after them, so every policy grants only the rest,
whether it chunks or not. A preempted request looks its own blocks up again when readmitted. In
`commit`, blocks that the batch filled are registered with the cache.

Speculative tokens (carpool/spec) are granted last, from what the budget leaves: a decode whose
request holds a proposal (`spec_token_ids`) may score some of those tokens in the same step
(`schedule_drafts`). They are budget tokens like any other, but never preempt anything and never
hold back a prefill chunk. `commit` counts only the request's own tokens as computed; the engine
then accepts drafts one by one as verification keeps them (`accept_draft`) and gives back the
blocks of the rejected ones (`end_verification`).

With pipeline parallelism several micro-batches are in flight at once. A request whose micro-batch
has not returned is `in_flight`: every primitive below skips it (no grant, never a preemption
victim) until `commit` brings it back, so policies need no pipeline-specific code.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from carpool.core.block_manager import BlockManager
from carpool.core.step_cost import BatchShape, ChunkSizes, StepCostModel
from carpool.request import Request, RequestStatus
from carpool.spec.acceptance import SpecState, reachable


@dataclass
class ScheduledBatch:
    """One iteration's plan: decodes first, then prefill chunks, each with its token grant.
    Whether an entry is a decode is fixed when it is scheduled (the request moves on later)."""

    requests: list[Request] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)
    is_decode: list[bool] = field(default_factory=list)
    drafts: list[list[int]] = field(default_factory=list)  # speculative tokens in each grant (decodes only)
    preempted: list[Request] = field(default_factory=list)
    # Set by policies that plan in time (SloSarathiScheduler): the shape as planned, its
    # predicted seconds, and whether even its decodes alone were predicted over the target.
    shape: BatchShape | None = None
    predicted_time: float | None = None
    slo_unreachable: bool = False

    def add(self, request: Request, num_tokens: int) -> None:
        self.requests.append(request)
        self.num_tokens.append(num_tokens)
        self.is_decode.append(request.is_decode)
        self.drafts.append([])

    def set_drafts(self, i: int, drafts: list[int]) -> None:
        """Entry `i` (a decode) also scores these speculative tokens after its own."""
        self.num_tokens[i] += len(drafts) - len(self.drafts[i])
        self.drafts[i] = drafts

    def drafts_of(self, requests: list[Request]) -> list[list[int]]:
        """The drafts granted to each of `requests` (all in this batch)."""
        granted = dict(zip(self.requests, self.drafts))
        return [granted[r] for r in requests]

    def remove(self, request: Request) -> None:
        i = next(i for i, r in enumerate(self.requests) if r is request)
        del self.requests[i], self.num_tokens[i], self.is_decode[i], self.drafts[i]

    def __contains__(self, request: Request) -> bool:
        return any(r is request for r in self.requests)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_tokens)

    @property
    def num_draft_tokens(self) -> int:
        return sum(len(d) for d in self.drafts)

    @property
    def num_decode_tokens(self) -> int:
        """Decodes' own tokens (one each), drafts not included."""
        return sum(1 for d in self.is_decode if d)

    @property
    def num_prefill_tokens(self) -> int:
        return self.total_tokens - self.num_decode_tokens - self.num_draft_tokens

    def ordered(self) -> ScheduledBatch:
        """Decodes first (the model runner batches their attention together), then prefill chunks."""
        order = sorted(range(len(self.requests)), key=lambda i: not self.is_decode[i])
        return ScheduledBatch([self.requests[i] for i in order], [self.num_tokens[i] for i in order],
                              [self.is_decode[i] for i in order], [self.drafts[i] for i in order],
                              self.preempted, self.shape, self.predicted_time, self.slo_unreachable)


class Scheduler:
    """Shared state and primitives; subclasses implement `schedule`."""

    name = "base"
    # Whether a step never gives one request more than the token budget (chunked prompts, no
    # reservation ahead): sliding-window layers' KV is then bounded per request (BlockManager).
    steps_within_budget = False

    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int | None = None):
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        # Every running request needs one token per decode iteration, so more running requests
        # than the budget could never all decode together.
        self.max_num_seqs = min(max_num_seqs, max_num_batched_tokens)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.in_flight: set[Request] = set()  # running, but their micro-batch has not returned
        self.num_preemptions = 0
        # Prefix cache, in tokens, over first admissions: prompt tokens looked up and found.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.clock: Callable[[], float] = time.monotonic  # the simulator swaps in simulated time

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
        self.in_flight.discard(request)
        self.block_manager.free(request)
        request.grammar = None  # a structured-output matcher is freed with the request's blocks
        request.status = status
        request.finished_time = self.clock()

    def commit(self, batch: ScheduledBatch) -> list[Request]:
        """The batch ran: advance computed tokens; return the requests whose output to sample.
        Requests finished (aborted) while the batch was in flight are skipped."""
        ready = []
        for request, n, drafts in zip(batch.requests, batch.num_tokens, batch.drafts):
            if request.status is not RequestStatus.RUNNING:
                continue
            n -= len(drafts)  # a draft's KV counts once verification keeps it (accept_draft)
            request.num_computed_tokens += n
            self.block_manager.cache_blocks(request, request.num_computed_tokens - n, request.num_computed_tokens)
            if request.num_computed_tokens == request.num_tokens:
                ready.append(request)
        if self.in_flight:
            self.in_flight.difference_update(batch.requests)
        return ready

    def accept_draft(self, request: Request) -> None:
        """Verification kept the request's next draft: its KV, written by the step, is valid."""
        request.num_computed_tokens += 1
        self.block_manager.cache_blocks(request, request.num_computed_tokens - 1, request.num_computed_tokens)

    def end_verification(self, request: Request) -> None:
        """Give back the blocks that only rejected drafts reached (their slots are rewritten
        before they are read again), but none a policy reserved up front."""
        if request.status is RequestStatus.RUNNING:
            self.block_manager.trim(request, max(request.num_tokens, self.tokens_to_reserve(request, 0)))

    def observe(self, batch: ScheduledBatch, seconds: float) -> None:
        """The batch took `seconds` (measured by the engine, or simulated); policies that
        predict step times learn from it."""

    def mark_in_flight(self, batch: ScheduledBatch) -> None:
        """The batch was submitted to a pipeline: hold its requests until `commit`."""
        self.in_flight.update(batch.requests)

    def schedulable(self) -> list[Request]:
        """Running requests that may be granted tokens now (not in flight)."""
        if not self.in_flight:
            return self.running
        return [r for r in self.running if r not in self.in_flight]

    # ------------------------------------------------------------ primitives for policies
    def budget_left(self, batch: ScheduledBatch) -> int:
        return self.max_num_batched_tokens - batch.total_tokens

    def chunk_size(self, start: int, remaining: int, batch: ScheduledBatch) -> int:
        """Tokens to grant a prompt whose next chunk starts at token `start` with `remaining`
        tokens left, given what `batch` holds already: here, whatever the token budget leaves."""
        return min(remaining, self.budget_left(batch))

    def preempt(self, victim: Request, batch: ScheduledBatch) -> None:
        """Recompute-style preemption: drop the KV, requeue at the front, refund any grant."""
        self.running.remove(victim)
        if victim in batch:
            batch.remove(victim)
        self.block_manager.free(victim)
        victim.num_computed_tokens = 0
        victim.spec_token_ids = []
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
            # The newest running request whose micro-batch is not in flight (`request` itself at worst).
            victim = self.running[-1] if not self.in_flight else next(
                r for r in reversed(self.running) if r not in self.in_flight)
            self.preempt(victim, batch)
            if victim is request:
                return False
        batch.add(request, num_tokens)
        return True

    def lookup(self, request: Request) -> tuple[list[int], int]:
        """For a waiting request: the cached blocks it would start from (see BlockManager
        .cached_prefix), and how many of its tokens would still need computing."""
        cached = self.block_manager.cached_prefix(request)
        return cached, request.num_uncomputed_tokens - len(cached) * self.block_manager.block_size

    def admit(self, request: Request, num_tokens: int, batch: ScheduledBatch, cached: Sequence[int] = ()) -> bool:
        """Move the oldest waiting request to running with a first grant of `num_tokens` after
        its `cached` prefix blocks (from `lookup`), if blocks allow. Nothing is admitted in a step
        that had to preempt: memory is short, and a victim taken straight back would only thrash."""
        if len(self.running) >= self.max_num_seqs or batch.preempted:
            return False
        start = request.num_computed_tokens + len(cached) * self.block_manager.block_size
        reserve = max(start + num_tokens, self.tokens_to_reserve(request, num_tokens))
        if not self.block_manager.allocate(request, reserve, cached):
            return False
        request.num_computed_tokens = start
        if request.first_scheduled_time is None and self.block_manager.enable_prefix_caching:
            request.num_cached_tokens = start
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += start
        self.waiting.popleft()
        request.status = RequestStatus.RUNNING
        if request.first_scheduled_time is None:
            request.first_scheduled_time = self.clock()
        self.running.append(request)
        batch.add(request, num_tokens)
        return True

    def tokens_to_reserve(self, request: Request, num_tokens: int) -> int:
        """KV slots to hold on admission; by default only what this grant needs."""
        return request.num_computed_tokens + num_tokens

    def running_decodes(self) -> list[Request]:
        return [r for r in self.schedulable() if r.is_decode]

    def running_prefills(self) -> list[Request]:
        return [r for r in self.schedulable() if not r.is_decode]

    @staticmethod
    def still_running(requests: Iterable[Request]) -> Iterable[Request]:
        """Iterate a snapshot, skipping requests preempted earlier in the same pass."""
        return (r for r in list(requests) if r.status is RequestStatus.RUNNING)

    # ------------------------------------------------------------ building blocks of policies
    def schedule_decodes(self, batch: ScheduledBatch) -> None:
        """One token for every running decode (preempting the newest if blocks run out)."""
        for request in self.still_running(self.running_decodes()):
            self.grant_running(request, 1, batch)

    def continue_prefills(self, batch: ScheduledBatch) -> None:
        """Next chunk of each in-progress prompt, cut to the budget left."""
        for request in self.still_running(self.running_prefills()):
            n = self.chunk_size(request.num_computed_tokens, request.num_uncomputed_tokens, batch)
            if n <= 0:
                break
            self.grant_running(request, n, batch)

    def admit_chunks(self, batch: ScheduledBatch) -> None:
        """Admit waiting prompts FCFS; the last one admitted may get only a first chunk."""
        while self.waiting and self.budget_left(batch) > 0:
            request = self.waiting[0]
            cached, uncomputed = self.lookup(request)
            start = request.num_computed_tokens + len(cached) * self.block_manager.block_size
            n = self.chunk_size(start, uncomputed, batch)
            if n <= 0 or not self.admit(request, n, batch, cached):
                break

    def admit_whole_prompts(self, batch: ScheduledBatch) -> None:
        """Admit waiting prompts FCFS, each whole, while they fit the budget. A prompt larger than
        the budget still goes alone into an iteration without other prefills (else it never runs)."""
        while self.waiting:
            request = self.waiting[0]
            cached, n = self.lookup(request)
            if n > self.budget_left(batch) and batch.num_prefill_tokens > 0:
                break
            if not self.admit(request, n, batch, cached):
                break

    def schedule_drafts(self, batch: ScheduledBatch) -> None:
        """Last, with what the budget leaves: speculative tokens for decodes whose request holds
        a proposal. Drafts never preempt: where blocks run short a decode gets none."""
        for i, request in enumerate(batch.requests):
            if not batch.is_decode[i] or not request.spec_token_ids:
                continue
            n = self.draft_size(i, request.spec_token_ids, batch)
            if n > 0 and self.block_manager.allocate(request, request.num_computed_tokens + 1 + n):
                batch.set_drafts(i, request.spec_token_ids[:n])

    def draft_size(self, i: int, proposal: list[int], batch: ScheduledBatch) -> int:
        """How many of entry `i`'s proposed tokens the step takes: those its acceptance record
        says are likely enough to be kept (spec/acceptance.py), as far as the budget goes."""
        spec = batch.requests[i].spec  # (a request whose drafts keep failing asks for one probe)
        likely = len(proposal) if spec is None else max(1, reachable(spec, len(proposal)))
        return min(likely, self.budget_left(batch))

    def schedule(self) -> ScheduledBatch:
        raise NotImplementedError


class SarathiScheduler(Scheduler):
    """Stall-free hybrid batching (Sarathi-Serve): all running decodes first, then continue
    in-progress prefills, then admit new prompts FCFS, each chunk cut to the budget left."""

    name = "sarathi"
    steps_within_budget = True

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        self.schedule_decodes(batch)
        self.continue_prefills(batch)
        self.admit_chunks(batch)
        self.schedule_drafts(batch)
        return batch.ordered()


class SloSarathiScheduler(SarathiScheduler):
    """Sarathi whose token budget follows a latency target instead of a fixed token count.

    Each iteration schedules every running decode (never dropped), then gives each prefill the
    longest chunk for which the *predicted* step time -- the decodes' count and contexts plus the
    chunks so far, their lengths and cached prefixes -- stays within `target_tbt`. Predictions
    come from a `StepCostModel` fitted online to the steps that ran (`observe`). When the decodes
    alone are predicted over the target the step runs decodes only and is counted as
    `slo_unreachable`; a step with no decodes still gets a small first chunk (else prompts would
    starve). `max_num_batched_tokens` stays a hard cap, and a chunk never exceeds twice the
    largest step the fit has seen (its trust region) until it has seen larger ones.
    `chunk_sizes` snaps chunks to sizes the machine runs fastest, when a sweep shows slow ones.

    `strict=False` makes the target a comfort level rather than an SLO (the engine's default
    target): a step may always take twice what its decodes alone are predicted to take, so on a
    model too slow for the target prompts still get half of each step; and a step with no
    decodes takes the whole token budget, since no stream waits on it (a lone 256-token prompt
    on a 1B model: TTFT 0.83 s in one step against 1.88 s in target-sized chunks). Held strictly,
    decodes that alone fill the target keep every prompt waiting until they finish."""

    name = "sarathi"
    steps_within_budget = True
    MIN_CHUNK = 16  # the first chunk of a step without decodes, even when the target is unreachable

    def __init__(self, *args, target_tbt: float, cost: StepCostModel | None = None,
                 chunk_sizes: ChunkSizes | None = None, strict: bool = True, **kwargs):
        super().__init__(*args, **kwargs)
        self.cost = cost or StepCostModel()
        self.strict = strict
        self.set_target(target_tbt)
        self.chunk_sizes = chunk_sizes
        self.num_slo_unreachable = 0

    def set_target(self, target_tbt: float) -> None:
        if not (target_tbt > 0 and target_tbt < float("inf")):
            raise ValueError(f"target TBT must be a positive number of seconds, got {target_tbt}")
        self.target_tbt = target_tbt
        self.step_limit = target_tbt  # the seconds this step's chunks may fill (see schedule)
        self.cost.margin_from = target_tbt / 2  # the margin of the steps this target plans

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        self.schedule_decodes(batch)
        decoding = bool(batch.requests)
        decodes_only = self.cost.upper(BatchShape.of(batch))
        self.step_limit = self.target_tbt if self.strict else max(self.target_tbt, 2 * decodes_only)
        if not self.strict and not decoding:
            self.step_limit = float("inf")  # no stream is waiting for its next token: the fixed budget
        if decoding and decodes_only > self.step_limit:
            batch.slo_unreachable = True
        else:
            self.continue_prefills(batch)
            self.admit_chunks(batch)
            self.schedule_drafts(batch)
        batch.shape = BatchShape.of(batch)
        batch.predicted_time = self.cost.upper(batch.shape)
        if batch.requests and batch.predicted_time > self.target_tbt and (self.strict or decoding):
            batch.slo_unreachable = True
        self.num_slo_unreachable += batch.slo_unreachable
        return batch.ordered()

    def chunk_size(self, start: int, remaining: int, batch: ScheduledBatch) -> int:
        cap = min(remaining, self.budget_left(batch), self.cost.trusted_tokens() - batch.total_tokens)
        if cap <= 0:
            return 0
        base = BatchShape.of(batch)
        fits = lambda n: self.cost.upper(base.with_chunk(n, start, n == remaining)) <= self.step_limit  # noqa: E731
        lo, hi = 0, cap  # fits(lo) holds (no chunk); find the largest n <= cap that fits
        if fits(hi):
            lo = hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        n = lo
        if n < remaining and self.chunk_sizes is not None and n > 0:
            n = self.chunk_sizes.snap(n)
        if n == 0 and not batch.requests:
            n = min(cap, self.MIN_CHUNK)
        return n

    def schedule_drafts(self, batch: ScheduledBatch) -> None:
        """Drafts by their worth, with the step-time fit pricing them. A request's j-th draft is
        kept with the chance its record gives (SpecState.keep_chance, spec/acceptance.py), so it
        yields that many tokens on average; drafts are taken most likely first while each one's
        expected tokens per second of predicted step time it adds is at least the rate of the
        decodes' own step with the drafts taken so far, and the step stays within the target
        (never the relaxed limit a non-strict step may take for prefills: drafts are optional
        work). On a batch of one a draft costs a fraction of a token's step and nearly all are
        taken; once a batch is large enough to be compute-bound, a draft costs what a token costs
        and only the likeliest are. A step that carries a prefill chunk takes none: drafts would
        lengthen it, and that chunk (its stream's first token) and every decode in it would wait
        for them."""
        if batch.num_prefill_tokens or not any(r.spec_token_ids for r, d in zip(batch.requests, batch.is_decode) if d):
            return
        limit = min(self.step_limit, self.target_tbt)
        worth = sorted(((r.spec or SpecState()).keep_chance(j), -j, i)
                       for i, r in enumerate(batch.requests) if batch.is_decode[i]
                       for j in range(len(r.spec_token_ids)))
        shape = BatchShape.of(batch)
        before = self.cost.predict(shape)
        # The rate to match: the decodes' own step (a step's prefill chunks make nobody's tokens).
        seconds = self.cost.predict(BatchShape(decode_contexts=shape.decode_contexts))
        tokens = float(batch.num_decode_tokens)
        cap = min(self.max_num_batched_tokens, self.cost.trusted_tokens())
        for gain, j, i in reversed(worth):
            proposal, taken = batch.requests[i].spec_token_ids, len(batch.drafts[i])
            if -j != taken or batch.total_tokens >= cap:
                continue  # an earlier draft of this request was not taken (or no room is left)
            batch.set_drafts(i, proposal[:taken + 1])
            shape = BatchShape.of(batch)
            after = self.cost.predict(shape)
            if after * self.cost.margin_for(shape) > limit or gain * seconds < tokens * (after - before):
                batch.set_drafts(i, proposal[:taken])
                continue
            seconds, tokens, before = seconds + after - before, tokens + gain, after
        for i, request in enumerate(batch.requests):
            drafts = batch.drafts[i]
            if drafts and not self.block_manager.allocate(request, request.num_computed_tokens + 1 + len(drafts)):
                batch.set_drafts(i, [])  # drafts never preempt

    def observe(self, batch: ScheduledBatch, seconds: float) -> None:
        self.cost.observe(batch.shape or BatchShape.of(batch), seconds)


class HybridOnlyScheduler(Scheduler):
    """Ablation: hybrid batches of decodes and whole prompts, no chunking."""

    name = "hybrid-only"

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        self.schedule_decodes(batch)
        self.admit_whole_prompts(batch)
        self.schedule_drafts(batch)
        return batch.ordered()


class ChunkedOnlyScheduler(Scheduler):
    """Ablation: chunked prefill without mixing; prefill-chunk and decode iterations alternate."""

    name = "chunked-only"
    steps_within_budget = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._prefill_turn = True

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        if self._prefill_turn or not self.running_decodes():
            self.continue_prefills(batch)
            self.admit_chunks(batch)
        if not batch.requests:
            self.schedule_decodes(batch)
            self.schedule_drafts(batch)
        self._prefill_turn = not batch.num_prefill_tokens
        return batch.ordered()


class VllmScheduler(Scheduler):
    """vLLM v0: prefill-prioritising. Whole waiting prompts run in a prefill-only iteration
    whenever any fit; otherwise all running requests decode. Running decodes stall meanwhile."""

    name = "vllm"

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        self.admit_whole_prompts(batch)
        if not batch.requests:
            self.schedule_decodes(batch)
            self.schedule_drafts(batch)
        return batch.ordered()


def reserve_max_length(scheduler: Scheduler, request: Request, num_tokens: int) -> int:
    """Hold KV for the request's whole possible length from admission on: it never preempts."""
    full = request.num_prompt_tokens + request.sampling_params.max_tokens
    return min(full, scheduler.max_model_len) if scheduler.max_model_len else full


class OrcaScheduler(HybridOnlyScheduler):
    """Orca: iteration-level batching of decodes with whole prompts, KV reserved up front."""

    name = "orca"
    tokens_to_reserve = reserve_max_length


class RequestLevelScheduler(Scheduler):
    """FasterTransformer-style: admit a batch only when nothing runs, decode it to completion."""

    name = "request-level"
    tokens_to_reserve = reserve_max_length

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        if not self.running:
            self.admit_whole_prompts(batch)
        else:
            self.schedule_decodes(batch)
            self.schedule_drafts(batch)
        return batch.ordered()


SCHEDULERS: dict[str, type[Scheduler]] = {cls.name: cls for cls in (
    SarathiScheduler, VllmScheduler, OrcaScheduler, RequestLevelScheduler, ChunkedOnlyScheduler,
    HybridOnlyScheduler)}


def make_scheduler(name: str, block_manager: BlockManager, max_num_batched_tokens: int,
                   max_num_seqs: int, max_model_len: int | None = None, target_tbt: float | None = None,
                   cost: StepCostModel | None = None, chunk_sizes: ChunkSizes | None = None,
                   strict: bool = True) -> Scheduler:
    """A policy by name; with `target_tbt` (seconds), sarathi's budget follows that target
    (`strict`: as an SLO; else as a comfort level, see SloSarathiScheduler)."""
    if name not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {name!r}; choose from {', '.join(SCHEDULERS)}")
    if target_tbt is not None:
        if name != "sarathi":
            raise ValueError(f"a target TBT sets sarathi's token budget; scheduler {name!r} has none to set")
        return SloSarathiScheduler(block_manager, max_num_batched_tokens, max_num_seqs, max_model_len,
                                   target_tbt=target_tbt, cost=cost, chunk_sizes=chunk_sizes, strict=strict)
    return SCHEDULERS[name](block_manager, max_num_batched_tokens, max_num_seqs, max_model_len)
