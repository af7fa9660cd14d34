"""`carpool bench pipeline`: pipeline bubbles per scheduler (Sarathi, arXiv 2308.16369, §3.4/§5.3).

With pipeline parallelism a stage idles whenever the micro-batch it waits for takes longer on the
stage before it than its own previous one did: micro-batches of unequal cost leave bubbles.
Sarathi's hybrid batches all cost about one token budget, so they should leave few. This replays
one workload (same requests, same arrivals) through an engine per scheduler and reads every
rank's compute interval per micro-batch back from the workers.

Definitions (one clock for every process of a host):
  busy period      from a micro-batch submitted to an empty pipeline until the pipeline is empty
                   again (its last micro-batch done on the last stage); idle time outside busy
                   periods is a lack of load, not a bubble
  stage time       the total length of the busy periods, for every stage
  busy(s)          sum of stage s's compute intervals; idle(s) = stage time - busy(s)
  bubble fraction  sum of idle(s) / sum of stage time, over the stages
  bubble(s, m)     the idle gap at stage s just before it starts micro-batch m: since it finished
                   the previous micro-batch, or, for the first of a busy period, since m was
                   submitted (pipeline fill)
  per-request bubble time   sum of bubble(s, m) over the stages and over the micro-batches that
                   carried the request (the drain at the end of a busy period is in the fraction
                   but charged to no request)
Stages are timed on their first tensor-parallel rank. With one process (-pp 1) only serving
metrics are reported, for the throughput comparison.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from carpool.bench.hostload import wait_for_quiet
from carpool.config import EngineConfig


def bubble_report(timings: dict, until: float | None = None) -> dict:
    """Stage busy/idle times, bubble fraction and bubbles per micro-batch and per request, from
    `MultiprocExecutor.stage_timings()`; with `until`, only micro-batches submitted by then."""
    pp = timings["pipeline_parallel_size"]
    stage_rank: dict[int, int] = {}
    per_stage: dict[int, dict[int, tuple[float, float]]] = {}
    for r in timings["ranks"]:
        if r["tp_rank"] == 0:
            stage_rank[r["stage"]] = r["rank"]
            per_stage[r["stage"]] = {mb: (start, end) for mb, start, end in r["timings"]}
    mbs = [m for m in sorted(timings["micro_batches"], key=lambda m: m["micro_batch"])
           if all(m["micro_batch"] in per_stage[s] for s in range(pp))
           and (until is None or m["submit_time"] <= until)]
    if not mbs:
        return {"num_micro_batches": 0}

    # Busy periods: consecutive micro-batches from one submitted to an empty pipeline.
    periods: list[list[dict]] = []
    for m in mbs:
        if m["pipeline_was_empty"] or not periods:
            periods.append([])
        periods[-1].append(m)
    last = pp - 1
    stage_time = sum(per_stage[last][p[-1]["micro_batch"]][1] - p[0]["submit_time"] for p in periods)

    bubbles: dict[int, list[float]] = {}  # micro-batch -> bubble per stage
    for period in periods:
        for s in range(pp):
            free_since = period[0]["submit_time"]
            for m in period:
                start, end = per_stage[s][m["micro_batch"]]
                bubbles.setdefault(m["micro_batch"], [0.0] * pp)[s] = max(0.0, start - free_since)
                free_since = end

    stages = []
    for s in range(pp):
        compute = [end - start for start, end in (per_stage[s][m["micro_batch"]] for m in mbs)]
        busy = float(sum(compute))
        stages.append({
            "stage": s, "rank": stage_rank[s], "busy_s": busy, "idle_s": stage_time - busy,
            "idle_fraction": (stage_time - busy) / stage_time if stage_time > 0 else None,
            "compute_ms": _dist([c * 1e3 for c in compute]),
            "bubble_ms": _dist([bubbles[m["micro_batch"]][s] * 1e3 for m in mbs]),
        })
    per_request: dict[str, float] = {}
    for m in mbs:
        total = sum(bubbles[m["micro_batch"]])
        for rid in m["request_ids"]:
            per_request[rid] = per_request.get(rid, 0.0) + total
    idle = sum(st["idle_s"] for st in stages)
    tokens = [m["num_tokens"] for m in mbs]
    return {
        "num_micro_batches": len(mbs),
        "num_busy_periods": len(periods),
        "stage_time_s": stage_time,
        "bubble_fraction": idle / (pp * stage_time) if stage_time > 0 else None,
        "stages": stages,
        "micro_batch_tokens": _dist(tokens),
        "micro_batch_tokens_cv": float(np.std(tokens) / np.mean(tokens)) if tokens else None,
        "per_request_bubble_ms": _dist([v * 1e3 for v in per_request.values()]),
        "per_micro_batch": [{"micro_batch": m["micro_batch"], "num_tokens": m["num_tokens"],
                             "num_requests": len(m["request_ids"]),
                             "compute_ms": [1e3 * (per_stage[s][m["micro_batch"]][1] - per_stage[s][m["micro_batch"]][0])
                                            for s in range(pp)],
                             "bubble_ms": [1e3 * b for b in bubbles[m["micro_batch"]]]} for m in mbs],
    }


def _dist(values: list[float]) -> dict:
    if not values:
        return {"count": 0}
    a = np.asarray(values, dtype=float)
    return {"count": int(a.size), "mean": float(a.mean()), "p50": float(np.median(a)),
            "p90": float(np.percentile(a, 90)), "max": float(a.max()), "sum": float(a.sum())}


def workload_from_args(args):
    from carpool.harness.workload import WorkloadConfig

    return WorkloadConfig(num_requests=args.num_requests, lengths=args.lengths, prompt_len=args.prompt_len,
                          output_len=args.output_len, min_prompt_len=args.prompt_range[0],
                          max_prompt_len=args.prompt_range[1], min_output_len=args.output_range[0],
                          max_output_len=args.output_range[1], zipf_theta=args.zipf_theta, trace=args.trace,
                          length_scale=args.length_scale, trace_offset=args.trace_offset,
                          arrivals=args.arrivals, qps=args.qps, burstiness=args.burstiness,
                          seed=args.workload_seed)


def _host_busy_s() -> float | None:
    """Busy CPU seconds of the whole host since boot (/proc/stat), None where unknown."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = v
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _process_cpu_s(pids: list[int]) -> float:
    """CPU seconds used so far by these processes (utime + stime)."""
    total = 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            pass
    return total


