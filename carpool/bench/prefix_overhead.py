"""`python -m carpool.bench.prefix_overhead`: what prefix caching costs the scheduler and block
manager where no prefix is shared. The 16-request burst of `carpool bench burst` (seed 0, random
prompts) is replayed through the real Sarathi scheduler and block manager with the model replaced
by 'append a token', cache on vs off, best of 20: the difference is the hashing, lookups and
bookkeeping, to set beside the run's model time (BENCHMARKS.md)."""

from __future__ import annotations

import time

from carpool.bench.options import BURST
from carpool.bench.workload import PromptSource, RequestSpec, WorkloadConfig, build_workload
from carpool.core.block_manager import BlockManager
from carpool.core.scheduler import make_scheduler
from carpool.request import Request, RequestStatus
from carpool.sampling_params import SamplingParams


def burst_workload() -> list[RequestSpec]:
    (p_lo, p_hi), (o_lo, o_hi) = BURST["prompt_range"], BURST["output_range"]
    cfg = WorkloadConfig(num_requests=BURST["num_requests"], lengths=BURST["lengths"], min_prompt_len=p_lo,
                         max_prompt_len=p_hi, min_output_len=o_lo, max_output_len=o_hi, arrivals="burst",
                         qps=None, seed=0)
    return build_workload(cfg, PromptSource(word_ids=list(range(1000, 49000))))


def replay(specs: list[RequestSpec], caching: bool) -> tuple[float, int]:
    """Seconds spent scheduling the whole workload, and the number of iterations."""
    bm = BlockManager(11650, 16, caching)
    sched = make_scheduler("sarathi", bm, 512, 256, 8192)
    for s in specs:
        sched.add_request(Request(str(s.index), s.prompt_token_ids, SamplingParams(max_tokens=s.output_len)))
    steps = 0
    t = time.perf_counter()
    while sched.has_unfinished_requests():
        batch = sched.schedule()
        for r in sched.commit(batch):
            r.append_token(7, 0.0)
            if r.num_output_tokens >= r.sampling_params.max_tokens:
                sched.finish(r, RequestStatus.FINISHED_LENGTH)
        steps += 1
    return time.perf_counter() - t, steps


def main() -> None:
    specs = burst_workload()
    for caching in (True, False):
        best, steps = min(replay(specs, caching) for _ in range(20))
        print(f"prefix caching {'on ' if caching else 'off'}: {best * 1e3:.1f} ms for {steps} iterations "
              f"({best / steps * 1e6:.0f} us per iteration), {sum(s.prompt_len for s in specs)} prompt tokens")


if __name__ == "__main__":
    main()
