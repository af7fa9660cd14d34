"""`carpool simulate`: the benchmark's workloads, metrics, capacity search and plots, over a
simulated deployment instead of the engine.

The simulation's requests carry the same timestamps the engine records, so they go through
`carpool.harness.metrics` exactly as a real run does. Iteration records are the micro-batches
(start at stage 0, end at the last stage). With speculative decoding on (`--spec-tokens`), each
scheduler's entry also holds the spec_decode counters the engine keeps.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

from carpool.core.cost_profile import FittedCostModel
from carpool.core.step_cost import BatchShape, CostModel
from carpool.harness.capacity import Evaluation, parse_slo, search_capacity
from carpool.harness.metrics import IterationRecord, RequestTimeline, summarize, write_report
from carpool.harness.options import nonneg_float, nonneg_int
from carpool.harness.workload import PromptSource, WorkloadConfig, build_workload, describe
from carpool.sim.gpu import GPUS, GpuCostModel, resolve_shape
from carpool.sim.simulator import ReplicaConfig, SimResult, simulate

# Token ids for simulated prompts: random over a large vocabulary, so that prompts share a
# prefix only where the workload says so (a system prompt, a conversation) and simulated
# prefix-cache hits are the workload's, not accidents of the ids.
SIM_PROMPTS = PromptSource(word_ids=list(range(1, 65_536)))


def timelines(result: SimResult) -> list[RequestTimeline]:
    return [RequestTimeline(r.request_id, r.arrival_time, list(r.token_times), r.num_prompt_tokens,
                            r.first_scheduled_time, r.finished_time, r.num_preemptions,
                            r.sampling_params.max_tokens, num_cached_tokens=r.num_cached_tokens)
            for r in result.requests]


def iterations(result: SimResult) -> list[IterationRecord]:
    return [IterationRecord(mb.start, mb.end - mb.start, mb.batch.num_prefill_tokens, mb.batch.num_decode_tokens,
                            len(mb.batch), len(mb.batch.preempted), mb.batch.predicted_time,
                            mb.batch.slo_unreachable) for mb in result.micro_batches]


def chrome_trace(result: SimResult) -> dict:
    """Perfetto / chrome://tracing JSON: one track per replica stage, one slice per micro-batch."""
    events = []
    for i, mb in enumerate(result.micro_batches):
        for s, (start, end) in enumerate(zip(mb.stage_start, mb.stage_end)):
            events.append({"name": f"mb{i} p{mb.batch.num_prefill_tokens}+d{mb.batch.num_decode_tokens}",
                           "ph": "X", "ts": start * 1e6, "dur": (end - start) * 1e6,
                           "pid": mb.replica, "tid": s,
                           "args": {"prefill_tokens": mb.batch.num_prefill_tokens,
                                    "decode_tokens": mb.batch.num_decode_tokens,
                                    "draft_tokens": mb.batch.num_draft_tokens, "accepted_drafts": mb.num_accepted,
                                    "requests": len(mb.batch)}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def pipeline_report(result: SimResult) -> dict:
    import numpy as np

    waits = list(result.request_pipeline_wait.values())
    return {"bubble_fraction": result.bubble_fraction(),
            "stage_busy_s": result.stage_busy,
            "makespan_s": result.makespan,
            "request_pipeline_wait_p50_s": float(np.median(waits)) if waits else None}


def spec_report(result: SimResult) -> dict:
    """Speculation's counters, as the engine's spec_decode metrics name them; drafts scored per
    step; and tokens each decode produced (its own token and the drafts kept; 1 without drafts)."""
    stats = result.spec
    steps = len(result.micro_batches)
    decodes = sum(mb.batch.num_decode_tokens for mb in result.micro_batches)
    return {"num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
            "num_accepted_tokens": stats.num_accepted_tokens, "acceptance_rate": stats.acceptance_rate,
            "tokens_per_verification": stats.mean_acceptance_length,
            "accepted_per_position": stats.accepted_per_position,
            "draft_tokens_per_step": stats.num_draft_tokens / steps if steps else 0.0,
            "tokens_per_decode": (decodes + stats.num_accepted_tokens) / decodes if decodes else None}


def prefix_cache_report(summary) -> dict:
    """What the prefix cache saved: prompt tokens found cached, prefill tokens computed."""
    prefill = summary.iterations.get("prefill_tokens", 0)
    n = summary.num_requests
    return {"prompt_tokens": summary.prompt_tokens, "cached_prompt_tokens": summary.cached_prompt_tokens,
            "hit_rate": summary.cached_prompt_tokens / summary.prompt_tokens if summary.prompt_tokens else 0.0,
            "prefill_tokens": prefill, "prefill_tokens_per_request": prefill / n if n else 0.0}


def build_cost_model(args) -> tuple[CostModel, list[str]]:
    if args.cost_model == "profile":
        return FittedCostModel.load(args.profile, num_stages=args.pp), [f"cost model: profile {args.profile}"]
    if args.gpu not in GPUS:
        raise ValueError(f"unknown GPU {args.gpu!r}; choose {', '.join(GPUS)}")
    kwargs = {"profiles": Path(args.profiles_dir)} if args.profiles_dir else {}
    model = GpuCostModel(resolve_shape(args.model_shape), GPUS[args.gpu], tp=args.tp, num_stages=args.pp,
                         gpus_per_node=args.gpus_per_node, **kwargs)
    return model, model.notes


def reference_decode_time(cost: CostModel) -> float:
    """One request decoding alone at a short context: what 'strict = 5x' is relative to."""
    shape = BatchShape(decode_contexts=(128,), num_sampled=1)
    return sum(cost.stage_time(shape, s) for s in range(cost.num_stages))


def workload_config(args, qps: float | None) -> WorkloadConfig:
    return WorkloadConfig(
        num_requests=args.num_requests, lengths=args.lengths, prompt_len=args.prompt_len,
        output_len=args.output_len, min_prompt_len=args.prompt_range[0], max_prompt_len=args.prompt_range[1],
        min_output_len=args.output_range[0], max_output_len=args.output_range[1], zipf_theta=args.zipf_theta,
        trace=args.trace, length_scale=args.length_scale, trace_offset=args.trace_offset,
        arrivals=args.arrivals, qps=qps, burstiness=args.burstiness, max_model_len=args.max_model_len,
        seed=args.seed, system_prompt_len=args.system_prompt_len, turns=args.turns, think_time=args.think_time)


def run_simulate(args) -> dict:
    cost, notes = build_cost_model(args)
    for n in notes:
        print(f"note: {n}")
    ref = reference_decode_time(cost)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    report: dict = {"notes": notes, "reference_decode_s": ref, "schedulers": {}}

    def run_once(scheduler: str, budget: int, qps: float | None,
                 target_tbt: float | None = None) -> tuple[SimResult, list, list]:
        specs = build_workload(workload_config(args, qps), SIM_PROMPTS)
        cfg = ReplicaConfig(scheduler=scheduler, max_num_batched_tokens=budget, max_num_seqs=args.max_num_seqs,
                            block_size=args.block_size, num_blocks=args.num_blocks, max_model_len=args.max_model_len,
                            enable_prefix_caching=args.enable_prefix_caching, target_tbt=target_tbt,
                            snap_chunks=args.snap_chunks, num_speculative_tokens=args.spec_tokens,
                            spec_acceptance=args.spec_acceptance, spec_seed=args.seed,
                            step_jitter=getattr(cost, "residuals", ()))
        result = simulate(specs, cfg, cost, num_replicas=args.replicas)
        return result, timelines(result), iterations(result)

    runs: dict[str, list[RequestTimeline]] = {}
    capacities: dict[str, dict[str, float]] = {}
    for spec in args.schedulers:
        budget = spec.budget or args.max_num_batched_tokens
        # sarathi:dynamic: the target is --target-tbt-ms, else the strict SLO (each capacity
        # search below sets its own SLO's)
        target = (args.target_tbt_ms / 1e3 if args.target_tbt_ms else parse_slo("strict", ref).tbt_p99) \
            if spec.dynamic else None
        t0 = time.perf_counter()
        result, tl, its = run_once(spec.name, budget, args.qps, target)
        runs[spec.label] = tl
        summary, per_request = summarize(tl, its, decode_time=ref)
        folder = out / spec.label
        write_report(folder, summary, per_request, tl, its, meta={"scheduler": spec.label, "qps": args.qps})
        (folder / "trace.json").write_text(json.dumps(chrome_trace(result)))
        entry = {"summary": summary.to_dict(), "pipeline": pipeline_report(result),
                 "simulated_in_s": time.perf_counter() - t0}
        entry["prefix_cache"] = prefix_cache_report(summary)
        if result.spec is not None:
            entry["spec_decode"] = spec_report(result)
        print(f"{spec.label}: {len(tl)} requests in {entry['simulated_in_s']:.2f} s wall; "
              f"TTFT p50 {summary.ttft.p50:.3f} s, TBT p99 {summary.tbt.p99:.4f} s, "
              f"bubble fraction {entry['pipeline']['bubble_fraction']:.3f}, "
              f"prefill tokens computed per request {entry['prefix_cache']['prefill_tokens_per_request']:.0f} "
              f"({entry['prefix_cache']['cached_prompt_tokens']} prompt tokens from the prefix cache)")
        if "spec_decode" in entry:
            sd = entry["spec_decode"]
            show = lambda v: "n/a" if v is None else f"{v:.2f}"  # noqa: E731
            print(f"  speculation: {sd['num_draft_tokens']} draft tokens, acceptance {show(sd['acceptance_rate'])}, "
                  f"{show(sd['tokens_per_verification'])} tokens per verification, "
                  f"{show(sd['tokens_per_decode'])} per decode")
        for slo_name in [s for s in args.capacity or [] if spec.slo in (None, s)]:
            slo = parse_slo(slo_name, ref)

            def evaluate(qps: float) -> Evaluation:
                t = time.perf_counter()
                _, tl_q, its_q = run_once(spec.name, budget, qps,
                                          (args.target_tbt_ms / 1e3 if args.target_tbt_ms else slo.tbt_p99)
                                          if spec.dynamic else None)
                s, _ = summarize(tl_q, its_q, decode_time=ref)
                ok, why = slo.check(s)
                return Evaluation(qps, ok, why, {"tbt_p99": s.tbt.p99, "scheduling_delay_p50": s.scheduling_delay.p50},
                                  time.perf_counter() - t)

            cap = search_capacity(evaluate, args.qps or 1.0, rel_tol=args.capacity_tolerance, max_evals=20)
            entry.setdefault("capacity", {})[slo_name] = {**cap.to_dict(), "slo_tbt_p99_s": slo.tbt_p99}
            capacities.setdefault(slo_name, {})[spec.label] = cap.capacity
            print(f"  capacity under {slo_name} (P99 TBT <= {slo.tbt_p99 * 1e3:.1f} ms): {cap.capacity:.3f} QPS "
                  f"(bracket {cap.lower}..{cap.upper})")
        report["schedulers"][spec.label] = entry
    if not args.no_plots:
        from carpool.harness import plots

        plots.tbt_cdf(runs, out / "tbt_cdf.png", slo=5 * ref, title=f"Simulated TBT CDF (strict SLO = {5 * ref * 1e3:.0f} ms)")
        plots.token_timeline(runs, out / "token_timeline.png", stall_threshold=5 * ref)
        if capacities:
            plots.capacity_bars(capacities, out / "capacity.png", title="Simulated capacity (QPS)")
    report["workload"] = describe(build_workload(workload_config(args, args.qps), SIM_PROMPTS))
    report["args"] = {k: (asdict(v) if hasattr(v, "__dataclass_fields__") else v)
                      for k, v in vars(args).items() if k != "func"}
    (out / "simulation.json").write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {out / 'simulation.json'}")
    return report


def spec_tokens(text: str) -> int:
    n = nonneg_int(text)
    if n > 32:
        raise argparse.ArgumentTypeError(f"takes 0 (off) to 32 drafts, as the engine, got {text}")
    return n


def probability(text: str) -> float:
    a = nonneg_float(text)
    if a > 1.0:
        raise argparse.ArgumentTypeError(f"must be a probability in [0, 1], got {text}")
    return a


def add_simulate_args(p) -> None:
    from carpool.harness.options import add_workload_args, positive_float, positive_int, scheduler_list

    g = p.add_argument_group("deployment")
    g.add_argument("--cost-model", choices=("profile", "gpu"), default="profile",
                   help="profile: this machine's `carpool profile` CSV; gpu: A100/H100 operator profiles")
    g.add_argument("--profile", default="bench_results/profile.json")
    g.add_argument("--gpu", default="a100", help="a100 or h100 (cost-model gpu)")
    g.add_argument("--model-shape", default="mistral-7b",
                   help="built-in shape (mistral-7b, yi-34b, llama-2-70b, falcon-180b, gpt-3-175b, ...) "
                        "or a HF config.json / its folder")
    g.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel GPUs per stage")
    g.add_argument("--pp", type=positive_int, default=1, help="pipeline stages")
    g.add_argument("--gpus-per-node", type=positive_int, default=8)
    g.add_argument("--profiles-dir", default=None,
                   help="folder of vidur-format profiles (default: the A100/H100 ones in carpool/data/profiles)")
    g.add_argument("--replicas", type=positive_int, default=1)
    g = p.add_argument_group("scheduling")
    g.add_argument("--schedulers", type=scheduler_list, default=scheduler_list("sarathi"),
                   help="comma list of NAME[:BUDGET]; sarathi:dynamic sizes prefill to a TBT target")
    g.add_argument("--target-tbt-ms", type=positive_float, default=None,
                   help="sarathi:dynamic's target (default: each capacity search's SLO; else the strict one)")
    g.add_argument("--snap-chunks", action=argparse.BooleanOptionalAction, default=True,
                   help="sarathi:dynamic snaps chunks to token counts the cost model runs fastest (GPU tiles)")
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=512)
    g.add_argument("--max-num-seqs", type=positive_int, default=256)
    g.add_argument("--block-size", type=positive_int, default=16)
    g.add_argument("--num-blocks", type=positive_int, default=16384, help="KV blocks per replica")
    g.add_argument("--max-model-len", type=positive_int, default=8192)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="the replicas' block managers cache prompt prefixes, as the engine's do (default: on)")
    g.add_argument("--spec-tokens", type=spec_tokens, default=0,
                   help="speculative decoding: up to this many drafts per decode, as the engine's "
                        "num_speculative_tokens (default 0: off)")
    g.add_argument("--spec-acceptance", type=probability, default=0.7,
                   help="with --spec-tokens: the chance verification keeps each draft, given it kept the ones before")
    g = p.add_argument_group("run")
    g.add_argument("--qps", type=positive_float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--capacity", type=lambda s: [x for x in s.split(",") if x], default=None,
                   help="also search capacity under these SLOs, e.g. strict,relaxed or 200ms")
    g.add_argument("--capacity-tolerance", type=positive_float, default=0.05)
    g.add_argument("--output", default="bench_results/simulate")
    g.add_argument("--no-plots", action="store_true")
    add_workload_args(p)
