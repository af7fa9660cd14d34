"""Where quantized layers should switch from the integer kernel to the tile kernel, on this CPU.

    .venv/bin/python benchmarks/tile_crossover.py [--model GGUF] [--rounds 8] [--output FILE]

First the probe `quant.tile_from()` runs (each family of integer kernels against the tile kernel
at 16-128 tokens, `quant.measure_kernels`) and the crossover it picks. Then, with --model, the
engine's own steps in one process, the model's quantized layers on the integer kernel at every
size and on this CPU's choice in turn: a 256-token prefill, and a step of 16 decodes beside a
48-token chunk. Prints each round and the median ratio (integer time / chosen time).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from carpool.config import EngineConfig
from carpool.core.scheduler import make_scheduler
from carpool.engine import LLMEngine
from carpool.model import quant
from carpool.model.fused_layers import FusedLayers
from carpool.sampling_params import SamplingParams


def engine_steps(model: str, rounds: int) -> dict:
    """Both kinds of step, alternating the layers' tile_from between 0 and the CPU's choice."""
    engine = LLMEngine(EngineConfig(model=model, enable_prefix_caching=False, max_num_batched_tokens=256,
                                    target_tbt_ms=0))
    layers = [m for m in engine.model.modules() if isinstance(m, quant.QuantizedLinear)]
    chosen = max(m.tile_from for m in layers)
    runner = engine.executor.runner
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(1000, 30000) for _ in range(n)]  # noqa: E731

    saved = [m.tile_from for m in layers]

    def use(tile_from: int) -> None:  # the layers that switch on this CPU; the fused path bound anew
        for m, own in zip(layers, saved):
            m.tile_from = tile_from if own else 0
        runner.fused = FusedLayers.build(engine.model) if runner.fused is not None else None

    def prefill() -> float:  # a 256-token prompt alone, one step
        start = time.perf_counter()
        engine.add_request(ids(256), SamplingParams(max_tokens=1, temperature=0))
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - start

    results = {"chosen": chosen, "prefill_256_s": {"integer": [], "chosen": []}}
    for _ in range(rounds):
        for name, tile_from in (("integer", 0), ("chosen", chosen)):
            use(tile_from)
            results["prefill_256_s"][name].append(prefill())
    use(chosen)
    # 16 decodes, then a long prompt whose 48-token chunks ride beside them (a 64-token budget)
    engine.scheduler = make_scheduler("sarathi", engine.block_manager, 64, engine.config.max_num_seqs,
                                      engine.max_model_len)
    decodes = [ids(500) for _ in range(16)]
    for prompt in decodes:
        engine.add_request(prompt, SamplingParams(max_tokens=10**6, temperature=0, ignore_eos=True))
    while not engine.iteration_stats or engine.iteration_stats[-1].num_prefill_tokens:
        engine.step()
    results["hybrid_16_decodes_48_chunk_s"] = {"integer": [], "chosen": []}
    for _ in range(rounds):
        for name, tile_from in (("integer", 0), ("chosen", chosen)):
            use(tile_from)
            engine.add_request(ids(4 * 48), SamplingParams(max_tokens=1, temperature=0))
            steps = []
            for _ in range(4):
                engine.step()
                if engine.iteration_stats[-1].num_prefill_tokens:
                    steps.append(engine.iteration_stats[-1].duration)
            results["hybrid_16_decodes_48_chunk_s"][name].append(statistics.median(steps))
    engine.shutdown()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="a GGUF or HF folder whose quantized layers to time in the engine")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()
    times, share = quant.measure_kernels()
    out = {"probe": {family: {t: [a, b] for t, (a, b) in per.items()} for family, per in times.items()},
           "cpu_share": share, "crossover": {family: quant.crossover(per) for family, per in times.items()}}
    for family, per in times.items():
        print(f"{family}: tile / integer time " + ", ".join(f"{t} tokens {b / a:.2f}" for t, (a, b) in per.items())
              + f"; crossover {out['crossover'][family]} (this process got {share:.0%} of its threads' time)")
    if args.model:
        out["engine"] = engine_steps(args.model, args.rounds)
        for kind in ("prefill_256_s", "hybrid_16_decodes_48_chunk_s"):
            pair = out["engine"][kind]
            ratios = [a / b for a, b in zip(pair["integer"], pair["chosen"])]
            print(f"{kind}: integer / tiles from {out['engine']['chosen']} per round "
                  + " ".join(f"{r:.2f}" for r in ratios) + f"; median {statistics.median(ratios):.3f}")
    if args.output:
        args.output.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
