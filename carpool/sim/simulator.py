"""Discrete-event simulation of serving replicas, driving carpool's own scheduler classes.

Each replica holds a real `Scheduler` policy and `BlockManager`; only the model is replaced by a
cost model that says how long each pipeline stage works on a batch. Time is simulated: the
scheduler's clock is pointed at the simulation, so the requests it touches carry simulated
timestamps, in the same fields the engine fills. Pipeline stages are servers: a micro-batch
enters stage s when stage s-1 has finished it and stage s is free, up to `num_stages`
micro-batches are in flight, and a request in flight is not scheduled again until its
micro-batch leaves the last stage. Bubbles are not modelled; they emerge from uneven stage times.

Prefix caching runs for real too: requests carry token ids (a workload's, or for bare lengths
ids unique to the request), generated tokens are 0s, and follow-up turns of a conversation
arrive after their previous turn finished, with its prompt and answer in front; so hit rates,
and the prefill the cache saves, are the block manager's own.

Speculative decoding (carpool/spec) runs with the engine's rules and a drawn verification: after
each step a request that sampled is offered drafts as the engine offers them (its acceptance
record, its max_tokens and the context), the scheduler grants them from what the budget leaves,
and the cost model prices them as chunk tokens. Verification keeps draft j with probability
`spec_acceptance` given that the ones before it were kept (a seeded draw), so the number kept
follows a geometric law cut at the number scored.
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, field
from typing import Any

from carpool.core.block_manager import BlockManager
from carpool.core.scheduler import ScheduledBatch, Scheduler, make_scheduler
from carpool.core.step_cost import BatchShape, CostModel, seeded_step_cost
from carpool.request import Request, RequestStatus
from carpool.sampling_params import SamplingParams
from carpool.spec.acceptance import SpecDecodeStats, drafts_to_ask


@dataclass(frozen=True)
class SimRequest:
    """Only lengths matter to a simulation; the benchmark's RequestSpec fits this shape too."""

    arrival_time: float
    prompt_len: int
    output_len: int


@dataclass
class ReplicaConfig:
    scheduler: str = "sarathi"
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 256
    block_size: int = 16
    num_blocks: int = 4096
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    # sarathi only: size each step's prefill to this predicted step time (seconds), as the
    # engine's --target-tbt-ms does, with a step-cost fit learning from the simulated times.
    target_tbt: float | None = None
    snap_chunks: bool = True  # ... and snap chunks to sizes the cost model runs fastest
    seed_fit: bool = False  # ... and seed its fit from the cost model, as the engine's --cost-profile does
    # speculative decoding: up to this many drafts per decode (0: off), each kept with probability
    # spec_acceptance when the drafts before it were; spec_seed seeds the draws
    num_speculative_tokens: int = 0
    spec_acceptance: float = 0.0
    spec_seed: int = 0
    # each step's time is the cost model's times one of these ratios, drawn (seeded by spec_seed):
    # a profile's measured / fitted ratios (FittedCostModel.residuals), so the step-time fit of
    # an SLO-following replica meets the jitter the host shows it, and plans with its margin
    step_jitter: tuple[float, ...] = ()


@dataclass
class MicroBatch:
    replica: int
    batch: ScheduledBatch
    shape: BatchShape
    stage_start: list[float]
    stage_end: list[float]
    waited: float  # time spent ready for a stage that was still busy with an earlier micro-batch
    free_blocks: int  # KV blocks free right after this batch was scheduled
    num_accepted: int = 0  # drafts that verification kept, once it has returned

    @property
    def start(self) -> float:
        return self.stage_start[0]

    @property
    def end(self) -> float:
        return self.stage_end[-1]


@dataclass
class SimResult:
    requests: list[Request]
    micro_batches: list[MicroBatch]
    stage_busy: list[list[float]]  # per replica, per stage: seconds busy
    makespan: float
    unfinished: int
    request_pipeline_wait: dict[str, float] = field(default_factory=dict)
    spec: SpecDecodeStats | None = None  # with speculative decoding: its counters, all replicas
    block_managers: list[BlockManager] = field(default_factory=list)  # per replica, as they ended

    def bubble_fraction(self) -> float:
        """Idle stage-time over total stage-time, between each replica's first and last work."""
        busy = sum(sum(stages) for stages in self.stage_busy)
        total = sum(len(stages) for stages in self.stage_busy) * self.makespan
        return 1.0 - busy / total if total else 0.0


