"""The sampler's greedy reduction in a running engine: torch.max(dim=-1) against the C row_max.

    .venv/bin/python benchmarks/row_max.py [--rows 1,16] [--rounds 6] [--output FILE]

For each batch size, greedy decodes of the embedded model run in turn with the sampler's
reduction as torch's and as csrc/row_max.c's, and each call is timed where it runs (the
logits of a real step, fresh from the LM head). Prints and writes each one's median call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import carpool.sampler as sampler
from carpool import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,16", help="requests decoding at once, comma-separated")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()
    kernel = sampler.row_max
    reductions = {"torch": lambda logits: logits.max(dim=-1), "row_max": kernel}
    llm = LLM(kv_cache_memory="256MiB")
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    result = {}
    for rows in map(int, args.rows.split(",")):
        prompts = [{"prompt_token_ids": list(range(100 + i, 112 + i))} for i in range(rows)]
        calls: dict[str, list[float]] = {name: [] for name in reductions}
        for r in range(args.rounds):
            name = ("torch", "row_max")[r % 2]
            reduce = reductions[name]

            def timed(logits, reduce=reduce, seconds=calls[name]):
                start = time.perf_counter()
                out = reduce(logits)
                seconds.append(time.perf_counter() - start)
                return out

            sampler.row_max = timed
            llm.generate(prompts, params, use_tqdm=False)
        sampler.row_max = kernel
        result[rows] = {name: 1e6 * statistics.median(seconds) for name, seconds in calls.items()}
        print(f"{rows} rows: torch {result[rows]['torch']:.0f} us, row_max {result[rows]['row_max']:.0f} us a call")
    if args.output:
        args.output.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
