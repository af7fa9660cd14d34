"""How close the simulator comes to the engine on this machine.

Runs the same workload (same seed, same lengths and arrivals) twice per scheduler: on the real
engine through the in-process benchmark driver, and through the simulator with the profiled cost
model. Two errors are reported:

- per iteration: the cost model's prediction for each batch the engine actually ran, against the
  measured step time (this isolates the cost model from scheduling divergence);
- per run: TTFT and TBT P50/P99 of the simulation against the real run's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from carpool.bench.drivers import InProcessDriver
from carpool.bench.metrics import summarize
from carpool.bench.options import SchedulerSpec
from carpool.bench.workload import PromptSource, build_workload
from carpool.engine import LLMEngine
from carpool.sim.cost_model import BatchShape, ProfiledCostModel
from carpool.sim.run import iterations, reference_decode_time, timelines, workload_config
from carpool.sim.simulator import ReplicaConfig, simulate


def relative_error(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or measured is None or measured == 0:
        return None
    return (predicted - measured) / measured


def compare(engine: LLMEngine, cost: ProfiledCostModel, spec: SchedulerSpec, args) -> dict:
    from carpool.core.scheduler import make_scheduler

    scheduler, budget = spec.name, spec.budget or args.max_num_batched_tokens
    engine.scheduler = make_scheduler(scheduler, engine.block_manager, budget, args.max_num_seqs,
                                      engine.max_model_len)
    specs = build_workload(workload_config(args, args.qps), PromptSource.from_tokenizer(engine.tokenizer))
    shapes: list[BatchShape] = []
    driver = InProcessDriver(engine)
    driver.warmup()
    stop_recording = engine.add_batch_observer(lambda batch: shapes.append(BatchShape.of(batch)))
    try:
        start = len(engine.iteration_stats)
        run = driver.run(specs)
        steps = list(engine.iteration_stats)[start:]
    finally:
        stop_recording()
    measured = [s.duration for s in steps]
    predicted = [sum(cost.stage_time(sh, st) for st in range(cost.num_stages)) for sh in shapes[-len(steps):]]
    signed = (np.array(predicted) - np.array(measured)) / np.array(measured)
    errors = np.abs(signed)
    with_prefill = np.array([bool(sh.prefills) for sh in shapes[-len(steps):]])

    # The same requests, token ids included, so that prefix-cache hits are the same too.
    cfg = ReplicaConfig(scheduler=scheduler, max_num_batched_tokens=budget,
                        max_num_seqs=args.max_num_seqs, block_size=engine.block_manager.block_size,
                        num_blocks=engine.block_manager.num_blocks, max_model_len=engine.max_model_len,
                        enable_prefix_caching=engine.block_manager.enable_prefix_caching)
    sim = simulate(specs, cfg, cost)
    ref = reference_decode_time(cost)
    real_summary, _ = summarize(run.timelines, run.iterations, decode_time=ref)
    sim_summary, _ = summarize(timelines(sim), iterations(sim), decode_time=ref)
    latency = {}
    for metric in ("ttft", "tbt"):
        for q in ("p50", "p99"):
            r, s = getattr(getattr(real_summary, metric), q), getattr(getattr(sim_summary, metric), q)
            latency[f"{metric}_{q}"] = {"real": r, "simulated": s, "error": relative_error(s, r)}
    return {
        "scheduler": spec.label,
        "iterations": len(steps),
        "iteration_error_p50": float(np.median(errors)),
        "iteration_error_p90": float(np.percentile(errors, 90)),
        # signed medians by kind: a bias on one kind shifts TTFT (prefills) or TBT (decodes)
        "prefill_iteration_bias": float(np.median(signed[with_prefill])) if with_prefill.any() else None,
        "decode_iteration_bias": float(np.median(signed[~with_prefill])) if (~with_prefill).any() else None,
        "iteration_time_real_s": float(np.sum(measured)),
        "iteration_time_predicted_s": float(np.sum(predicted)),
        "latency": latency,
        "simulated_iterations": len(sim.micro_batches),
    }


def run_fidelity(config, args) -> dict:
    engine = LLMEngine(config)
    cost = ProfiledCostModel.load(args.profile)
    results = [compare(engine, cost, spec, args) for spec in args.schedulers]
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fidelity.json").write_text(json.dumps({"profile": args.profile, "results": results}, indent=2))
    lines = ["| scheduler | iterations | iteration error P50 / P90 | bias prefill / decode steps | "
             "TTFT P50 real / sim (err) | "
             "TTFT P99 real / sim (err) | TBT P50 real / sim (err) | TBT P99 real / sim (err) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        cells = []
        for key in ("ttft_p50", "ttft_p99", "tbt_p50", "tbt_p99"):
            v = r["latency"][key]
            cells.append(f"{v['real'] * 1e3:.0f} / {v['simulated'] * 1e3:.0f} ms ({v['error']:+.0%})")
        bias = " / ".join("-" if b is None else f"{b:+.1%}"
                          for b in (r["prefill_iteration_bias"], r["decode_iteration_bias"]))
        lines.append(f"| {r['scheduler']} | {r['iterations']} | {r['iteration_error_p50']:.1%} / "
                     f"{r['iteration_error_p90']:.1%} | {bias} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    (out / "fidelity.md").write_text(table + "\n")
    print(table)
    return {"results": results}
