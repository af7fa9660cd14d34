"""Test helpers that drive the engine's parts directly."""

from __future__ import annotations

import contextlib

import torch

from carpool.core.block_manager import BlockManager
from carpool.core.scheduler import ScheduledBatch, make_scheduler
from carpool.request import Request
from carpool.sampling_params import SamplingParams


@contextlib.contextmanager
def scheduler_config(engine, budget: int = 512, max_num_seqs: int = 256, num_blocks: int | None = None,
                     policy: str = "sarathi"):
    """Run the engine with another budget / a smaller KV cache (a prefix of its blocks)."""
    saved = engine.scheduler, engine.block_manager
    bm = BlockManager(num_blocks or engine.block_manager.num_blocks, engine.block_manager.block_size)
    engine.block_manager = bm
    engine.scheduler = make_scheduler(policy, bm, budget, max_num_seqs)
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


class ManualBatches:
    """Feeds hand-made batches to the model runner, bypassing the scheduler."""

    def __init__(self, engine):
        self.engine = engine
        self.bm = engine.block_manager
        self.requests: list[Request] = []

    def new(self, token_ids: list[int]) -> Request:
        r = Request(f"manual-{len(self.requests)}", list(token_ids), SamplingParams(max_tokens=1 << 20))
        self.requests.append(r)
        return r

    def run(self, grants: list[tuple[Request, int]], all_logits: bool = False) -> torch.Tensor:
        """Run one batch; returns logits of completed requests (or of every row)."""
        batch = ScheduledBatch()
        for r, n in grants:
            assert self.bm.allocate(r, r.num_computed_tokens + n)
            batch.add(r, n)
        batch = batch.ordered()
        runner = self.engine.runner
        if all_logits:
            with torch.inference_mode():
                ids, pos, meta, _ = runner.prepare(batch)
                logits = runner.model.compute_logits(runner.model(ids, pos, runner.kv_cache, meta))
        else:
            logits = runner.execute(batch)
        for r, n in zip(batch.requests, batch.num_tokens):
            r.num_computed_tokens += n
        return logits

    def close(self) -> None:
        for r in self.requests:
            self.bm.free(r)
