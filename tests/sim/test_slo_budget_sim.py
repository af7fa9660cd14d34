"""The SLO-following sarathi in the simulator: the same class, learning from simulated times."""

from __future__ import annotations

import random

import pytest

from carpool.core.block_manager import BlockManager
from carpool.core.scheduler import make_scheduler
from carpool.core.step_cost import BatchShape, ChunkSizes, StepCostModel, chunk_sweep, seeded_step_cost, step_time
from carpool.request import Request, RequestStatus
from carpool.sampling_params import SamplingParams
from carpool.core.cost_profile import FittedCostModel
from carpool.sim.cost_model import FormulaCostModel
from carpool.sim.gpu import GPUS, GpuCostModel, resolve_shape
from carpool.sim.simulator import ReplicaConfig, SimRequest, simulate

# A CPU-like machine: 8 ms per step, 0.27 ms per token, attention over contexts.
COST = FormulaCostModel(fixed=0.008, per_token=2.7e-4, per_context=2e-8)


def workload(n: int = 40, seed: int = 0, qps: float = 3.0) -> list[SimRequest]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(qps)
        out.append(SimRequest(t, rng.randint(100, 1000), rng.randint(8, 64)))
    return out


def test_simulated_steps_stay_near_the_target_and_everything_finishes():
    target = 0.06
    res = simulate(workload(), ReplicaConfig(max_num_batched_tokens=2048, target_tbt=target), COST)
    assert res.unfinished == 0
    times = [mb.end - mb.start for mb in res.micro_batches]
    late = [t for mb, t in zip(res.micro_batches, times) if t > target * 1.05 and not mb.batch.slo_unreachable]
    # Only while the fit is still learning (its first steps) may a step run over.
    assert len(late) <= 5, late
    assert max(mb.batch.num_prefill_tokens for mb in res.micro_batches) > 64  # it did grow chunks


def test_the_simulator_feeds_the_policy_as_the_engine_does():
    """Replaying the simulator's loop by hand -- schedule, run for the cost model's time, observe,
    commit -- gives the same batches: the policy's choices depend only on the times it is fed."""
    reqs = [SimRequest(0.0, p, o) for p, o in [(300, 5), (700, 9), (120, 30), (950, 4), (60, 12)]]
    target = 0.05
    sim = simulate(reqs, ReplicaConfig(max_num_batched_tokens=1024, target_tbt=target, snap_chunks=False), COST)
    sim_batches = [[(r.request_id.removeprefix("sim-"), n) for r, n in zip(mb.batch.requests, mb.batch.num_tokens)]
                   for mb in sim.micro_batches]

    sched = make_scheduler("sarathi", BlockManager(4096, 16), 1024, 256, 8192, target_tbt=target, cost=StepCostModel())
    for i, w in enumerate(reqs):
        sched.add_request(Request(str(i), [-(i + 1)] * w.prompt_len, SamplingParams(max_tokens=w.output_len,
                                                                                   ignore_eos=True)))
    replay = []
    while sched.has_unfinished_requests():
        batch = sched.schedule()
        replay.append([(r.request_id, n) for r, n in zip(batch.requests, batch.num_tokens)])
        sched.observe(batch, step_time(COST, BatchShape.of(batch)))
        for r in sched.commit(batch):
            r.append_token(0, 0.0)
            if r.num_output_tokens >= r.sampling_params.max_tokens:
                sched.finish(r, RequestStatus.FINISHED_LENGTH)
    assert replay == sim_batches


def test_a_fitted_cost_model_reproduces_the_times_it_learned():
    fit = StepCostModel()
    rng = random.Random(0)
    for _ in range(400):
        shape = BatchShape(((rng.randint(1, 512), rng.choice([0, 512])),), (rng.randint(50, 900),) * rng.randint(0, 20))
        fit.observe(shape, step_time(COST, shape))
    probe = BatchShape(((200, 256),), (400,) * 8, 8)
    assert FittedCostModel(fit).stage_time(probe, 0) == pytest.approx(step_time(COST, probe), rel=0.05)


def test_a100_sweep_has_slow_chunk_sizes_and_snapping_avoids_them():
    """The A100 operator profile is a staircase in the token count (GEMM tiles): chunks just past a
    step cost as much as the next step's end, and snap back to it."""
    gpu = GpuCostModel(resolve_shape("mistral-7b"), GPUS["a100"])
    sizes = ChunkSizes.from_sweep(chunk_sweep(gpu, 2048))
    slow = sizes.slow_sizes()
    assert len(slow) > 10
    n = 264  # just past 256
    assert sizes.snap(n) < n and sizes.time(sizes.snap(n)) < 0.9 * sizes.time(n)


def test_seeding_from_a_cost_model_predicts_it():
    fit, sizes = seeded_step_cost(COST, 1024, 4096)
    probe = BatchShape(((128, 512),), (600,) * 10, 10)
    assert fit.predict(probe) == pytest.approx(step_time(COST, probe), rel=0.1)
    assert sizes is not None and sizes.slow_sizes() == []  # a linear machine has no slow sizes
