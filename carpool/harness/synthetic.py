"""Hand-made batches fed straight to an engine's model runner, bypassing the scheduler.

Benchmarks and the profiler use it to time exact batch shapes (C prefill tokens + D decodes at
context L) with `median_time`; tests use it to compare chunked against one-shot prefill.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable

import torch

from carpool.core.scheduler import ScheduledBatch
from carpool.request import Request
from carpool.sampling_params import SamplingParams


def median_time(fn: Callable[[], object], repeats: int) -> float:
    """Median seconds of `repeats` calls after one warm-up call (the median: a shared host's
    stray slow run moves it least)."""
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


class SyntheticBatches:
    def __init__(self, engine):
        self.engine = engine
        self.block_manager = engine.block_manager
        self.requests: list[Request] = []
        self._ids = itertools.count()

    def new(self, token_ids: list[int]) -> Request:
        r = Request(f"synthetic-{next(self._ids)}", list(token_ids), SamplingParams(max_tokens=1 << 20))
        self.requests.append(r)
        return r

    def with_cached_context(self, context: int, generator: torch.Generator) -> Request:
        """A request in decode state whose first `context` tokens have (random) KV cached."""
        vocab = self.engine.model_config.vocab_size
        r = self.new(torch.randint(vocab, (context + 1,), generator=generator).tolist())
        r.token_ids.append(r.token_ids.pop())  # the last token plays the sampled one
        r.num_prompt_tokens = context
        if not self.block_manager.allocate(r, context + 1):
            raise ValueError("KV cache too small for the synthetic contexts")
        runner = self.engine.runner
        slots = torch.from_numpy(runner.slots_for(r.block_ids, 0, context))
        cache = runner.kv_cache
        noise = torch.randn((cache.shape[0], 2, context, *cache.shape[3:]), generator=generator)
        cache[:, :, slots] = (0.5 * noise).to(cache.dtype)
        r.num_computed_tokens = context
        return r

    def batch(self, grants: list[tuple[Request, int]]) -> ScheduledBatch:
        b = ScheduledBatch()
        for r, n in grants:
            if not self.block_manager.allocate(r, r.num_computed_tokens + n):
                raise ValueError("KV cache too small for this synthetic batch")
            b.add(r, n)
        return b.ordered()

    def run(self, grants: list[tuple[Request, int]], all_logits: bool = False, advance: bool = True
            ) -> torch.Tensor:
        """Run one batch; logits of requests that completed (or of every row). With
        advance=False the requests keep their state, so the same batch can be timed again."""
        batch = self.batch(grants)
        runner = self.engine.runner
        if all_logits:
            with torch.inference_mode():
                plan = runner.plan(batch)
                runner.clear_fresh_tails(plan)  # as `execute` does: SDPA reads whole blocks
                ids, pos, meta = runner.tensors(plan)
                logits = runner.model.compute_logits(runner.forward(ids, pos, meta))
        else:
            logits = runner.execute(batch)
        if advance:
            for r, n in zip(batch.requests, batch.num_tokens):
                r.num_computed_tokens += n
        return logits

    def close(self) -> None:
        for r in self.requests:
            self.block_manager.free(r)
        self.requests.clear()
