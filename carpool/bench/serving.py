"""`carpool bench serving | burst | ablation | budget-sweep` and `carpool capacity`.

Each command is the same pipeline with different knobs: build a workload, replay it through a
driver (one engine per scheduler in process, or a server over HTTP), turn the timelines into
metrics, write JSON/CSV per run plus a results table, and draw the figures.
"""

from __future__ import annotations

import csv
import gc
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, replace
from functools import partial
from datetime import datetime, timezone
from pathlib import Path

from carpool.bench.hostload import ContentionMonitor, combine, wait_for_quiet
from carpool.config import EngineConfig
from carpool.harness import plots
from carpool.harness.capacity import SLO, CapacityResult, Evaluation, SLOMonitor, parse_slo, search_capacity
from carpool.harness.drivers import InProcessDriver, OnlineDriver, RunResult
from carpool.harness.metrics import Summary, decode_iteration_median, summarize, tbts, write_report
from carpool.harness.options import SchedulerSpec
from carpool.harness.workload import PromptSource, RequestSpec, WorkloadConfig, build_workload, describe

# Sizes of `carpool capacity --quick` and of the full search (see BENCHMARKS.md).
QUICK = dict(duration=30.0, min_requests=16, max_evals=6, resolution=0.15)
FULL = dict(duration=60.0, min_requests=24, max_evals=7, resolution=0.1)


def say(msg: str) -> None:
    print(msg, flush=True)


# ---------------------------------------------------------------- building blocks
def workload_config(args, **overrides) -> WorkloadConfig:
    kw = dict(num_requests=args.num_requests, lengths=args.lengths, prompt_len=args.prompt_len,
              output_len=args.output_len, min_prompt_len=args.prompt_range[0], max_prompt_len=args.prompt_range[1],
              min_output_len=args.output_range[0], max_output_len=args.output_range[1], zipf_theta=args.zipf_theta,
              trace=args.trace, length_scale=args.length_scale, trace_offset=args.trace_offset,
              arrivals=args.arrivals, qps=None, burstiness=args.burstiness, seed=args.seed,
              system_prompt_len=args.system_prompt_len, turns=args.turns, think_time=args.think_time)
    kw.update(overrides)
    if kw["qps"] is None and kw["arrivals"] in ("poisson", "gamma"):
        kw["qps"] = 1.0
    return WorkloadConfig(**kw)


def check_schedulers(specs: list[SchedulerSpec]) -> None:
    """Fail before any model loads if a scheduler name is unknown."""
    from carpool.core.scheduler import SCHEDULERS

    bad = [s.name for s in specs if s.name not in SCHEDULERS]
    if bad:
        raise ValueError(f"unknown scheduler(s) {', '.join(bad)}; choose from {', '.join(SCHEDULERS)}")


