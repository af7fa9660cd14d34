"""The simulator's scheduling and block accounting equal the engine's on the same requests."""

from __future__ import annotations

import pytest

from carpool.harness.workload import RequestSpec
from carpool.sampling_params import SamplingParams
from carpool.sim.cost_model import FormulaCostModel
from carpool.sim.simulator import ReplicaConfig, simulate
from tests.helpers import scheduler_config

LENGTHS = [(40, 6), (7, 12), (90, 4), (23, 9), (61, 7), (15, 10)]


@pytest.mark.parametrize("policy, caching", [("sarathi", False), ("vllm", False), ("orca", False),
                                             ("sarathi", True), ("vllm", True)])
def test_same_batches_and_free_blocks_as_the_engine(engine_fp32, policy, caching):
    """The prompts share their first tokens, so with prefix caching both hit the same blocks."""
    num_blocks, budget = 14, 32  # 224 slots for ~280 tokens in all: sarathi must preempt
    records = []
    with scheduler_config(engine_fp32, budget=budget, num_blocks=num_blocks, policy=policy,
                          prefix_caching=caching) as engine:
        sched = engine.scheduler
        real_schedule = sched.schedule

        def recording_schedule():
            batch = real_schedule()
            records.append(([(int(r.request_id), n) for r, n in zip(batch.requests, batch.num_tokens)],
                            engine.block_manager.num_free_blocks))
            return batch

        sched.schedule = recording_schedule
        for i, (p, o) in enumerate(LENGTHS):
            engine.add_request([100 + j for j in range(p)], SamplingParams(max_tokens=o, ignore_eos=True),
                               request_id=str(i))
        while engine.has_unfinished_requests():
            engine.step()
        engine_preemptions = sched.num_preemptions
        engine_hits = sched.prefix_cache_hits

    same_prompts = [RequestSpec(i, 0.0, [100 + j for j in range(p)], o) for i, (p, o) in enumerate(LENGTHS)]
    sim = simulate(same_prompts,
                   ReplicaConfig(scheduler=policy, max_num_batched_tokens=budget, num_blocks=num_blocks,
                                 block_size=engine_fp32.block_manager.block_size,
                                 max_model_len=engine_fp32.max_model_len, enable_prefix_caching=caching),
                   FormulaCostModel())
    sim_records = [([(int(r.request_id.removeprefix("sim-")), n) for r, n in zip(mb.batch.requests, mb.batch.num_tokens)],
                    mb.free_blocks) for mb in sim.micro_batches]
    assert sim_records == [r for r in records if r[0]]
    assert sum(r.num_preemptions for r in sim.requests) == engine_preemptions
    assert sum(r.num_cached_tokens for r in sim.requests) == engine_hits
    if caching:
        assert engine_hits > 0
    if policy == "sarathi" and not caching:  # (the shared prefix saves enough memory to avoid it)
        assert engine_preemptions > 0
