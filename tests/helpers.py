"""Test helpers that drive the engine's parts directly."""

from __future__ import annotations

import contextlib

from carpool.core.block_manager import BlockManager
from carpool.core.scheduler import make_scheduler
from carpool.sampling_params import SamplingParams


@contextlib.contextmanager
def scheduler_config(engine, budget: int = 512, max_num_seqs: int = 256, num_blocks: int | None = None,
                     policy: str = "sarathi", prefix_caching: bool | None = None, target_tbt: float | None = None):
    """Run the engine with another budget / a smaller KV cache (a prefix of its blocks), with a
    fresh prefix cache (on or off; default: as the engine's)."""
    saved = engine.scheduler, engine.block_manager
    if prefix_caching is None:
        prefix_caching = engine.block_manager.enable_prefix_caching
    bm = BlockManager(num_blocks or engine.block_manager.num_blocks, engine.block_manager.block_size,
                      prefix_caching)
    engine.block_manager = bm
    engine.scheduler = make_scheduler(policy, bm, budget, max_num_seqs, engine.max_model_len, target_tbt=target_tbt)
    try:
        yield engine
    finally:
        assert not engine.has_unfinished_requests()
        engine.scheduler, engine.block_manager = saved


def run_greedy(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request(p, sp) for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
    return [r.output_token_ids for r in reqs]