class Target:
    """Where requests go: an in-process engine per scheduler spec, or one HTTP server. Owns the
    tokenizer-backed prompt source and the reference decode time."""

    def __init__(self, args, base: EngineConfig | None):
        self.args = args
        self.base = base
        self.online = bool(getattr(args, "base_url", None))
        self._tokenizer = None
        self._prompts: PromptSource | None = None
        self.max_model_len: int | None = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from carpool.tokenizer import load_tokenizer

            model = self.base.model if self.base else EngineConfig().model
            self._tokenizer = load_tokenizer(model)
        return self._tokenizer

    @property
    def prompts(self) -> PromptSource:
        if self._prompts is None:
            self._prompts = PromptSource.from_tokenizer(self.tokenizer, getattr(self.args, "prompt_corpus", None))
        return self._prompts

    def labels(self, specs: list[SchedulerSpec]) -> list[SchedulerSpec | None]:
        return [None] if self.online else specs

    def driver(self, spec: SchedulerSpec | None):
        """(driver, label). In process: a fresh engine with this spec's policy and budget."""
        if self.online:
            a = self.args
            driver = OnlineDriver(a.base_url, a.served_model, a.api_key, a.prompt_format,
                                  detokenize=lambda ids: self.tokenizer.decode(ids), logprobs=not a.no_logprobs,
                                  tokenize=lambda text: self.tokenizer.encode(text, add_special_tokens=False))
            return driver, "server"
        from carpool.engine import LLMEngine

        cfg = replace(self.base, scheduler=spec.name,
                      max_num_batched_tokens=spec.budget or self.base.max_num_batched_tokens)
        if spec.dynamic:  # a placeholder target until the SLO's is known (follow_slo)
            cfg = replace(cfg, target_tbt_ms=cfg.target_tbt_ms or 1e3)
        else:
            cfg = replace(cfg, target_tbt_ms=0, cost_profile=None)  # a fixed budget
        engine = LLMEngine(cfg)
        self._tokenizer = self._tokenizer or engine.tokenizer
        self.max_model_len = engine.max_model_len
        driver = InProcessDriver(engine)
        return driver, spec.label if spec.dynamic else f"{spec.name}:{cfg.max_num_batched_tokens}"

    def follow_slo(self, driver, spec: SchedulerSpec | None, tbt: float) -> None:
        """A `sarathi:dynamic` engine targets `tbt` seconds, unless --target-tbt-ms fixed its target."""
        if spec is not None and spec.dynamic and not self.base.target_tbt_ms:
            driver.engine.scheduler.set_target(tbt)
            say(f"  {spec.label}: target TBT {tbt * 1e3:.1f} ms")

    @staticmethod
    def check_workload(cfg: WorkloadConfig) -> None:
        """Build the workload with placeholder tokens: bad settings and trace files fail here,
        before a model loads."""
        build_workload(cfg, PromptSource(word_ids=[0]))

    def workload(self, cfg: WorkloadConfig) -> list[RequestSpec]:
        if self.max_model_len and cfg.max_model_len is None:
            cfg = replace(cfg, max_model_len=self.max_model_len)
        return build_workload(cfg, self.prompts)


class HostContendedError(RuntimeError):
    """Other processes kept using the CPUs: measurements would be wrong, so none are reported."""


def measured_run(args, driver, specs: list[RequestSpec], stop=None) -> RunResult:
    """Run once the host is quiet; if other processes start using the CPUs mid-run, stop, wait
    and run again (up to --retries times). Only in process: a local server would count as load."""
    guard = isinstance(driver, InProcessDriver) and not getattr(args, "no_contention_check", True)
    if not guard:
        return driver.run(specs, stop=stop)
    started = time.monotonic()
    for attempt in range(1, args.retries + 2):
        if not wait_for_quiet(log=say):
            say("  warning: the host did not go quiet within 15 min; measuring anyway")
        monitor = ContentionMonitor(args.contention_cores)
        result = driver.run(specs, stop=combine(stop, monitor))
        if not (result.stopped_early or "").startswith("host contended"):
            result.notes.update(other_cpu_peak_cores=monitor.peak, attempts=attempt,
                                waited_s=time.monotonic() - started - (result.end_time - result.start_time))
            return result
        say(f"  {result.stopped_early}: discarding this run and measuring again")
    raise HostContendedError(f"other processes kept using the CPUs through {args.retries + 1} attempts; "
                             "rerun when the machine is idle (or pass --no-contention-check)")


def reference_decode_time(driver, prompts: PromptSource, context: int, tokens: int = 32, args=None) -> float:
    """One request alone: the median decode-only iteration (in process) or the median TBT (HTTP).
    The 'single-request decode iteration time' that relative SLOs and the stall threshold use."""
    import numpy as np

    ids = prompts.sample(np.random.default_rng(1234), context)
    spec = RequestSpec(0, 0.0, ids, tokens)
    result = measured_run(args, driver, [spec]) if args is not None else driver.run([spec])
    med = decode_iteration_median(result.iterations)
    if med is None:
        gaps = [g for t in result.timelines for g in tbts(t)]
        if not gaps:
            raise RuntimeError(f"reference request produced no TBTs: {result.timelines}")
        med = statistics.median(gaps)
    return med


def row_of(label: str, qps: float | None, summary: Summary, extra: dict | None = None) -> dict:
    s = summary
    row = {"label": label, "qps": qps, "requests": s.num_requests, "completed": s.num_completed,
           "output_tokens_per_s": s.output_tokens_per_s, "requests_per_s": s.requests_per_s,
           "ttft_p50": s.ttft.p50, "ttft_p99": s.ttft.p99, "tbt_p50": s.tbt.p50, "tbt_p99": s.tbt.p99,
           "tbt_max": s.tbt.max, "scheduling_delay_p50": s.scheduling_delay.p50,
           "e2e_p50": s.e2e_latency.p50, "num_stalls": s.num_stalls, "stall_time": s.stall_time,
           "preemptions": s.num_preemptions, "duration": s.duration,
           "prompt_tokens": s.prompt_tokens, "cached_prompt_tokens": s.cached_prompt_tokens,
           "prefill_tokens_per_request": (s.iterations.get("prefill_tokens", 0) / s.num_requests
                                          if s.iterations.get("count") and s.num_requests else None)}
    row.update(extra or {})
    return row