class Replica:
    def __init__(self, index: int, config: ReplicaConfig, cost_model: CostModel, clock,
                 spec_stats: SpecDecodeStats | None = None):
        self.index = index
        self.config = config
        self.cost = cost_model
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        dynamic = {}
        if config.target_tbt is not None:
            fit, sizes = seeded_step_cost(cost_model, config.max_num_batched_tokens, config.max_model_len,
                                          seed=config.seed_fit, snap=config.snap_chunks)
            dynamic = dict(target_tbt=config.target_tbt, cost=fit, chunk_sizes=sizes)
        self.scheduler: Scheduler = make_scheduler(config.scheduler, self.block_manager,
                                                   config.max_num_batched_tokens, config.max_num_seqs,
                                                   config.max_model_len, **dynamic)
        self.scheduler.clock = clock
        self.num_stages = cost_model.num_stages
        self.stage_free = [0.0] * self.num_stages
        self.stage_busy = [0.0] * self.num_stages
        self.in_flight: list[MicroBatch] = []
        self.spec_stats = spec_stats if spec_stats is not None else SpecDecodeStats()
        self.rng = random.Random(f"{config.spec_seed}:{index}")  # verification draws
        self.jitter_rng = random.Random(f"jitter:{config.spec_seed}:{index}")

    @property
    def outstanding(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    def can_launch(self, now: float) -> bool:
        return (len(self.in_flight) < self.num_stages and self.stage_free[0] <= now
                and self.scheduler.has_unfinished_requests())

    def launch(self, now: float) -> MicroBatch | None:
        batch = self.scheduler.schedule()
        if not batch.requests:
            return None
        self.scheduler.mark_in_flight(batch)  # not scheduled again until its micro-batch returns
        shape = BatchShape.of(batch)
        jitter = self.jitter_rng.choice(self.config.step_jitter) if self.config.step_jitter else 1.0
        starts, ends, waited, ready = [], [], 0.0, now
        for s in range(self.num_stages):
            start = max(ready, self.stage_free[s])
            waited += start - ready
            duration = self.cost.stage_time(shape, s) * jitter
            starts.append(start)
            ends.append(start + duration)
            self.stage_free[s] = start + duration
            self.stage_busy[s] += duration
            ready = start + duration
        mb = MicroBatch(self.index, batch, shape, starts, ends, waited, self.block_manager.num_free_blocks)
        self.in_flight.append(mb)
        return mb

    def complete(self, mb: MicroBatch) -> list[Request]:
        """The micro-batch left the last stage: its requests advance and ready ones get a token.
        Returns the requests that finished."""
        self.in_flight.remove(mb)
        now = mb.end
        self.scheduler.observe(mb.batch, mb.end - mb.start)  # as the engine reports a step's time
        finished = []
        ready = self.scheduler.commit(mb.batch)
        for r, drafts in zip(ready, mb.batch.drafts_of(ready)):
            # as the engine's _emit: each token appended, then the next draft accepted if kept
            kept, accepted = self.num_kept(len(drafts)), 0
            while True:
                r.append_token(0, now)
                if r.num_output_tokens >= r.sampling_params.max_tokens or r.num_tokens >= self.config.max_model_len:
                    self.scheduler.finish(r, RequestStatus.FINISHED_LENGTH)
                    finished.append(r)
                    break
                if accepted == kept:
                    break
                self.scheduler.accept_draft(r)
                accepted += 1
            if drafts:
                self.spec_stats.record(len(drafts), accepted)
                self.scheduler.end_verification(r)
                mb.num_accepted += accepted
            if r.spec is not None:
                # as the engine learns: also from the proposal's first draft the step did not score
                unscored = accepted == len(drafts) < len(r.spec_token_ids)
                r.spec.observe(len(drafts), accepted, self.num_kept(1) == 1 if unscored else None)
        self.propose([r for r in ready if r.status is RequestStatus.RUNNING])
        return finished

    def num_kept(self, num_drafts: int) -> int:
        """Drafts verification keeps: each while a uniform draw falls under the acceptance."""
        kept = 0
        while kept < num_drafts and self.rng.random() < self.config.spec_acceptance:
            kept += 1
        return kept

    def propose(self, requests: list[Request]) -> None:
        """Drafts for the next step, as many as the engine's _propose would ask for (their
        tokens are 0s like every generated token here; only their number matters)."""
        k = self.config.num_speculative_tokens
        if not k:
            return
        for r in requests:
            r.spec_token_ids = [0] * drafts_to_ask(r, k, self.config.max_model_len)


def prompt_ids(i: int, w: Any) -> list[int]:
    """A workload item's prompt: its token ids if it has them, else ids no other request shares."""
    ids = getattr(w, "prompt_token_ids", None)
    return list(ids) if ids is not None else [-(i + 1)] * w.prompt_len


def simulate(workload: list, config: ReplicaConfig, cost_model: CostModel,
             num_replicas: int = 1, max_events: int = 50_000_000) -> SimResult:
    """Replay `workload` on `num_replicas` replicas; requests go to the replica with the fewest
    outstanding requests (ties: lowest index). Items with a `parent` (a workload index, see
    `carpool.harness.workload.RequestSpec`) are follow-up turns: they arrive `arrival_time` after
    that request finished, its prompt and output in front of their own tokens."""
    if not 0 <= config.num_speculative_tokens <= 32 or not 0.0 <= config.spec_acceptance <= 1.0:
        raise ValueError(f"speculation needs 0 <= num_speculative_tokens <= 32 and an acceptance in [0, 1], got "
                         f"{config.num_speculative_tokens} and {config.spec_acceptance}")
    if not all(r > 0 for r in config.step_jitter):
        raise ValueError("step_jitter: every ratio must be a positive number of times the predicted step")
    for i, w in enumerate(workload):
        if w.prompt_len < 1 or w.output_len < 1:
            raise ValueError(f"request {i}: prompt and output lengths must be >= 1, got {w}")
        if w.prompt_len + 1 > config.max_model_len:
            raise ValueError(f"request {i}: prompt of {w.prompt_len} tokens exceeds max_model_len "
                             f"{config.max_model_len}")
    clock_now = [0.0]
    clock = lambda: clock_now[0]  # noqa: E731
    spec_stats = SpecDecodeStats()
    replicas = [Replica(i, config, cost_model, clock, spec_stats) for i in range(num_replicas)]
    position = {getattr(w, "index", i): i for i, w in enumerate(workload)}
    followups: dict[int, list[int]] = {}
    for i, w in enumerate(workload):
        if getattr(w, "parent", None) is not None:
            followups.setdefault(position[w.parent], []).append(i)
    # (arrival, workload position, prompt ids): first turns now, follow-ups once their turn is done
    arrivals = sorted((w.arrival_time, i, None) for i, w in enumerate(workload)
                      if getattr(w, "parent", None) is None)
    heapq.heapify(arrivals)
    position_of: dict[str, int] = {}
    requests: list[Request] = []
    done: list[tuple[float, int, MicroBatch]] = []
    seq = itertools.count()
    micro_batches: list[MicroBatch] = []
    now = 0.0
    for _ in range(max_events):
        clock_now[0] = now
        while arrivals and arrivals[0][0] <= now:
            at, i, history = heapq.heappop(arrivals)
            w = workload[i]
            ids = prompt_ids(i, w) if history is None else history + list(w.prompt_token_ids)
            r = Request(f"sim-{i}", ids, SamplingParams(max_tokens=w.output_len, ignore_eos=True), arrival_time=at)
            requests.append(r)
            position_of[r.request_id] = i
            min(replicas, key=lambda rep: (rep.outstanding, rep.index)).scheduler.add_request(r)
        while done and done[0][0] <= now:
            _, _, mb = heapq.heappop(done)
            for r in replicas[mb.replica].complete(mb):
                for j in followups.get(position_of[r.request_id], ()):
                    heapq.heappush(arrivals, (r.finished_time + workload[j].arrival_time, j, list(r.token_ids)))
        for rep in replicas:
            while rep.can_launch(now):
                mb = rep.launch(now)
                if mb is None:
                    break
                micro_batches.append(mb)
                heapq.heappush(done, (mb.end, next(seq), mb))
        candidates = [arrivals[0][0]] if arrivals else []
        candidates += [done[0][0]] if done else []
        candidates += [rep.stage_free[0] for rep in replicas
                       if rep.stage_free[0] > now and len(rep.in_flight) < rep.num_stages
                       and rep.scheduler.has_unfinished_requests()]
        if not candidates:
            break
        now = min(candidates)
    else:
        raise RuntimeError("simulation did not finish within max_events")

    start = min((r.arrival_time for r in requests), default=0.0)
    end = max((mb.end for mb in micro_batches), default=start)
    waits: dict[str, float] = {}
    for mb in micro_batches:
        for r in mb.batch.requests:
            waits[r.request_id] = waits.get(r.request_id, 0.0) + mb.waited
    return SimResult(
        requests=requests,
        micro_batches=micro_batches,
        stage_busy=[rep.stage_busy for rep in replicas],
        makespan=max(end - start, 0.0) if micro_batches else 0.0,
        unfinished=sum(rep.outstanding for rep in replicas),
        request_pipeline_wait=waits,
        spec=spec_stats if config.num_speculative_tokens else None,
        block_managers=[rep.block_manager for rep in replicas],
    )

