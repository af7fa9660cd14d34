"""`python -m carpool.bench.prefix_overhead` replays the burst with and without the cache."""

from __future__ import annotations

from carpool.bench.prefix_overhead import burst_workload, replay


def test_replay_is_the_same_schedule_either_way():
    specs = burst_workload()
    assert len(specs) == 16 and sum(s.prompt_len for s in specs) == 9626
    (_, on), (_, off) = replay(specs, True), replay(specs, False)
    assert on == off > 0  # random prompts share no block: the cache changes nothing but its cost