def fmt(v, scale: float = 1.0, digits: int = 0) -> str:
    if v is None or (isinstance(v, float) and not math.isfinite(v)):
        return "-"
    return f"{v * scale:.{digits}f}"


def print_table(rows: list[dict], columns: list[tuple[str, str, float, int]]) -> str:
    """columns: (key, header, scale, digits); returns the markdown table it printed."""
    lines = ["| " + " | ".join(h for _, h, _, _ in columns) + " |",
             "|" + "---|" * len(columns)]
    for r in rows:
        cells = [str(r.get(k, "-")) if isinstance(r.get(k), str) else fmt(r.get(k), s, d) for k, _, s, d in columns]
        lines.append("| " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    say(text)
    return text


SERVING_COLUMNS = [("label", "scheduler", 1, 0), ("qps", "QPS", 1, 2), ("completed", "done", 1, 0),
                   ("output_tokens_per_s", "out tok/s", 1, 1), ("ttft_p50", "TTFT p50 s", 1, 2),
                   ("ttft_p99", "TTFT p99 s", 1, 2), ("tbt_p50", "TBT p50 ms", 1e3, 0),
                   ("tbt_p99", "TBT p99 ms", 1e3, 0), ("tbt_max", "TBT max ms", 1e3, 0),
                   ("scheduling_delay_p50", "sched p50 s", 1, 2), ("num_stalls", "stalls", 1, 0),
                   ("stall_time", "stall s", 1, 1), ("preemptions", "preempt", 1, 0),
                   ("prefill_tokens_per_request", "prefill tok/req", 1, 0)]


def run_meta(args, target: Target, extra: dict | None = None) -> dict:
    meta = {"command": " ".join(sys.argv), "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "load_average": os.getloadavg()}
    if target.base is not None and not target.online:
        meta["engine"] = {k: v for k, v in asdict(target.base).items() if k != "model"}
    meta.update(extra or {})
    return meta


def write_results(out: Path, rows: list[dict], meta: dict, name: str = "results", with_json: bool = True) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if with_json:
        (out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(out / f"{name}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, keys)
        w.writeheader()
        w.writerows(rows)


# ---------------------------------------------------------------- serving / burst / ablation
def default_spec(base: EngineConfig | None) -> SchedulerSpec:
    """The engine's own policy, as `carpool serve` would run it: sarathi with --target-tbt-ms
    follows that target."""
    name = base.scheduler if base else "sarathi"
    return SchedulerSpec(name, dynamic=name == "sarathi" and base is not None and base.target_tbt_ms is not None)


def run_serving(args, base: EngineConfig | None, default_schedulers: list[SchedulerSpec] | None = None,
                columns=SERVING_COLUMNS) -> list[dict]:
    """Every scheduler x every QPS: one run each; per-run reports under OUTPUT/LABEL/qps_Q."""
    specs = args.schedulers or default_schedulers or [default_spec(base)]
    target = Target(args, base)
    if not target.online:
        check_schedulers(specs)
    if args.arrivals == "burst":
        qps_list = [None]
    else:
        qps_list = args.qps or ([None] if args.arrivals == "trace" else [1.0])
    target.check_workload(workload_config(args, qps=qps_list[0]))
    out = Path(args.output)
    rows, runs, curves = [], {}, {}
    reference = None
    for spec in target.labels(specs):
        driver, label = target.driver(spec)
        say(f"== {label}")
        driver.warmup()
        if reference is None:
            ctx = int(statistics.median(s.prompt_len for s in target.workload(workload_config(args, qps=qps_list[0]))))
            reference = reference_decode_time(driver, target.prompts, ctx, args=args)
            say(f"reference single-request decode iteration: {reference * 1e3:.1f} ms (context {ctx})")
        if not target.online:
            target.follow_slo(driver, spec, parse_slo("strict", reference).tbt_p99)
        for qps in qps_list:
            wcfg = workload_config(args, qps=qps)
            workload = target.workload(wcfg)
            result = measured_run(args, driver, workload)
            summary, per_request = summarize(result.timelines, result.iterations, args.stall_threshold, reference)
            qtag = "burst" if qps is None else f"qps_{qps:g}"
            write_report(out / label.replace(":", "_") / qtag, summary, per_request, result.timelines,
                         result.iterations, run_meta(args, target, {"workload": asdict(wcfg),
                                                                    "workload_stats": describe(workload),
                                                                    "driver": result.notes,
                                                                    "reference_decode_time": reference}))
            row = row_of(label, qps, summary, {"wall_s": result.end_time - result.start_time})
            rows.append(row)
            runs[(label, qps)] = result.timelines
            curves.setdefault(label, []).append({"qps": qps, "ttft_p99": summary.ttft.p99, "tbt_p99": summary.tbt.p99})
            say(f"  {qtag}: {summary.num_completed}/{summary.num_requests} done, "
                f"{summary.output_tokens_per_s:.1f} out tok/s, TTFT p50 {fmt(summary.ttft.p50, 1, 2)} s, "
                f"TBT p99 {fmt(summary.tbt.p99, 1e3)} ms, max gap {fmt(summary.tbt.max, 1e3)} ms, "
                f"{summary.num_stalls} stalls, prefill {fmt(row['prefill_tokens_per_request'])} tokens/request "
                f"({summary.cached_prompt_tokens} of {summary.prompt_tokens} prompt tokens cached)")
        del driver
        gc.collect()
    meta = run_meta(args, target, {"reference_decode_time": reference,
                                   "stall_threshold": args.stall_threshold or 5 * reference})
    write_results(out, rows, meta)
    (out / "table.md").write_text(print_table(rows, columns) + "\n")
    if not args.no_plots:
        threshold = args.stall_threshold or 5 * reference
        for qps in qps_list:
            group = {lbl: tl for (lbl, q), tl in runs.items() if q == qps}
            tag = "burst" if qps is None else f"qps_{qps:g}"
            plots.tbt_cdf(group, out / f"tbt_cdf_{tag}.png", title=f"TBT CDF ({tag})")
            plots.token_timeline(group, out / f"timeline_{tag}.png", threshold,
                                 max_requests=getattr(args, "timeline_requests", 40))
        if len(qps_list) > 1:
            plots.latency_vs_qps(curves, out / "latency_vs_qps.png")
    say(f"results in {out}/")
    return rows


BURST_COLUMNS = [("label", "target", 1, 0), ("completed", "done", 1, 0), ("output_tokens_per_s", "out tok/s", 1, 1),
                 ("ttft_p50", "TTFT p50 s", 1, 2), ("tbt_p50", "TBT p50 ms", 1e3, 0),
                 ("tbt_p99", "TBT p99 ms", 1e3, 0), ("tbt_max", "largest gap ms", 1e3, 0),
                 ("duration", "makespan s", 1, 1)]

ABLATION_COLUMNS = [("label", "scheduler", 1, 0), ("qps", "QPS", 1, 2), ("ttft_p50", "TTFT p50 s", 1, 2),
                    ("ttft_p99", "TTFT p99 s", 1, 2), ("tbt_p50", "TBT p50 ms", 1e3, 0),
                    ("tbt_p99", "TBT p99 ms", 1e3, 0), ("output_tokens_per_s", "out tok/s", 1, 1),
                    ("completed", "done", 1, 0)]


def run_burst(args, base: EngineConfig | None) -> list[dict]:
    rows = run_serving(args, base, columns=BURST_COLUMNS)
    for r in rows:
        ok_gap = r["tbt_max"] is not None and r["tbt_max"] <= args.max_gap
        say(f"{r['label']}: {r['output_tokens_per_s']:.1f} output tok/s "
            f"({r['output_tokens_per_s'] / args.reference_tps:.1f}x the {args.reference_tps:g} tok/s reference), "
            f"largest inter-token gap {fmt(r['tbt_max'], 1e3)} ms "
            f"({'within' if ok_gap else 'OVER'} {args.max_gap:g} s)")
    return rows


def run_ablation(args, base: EngineConfig | None) -> list[dict]:
    defaults = [SchedulerSpec(n) for n in ("hybrid-only", "chunked-only", "sarathi")]
    return run_serving(args, base, defaults, columns=ABLATION_COLUMNS)


# ---------------------------------------------------------------- capacity
class CapacityRunner:
    """Evaluates (scheduler, QPS) runs for the capacity search; complete runs are cached and
    reused for every SLO, runs stopped early only for SLOs at least as strict as theirs."""

    def __init__(self, args, target: Target, driver, label: str, reference: float, out: Path):
        self.args, self.target, self.driver, self.label = args, target, driver, label
        self.reference, self.out = reference, out
        self.cache: dict[float, tuple[Summary, str | None, SLO, float]] = {}
        self.curve: dict[float, dict] = {}

    def workload(self, qps: float) -> list[RequestSpec]:
        n = max(self.args.min_requests, math.ceil(qps * self.args.duration))
        return self.target.workload(workload_config(self.args, qps=qps, num_requests=n))

    def evaluate(self, qps: float, slo: SLO) -> Evaluation:
        qps = round(qps, 4)
        cached = self.cache.get(qps)
        # A complete run serves every SLO; one stopped early (it failed) also fails any SLO at
        # least as strict as the one it was stopped under.
        if cached and (cached[1] is None or (slo.tbt_p99 <= cached[2].tbt_p99 and
                                             slo.scheduling_delay_p50 <= cached[2].scheduling_delay_p50)):
            summary, stopped, _, secs = cached
        else:
            specs = self.workload(qps)
            total_tbts = sum(s.output_len - 1 for s in specs)
            monitor = SLOMonitor(slo, len(specs), total_tbts, check_scheduling=not self.target.online)
            result = measured_run(self.args, self.driver, specs, stop=monitor)
            secs = result.end_time - result.start_time  # the measured run only, not waits for a quiet host
            summary, per_request = summarize(result.timelines, result.iterations, self.args.stall_threshold,
                                             self.reference)
            stopped = result.stopped_early
            self.cache[qps] = (summary, stopped, slo, secs)
            if not stopped:
                write_report(self.out / self.label.replace(":", "_") / f"qps_{qps:g}", summary, per_request,
                             result.timelines, result.iterations,
                             run_meta(self.args, self.target, {"workload_stats": describe(specs),
                                                               "reference_decode_time": self.reference}))
                self.curve[qps] = {"qps": qps, "ttft_p99": summary.ttft.p99, "tbt_p99": summary.tbt.p99}
        if stopped:
            passed, reason = False, f"stopped early: {stopped}"
        else:
            passed, reason = slo.check(summary)
        metrics = {"requests": summary.num_requests, "tbt_p99": summary.tbt.p99, "ttft_p50": summary.ttft.p50,
                   "ttft_p99": summary.ttft.p99, "scheduling_delay_p50": summary.scheduling_delay.p50,
                   "output_tokens_per_s": summary.output_tokens_per_s, "stopped_early": bool(stopped)}
        return Evaluation(qps, passed, reason, metrics, secs)


def dynamic_report(driver) -> dict:
    """What an SLO-following engine learned and did: its fitted step-time coefficients and margin,
    and how many of its iterations so far (all runs of this engine) had an unreachable target."""
    sched = getattr(getattr(driver, "engine", None), "scheduler", None)
    cost = getattr(sched, "cost", None)
    if cost is None:
        return {}
    return {"target_tbt": sched.target_tbt, "step_cost": cost.coefficients(), "step_cost_margin": cost.margin,
            "slo_unreachable_iterations": sched.num_slo_unreachable}


def capacity_settings(args) -> None:
    """Fill the search sizes not given on the command line from the quick or full preset."""
    preset = QUICK if args.quick else FULL
    for k, v in preset.items():
        if getattr(args, k) is None:
            setattr(args, k, v)


def run_capacity(args, base: EngineConfig | None, specs: list[SchedulerSpec] | None = None,
                 out: Path | None = None) -> dict:
    capacity_settings(args)
    specs = specs or args.schedulers
    target = Target(args, base)
    if not target.online:
        check_schedulers(specs)
    out = out or Path(args.output)
    for s in args.slo:  # fail on a bad SLO or workload before loading anything
        parse_slo(s, 1.0, args.scheduling_delay)
    target.check_workload(workload_config(args, qps=args.start_qps))
    started = time.monotonic()
    reference = args.reference_decode_time
    results: list[dict] = []
    curves: dict[str, list[dict]] = {}
    say(f"capacity search: duration {args.duration:g} s per rate (>= {args.min_requests} requests), "
        f"resolution {args.resolution:g}, at most {args.max_evals} rates per search")
    for spec in target.labels(specs):
        driver, label = target.driver(spec)
        driver.warmup()
        if reference is None:
            ctx = int(statistics.median(s.prompt_len for s in target.workload(workload_config(args, qps=1.0))))
            reference = reference_decode_time(driver, target.prompts, ctx, args=args)
            say(f"reference single-request decode iteration: {reference * 1e3:.1f} ms (context {ctx})")
        runner = CapacityRunner(args, target, driver, label, reference, out)
        for slo_name in args.slo:
            if spec is not None and spec.slo is not None and spec.slo != slo_name:
                continue
            slo = parse_slo(slo_name, reference, args.scheduling_delay)
            if spec is not None and spec.dynamic:  # runs under another target are no use here
                target.follow_slo(driver, spec, slo.tbt_p99)
                runner.cache.clear()
            say(f"== {label}, {slo_name} SLO: P99 TBT <= {slo.tbt_p99 * 1e3:.0f} ms, "
                f"P50 scheduling delay <= {slo.scheduling_delay_p50:g} s")
            res: CapacityResult = search_capacity(partial(runner.evaluate, slo=slo), args.start_qps,
                                                  min_qps=args.min_qps, max_qps=args.max_qps,
                                                  rel_tol=args.resolution, max_evals=args.max_evals, log=say)
            say(f"  capacity {res.capacity:.3f} QPS (bracket {fmt(res.lower, 1, 3)}..{fmt(res.upper, 1, 3)}, "
                f"resolution {fmt(res.resolution, 1, 3)} QPS{'' if res.converged else ', NOT converged'})")
            results.append({"label": label, "slo": slo_name, "tbt_slo": slo.tbt_p99,
                            "scheduling_delay_bound": slo.scheduling_delay_p50, **res.to_dict(),
                            **dynamic_report(driver)})
        curves[label] = sorted(runner.curve.values(), key=lambda p: p["qps"])
        del driver, runner
        gc.collect()
    elapsed = time.monotonic() - started
    meta = run_meta(args, target, {"reference_decode_time": reference, "elapsed_s": elapsed,
                                   "search": {k: getattr(args, k) for k in ("duration", "min_requests", "max_evals",
                                                                          "resolution", "start_qps", "min_qps",
                                                                          "max_qps", "quick")},
                                   "workload": asdict(workload_config(args, qps=1.0))})
    out.mkdir(parents=True, exist_ok=True)
    (out / "capacity.json").write_text(json.dumps({"meta": meta, "results": results, "curves": curves}, indent=2))
    table_rows = [{"label": r["label"], "slo": r["slo"], "tbt_slo": r["tbt_slo"], "capacity": r["capacity"],
                   "resolution": r["resolution"], "evals": len(r["evaluations"])} for r in results]
    write_results(out, table_rows, meta, name="capacity", with_json=False)
    text = print_table(table_rows, [("label", "scheduler", 1, 0), ("slo", "SLO", 1, 0),
                                    ("tbt_slo", "P99 TBT SLO ms", 1e3, 0), ("capacity", "capacity QPS", 1, 3),
                                    ("resolution", "+/- QPS", 1, 3), ("evals", "runs", 1, 0)])
    (out / "capacity.md").write_text(text + "\n")
    if not args.no_plots and results:
        table: dict[str, dict[str, float]] = {}
        for r in results:
            table.setdefault(r["slo"], {})[r["label"]] = r["capacity"]
        plots.capacity_bars(table, out / "capacity.png")
        if any(len(c) > 0 for c in curves.values()):
            plots.latency_vs_qps({k: v for k, v in curves.items() if v}, out / "latency_vs_qps.png")
    say(f"done in {elapsed / 60:.1f} min; results in {out}/")
    return {"results": results, "reference": reference, "elapsed": elapsed}


# ---------------------------------------------------------------- token budget sweep
def prefill_time(driver, prompts: PromptSource, prompt_len: int, repeats: int, args=None) -> float:
    """Median over repeats of the summed iteration time to prefill one prompt alone."""
    import numpy as np

    times = []
    for r in range(repeats):
        ids = prompts.sample(np.random.default_rng(100 + r), prompt_len)
        result = measured_run(args, driver, [RequestSpec(0, 0.0, ids, 1)]) if args else driver.run(
            [RequestSpec(0, 0.0, ids, 1)])
        times.append(sum(it.duration for it in result.iterations if it.num_prefill_tokens))
    return statistics.median(times)


def run_budget_sweep(args, base: EngineConfig) -> list[dict]:
    if args.base_url:
        raise ValueError("budget-sweep changes the engine's token budget, so it runs in process only")
    target = Target(args, base)
    check_schedulers([SchedulerSpec(args.sweep_scheduler)])
    target.check_workload(workload_config(args, qps=args.qps[0]))
    for slo in args.capacity_slo or []:
        parse_slo(slo, 1.0)
    out = Path(args.output)
    P = args.overhead_prompt_len
    driver, _ = target.driver(SchedulerSpec(args.sweep_scheduler, P))
    driver.warmup()
    unchunked = prefill_time(driver, target.prompts, P, args.overhead_repeats, args)
    ctx = int(statistics.median(s.prompt_len for s in target.workload(workload_config(args, qps=args.qps[0]))))
    reference = reference_decode_time(driver, target.prompts, ctx, args=args)
    del driver
    say(f"unchunked prefill of {P} tokens: {unchunked * 1e3:.0f} ms; reference decode {reference * 1e3:.1f} ms")
    rows, runs = [], {}
    for budget in args.budgets:
        spec = SchedulerSpec(args.sweep_scheduler, budget)
        driver, label = target.driver(spec)
        driver.warmup()
        chunked = prefill_time(driver, target.prompts, P, args.overhead_repeats, args)
        row = {"label": label, "budget": budget, "prefill_ms": chunked * 1e3,
               "prefill_overhead": chunked / unchunked - 1}
        say(f"== budget {budget}: prefill {P} tokens {chunked * 1e3:.0f} ms ({row['prefill_overhead']:+.1%})")
        for qps in args.qps:
            wcfg = workload_config(args, qps=qps)
            workload = target.workload(wcfg)
            result = measured_run(args, driver, workload)
            summary, per_request = summarize(result.timelines, result.iterations, args.stall_threshold, reference)
            write_report(out / f"budget_{budget}" / f"qps_{qps:g}", summary, per_request, result.timelines,
                         result.iterations, run_meta(args, target, {"workload": asdict(wcfg),
                                                                    "reference_decode_time": reference}))
            rows.append({**row, **row_of(label, qps, summary)})
            runs[(label, qps)] = result.timelines
            say(f"  qps {qps:g}: TTFT p50 {fmt(summary.ttft.p50, 1, 2)} s, TBT p99 {fmt(summary.tbt.p99, 1e3)} ms")
        del driver
        gc.collect()
    slos = args.capacity_slo or []
    if slos:
        args.slo = slos
        args.reference_decode_time = reference
        res = run_capacity(args, base, [SchedulerSpec(args.sweep_scheduler, b) for b in args.budgets],
                           out=out / "capacity")
        for r in rows:
            for c in res["results"]:
                if c["label"] == r["label"]:
                    r[f"capacity_{c['slo']}"] = c["capacity"]
    meta = run_meta(args, target, {"unchunked_prefill_s": unchunked, "overhead_prompt_len": P,
                                   "reference_decode_time": reference})
    write_results(out, rows, meta)
    cols = [("budget", "budget", 1, 0), ("prefill_ms", f"prefill {P} ms", 1, 0),
            ("prefill_overhead", "overhead %", 100, 1), ("qps", "QPS", 1, 2), ("ttft_p50", "TTFT p50 s", 1, 2),
            ("tbt_p99", "TBT p99 ms", 1e3, 0), ("output_tokens_per_s", "out tok/s", 1, 1)]
    for slo in slos:
        cols.append((f"capacity_{slo}", f"capacity {slo} QPS", 1, 3))
    (out / "table.md").write_text(print_table(rows, cols) + "\n")
    if not args.no_plots:
        for qps in args.qps:
            plots.tbt_cdf({lbl: tl for (lbl, q), tl in runs.items() if q == qps}, out / f"tbt_cdf_qps_{qps:g}.png",
                          title=f"TBT CDF by token budget (QPS {qps:g})")
    say(f"results in {out}/")
    return rows
