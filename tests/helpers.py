"""Test helpers that drive the engine's parts directly."""

from __future__ import annotations

import contextlib
import os

from carpool.core.block_manager import BlockManager, blocks_for
from carpool.core.scheduler import make_scheduler
from carpool.sampling_params import SamplingParams

EXAMPLE_SCALE = {"dev": 0.25, "ci": 1.0}[os.environ.get("HYPOTHESIS_PROFILE", "dev")]


def examples(n: int) -> int:
    """How many examples a property test runs: `n` under the `ci` profile, a quarter under `dev`
    (tests/conftest.py), never fewer than 2."""
    return max(2, round(n * EXAMPLE_SCALE))


@contextlib.contextmanager
def scheduler_config(engine, budget: int = 512, max_num_seqs: int = 256, num_blocks: int | None = None,
                     policy: str = "sarathi", prefix_caching: bool | None = None, target_tbt: float | None = None):
    """Run the engine with another budget / a smaller KV cache (a prefix of its blocks), with a
    fresh prefix cache (on or off; default: as the engine's). On exit the engine's own prefix
    cache is dropped: the blocks it names may have been rewritten with other tokens' KV."""
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
        assert engine.reset_prefix_cache()


@contextlib.contextmanager
def nan_in_unwritten_blocks(engine):
    """Fill every block that holds no KV yet with NaN just before each batch runs (after the
    scheduler gave the batch its blocks): free blocks, and a request's blocks past its computed
    tokens. Cached prefix blocks and blocks with computed tokens are left alone. A slot read
    before it is written then shows (stale finite values would hide it). Single-process engines
    only: with a pipeline, in-flight micro-batches write blocks while the next batch is planned."""

    def poison(batch) -> None:
        bm = engine.block_manager  # read per batch: scheduler_config swaps it
        live = set(bm.cached())
        for r in engine.scheduler.running:
            live.update(r.block_ids[:blocks_for(r.num_computed_tokens, bm.block_size)])
        dead = [b for b in range(bm.num_blocks) if b not in live]
        blocks[:, :, dead] = float("nan")

    blocks = engine.runner.kv_cache.unflatten(2, (-1, engine.block_manager.block_size))
    remove = engine.add_batch_observer(poison)
    try:
        yield engine
    finally:
        remove()


def run_greedy(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    reqs = [engine.add_request(p, sp) for p in prompts]
    while engine.has_unfinished_requests():
        engine.step()
    return [r.output_token_ids for r in reqs]