def run_one(config: EngineConfig, wcfg, prompt_corpus: str | None = None) -> dict:
    """One engine, one workload replay; serving summary plus the pipeline report. Also the CPU
    other processes used meanwhile (`other_cpu_cores`): the driver and its workers are the
    measurement, anything else on the host skews it."""
    from carpool.harness.drivers import InProcessDriver
    from carpool.harness.metrics import summarize
    from carpool.harness.workload import PromptSource, build_workload, describe
    from carpool.engine import LLMEngine

    engine = LLMEngine(config)
    try:
        specs = build_workload(replace(wcfg, max_model_len=engine.max_model_len),
                               PromptSource.from_tokenizer(engine.tokenizer, prompt_corpus))
        driver = InProcessDriver(engine)
        driver.warmup()
        engine.executor.stage_timings(reset=True)
        pids = [os.getpid(), *(p.pid for p in getattr(engine.executor, "processes", {}).values())]
        t0, host0, ours0 = time.monotonic(), _host_busy_s(), _process_cpu_s(pids)
        result = driver.run(specs)
        wall, host1, ours1 = time.monotonic() - t0, _host_busy_s(), _process_cpu_s(pids)
        timings = engine.executor.stage_timings()
    finally:
        engine.shutdown()
    other = None if host0 is None else max(0.0, (host1 - host0) - (ours1 - ours0)) / wall
    summary, _ = summarize(result.timelines, result.iterations)
    last_arrival = max(t.arrival_time for t in result.timelines)
    return {"scheduler": config.scheduler, "tensor_parallel_size": config.tensor_parallel_size,
            "pipeline_parallel_size": config.pipeline_parallel_size, "num_threads": config.num_threads,
            "other_cpu_cores": other, "workload": describe(specs), "summary": summary.to_dict(),
            "pipeline": bubble_report(timings) if timings else None,
            # The same accounting over the micro-batches submitted while requests still arrived
            # (before the final drain, where only the last decodes are left).
            "pipeline_while_arriving": bubble_report(timings, until=last_arrival) if timings else None}


def run_pipeline_bench(config: EngineConfig, args) -> list[dict]:
    from carpool.core.scheduler import SCHEDULERS

    bad = [s for s in args.schedulers if s not in SCHEDULERS]
    if bad:
        raise ValueError(f"unknown scheduler(s) {', '.join(bad)}; choose from {', '.join(SCHEDULERS)}")
    wcfg = workload_from_args(args)
    wcfg.validate()
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    tag = f"pp{config.pipeline_parallel_size}_tp{config.tensor_parallel_size}_t{config.num_threads or 'auto'}"
    limit = args.max_other_cpu if args.max_other_cpu >= 0 else None
    rows = []
    for name in args.schedulers:
        for attempt in range(args.retries + 1):
            if limit is not None:
                wait_for_quiet(max_cores=limit / 2, log=print)
            result = run_one(replace(config, scheduler=name), wcfg, args.prompt_corpus)
            other = result["other_cpu_cores"]
            if limit is None or other is None or other <= limit:
                break
            print(f"{name}: other processes used {other:.2f} cores during the run; "
                  f"{'running it again' if attempt < args.retries else 'keeping it (out of retries)'}")
        result["command_args"] = {k: v for k, v in vars(args).items() if k != "func"}
        (out / f"{tag}_{name}.json").write_text(json.dumps(result, indent=2))
        rows.append(result)
        print(row_text(result), flush=True)
    (out / f"{tag}_table.md").write_text(table(rows) + "\n")
    print(table(rows))
    print(f"results in {out}/")
    return rows


def row_text(r: dict) -> str:
    s, p = r["summary"], r["pipeline"]
    text = f"{r['scheduler']}: {s['output_tokens_per_s']:.1f} out tok/s"
    if r.get("other_cpu_cores") is not None:
        text += f" (other processes: {r['other_cpu_cores']:.2f} cores)"
    if p and p.get("num_micro_batches"):
        text += (f", bubble fraction {p['bubble_fraction']:.3f}, "
                 f"median per-request bubble {p['per_request_bubble_ms']['p50']:.0f} ms")
    return text


def table(rows: list[dict]) -> str:
    head = ("| scheduler | PP | out tok/s | TTFT p50 s | TBT p99 ms | bubble fraction | "
            "median per-request bubble ms | stage idle fractions | micro-batch tokens (mean, CV) | "
            "bubble fraction while arriving |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        s, p, w = r["summary"], r["pipeline"], r["pipeline_while_arriving"]
        ttft = s["ttft"]["p50"]
        tbt = s["tbt"]["p99"]
        cells = [r["scheduler"], str(r["pipeline_parallel_size"]), f"{s['output_tokens_per_s']:.1f}",
                 "-" if ttft is None else f"{ttft:.2f}", "-" if tbt is None else f"{tbt * 1e3:.0f}"]
        if p and p.get("num_micro_batches"):
            cells += [f"{p['bubble_fraction']:.3f}", f"{p['per_request_bubble_ms']['p50']:.0f}",
                      " / ".join(f"{st['idle_fraction']:.2f}" for st in p["stages"]),
                      f"{p['micro_batch_tokens']['mean']:.0f}, {p['micro_batch_tokens_cv']:.2f}",
                      f"{w['bubble_fraction']:.3f}" if w and w.get("num_micro_batches") else "-"]
        else:
            cells += ["-", "-", "-", "-", "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
