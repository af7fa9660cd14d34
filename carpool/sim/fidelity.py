"""How close the simulator comes to the engine on this machine.

Runs the same workload (same seed, same lengths and arrivals) twice per scheduler: on the real
engine through the in-process benchmark driver, and through the simulator with the profiled cost
model. Two errors are reported:

- per iteration: the cost model's prediction for each batch the engine actually ran, against the
  measured step time (this isolates the cost model from scheduling divergence);
- per run: TTFT and TBT P50/P99 of the simulation against the real run's.

Each is reported twice: for the profile's cost model, and for the online step-time fit the
SLO-following sarathi uses (core/step_cost.py), seeded from the same profile. The fit's
iteration error is one step ahead (each step predicted before it is observed); its simulation
uses the fit as it stood at the end of the real run, scaled to the run's median step as a
profile's fit is to its own (`FittedCostModel.from_fit`): it follows the host's speed as it drifts,
which a profile taken minutes earlier cannot. A third column keeps the profile's weights and
follows only the host's speed: each step's prediction scaled by its kind's median measured /
predicted ratio over its last steps (as the online fit scales its own, `speed_followed`), and a
simulation on the profile with each kind scaled by its median ratio over the run (`AtRunSpeed`).
It separates what the profile's shape gets wrong from how fast the host happened to run.
`steps.jsonl` lists every real step (its whole shape, the idle time before it, measured and
predicted times) and `requests.jsonl` every request (its queueing, TTFT and longest gap, real and
simulated), to see where errors sit. The SLO-following sarathi runs at the engine's default
target unless --target-tbt-ms is given.

A latency is only as reproducible as the engine's own: near saturation a queue turns the host's
jitter into whole steps of waiting, and one request more or less in a step moves a percentile of
40 requests. `--real-runs 2` serves the workload again and compares the second run's latencies
with the first's exactly as a simulation's are compared: the floor under the latency errors.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from carpool.config import DEFAULT_TARGET_TBT_MS
from carpool.core.cost_profile import FittedCostModel
from carpool.core.scheduler import Scheduler, make_scheduler
from carpool.core.step_cost import (BatchShape, CostModel, StepCostModel, recent_speed, seeded_step_cost, speed_window,
                                    step_time)
from carpool.engine import LLMEngine
from carpool.harness.drivers import InProcessDriver
from carpool.harness.metrics import summarize
from carpool.harness.options import SchedulerSpec
from carpool.harness.workload import PromptSource, RequestSpec, build_workload
from carpool.server.startup import startup_objects_frozen
from carpool.sim.run import iterations, reference_decode_time, timelines, workload_config
from carpool.sim.simulator import ReplicaConfig, simulate


def relative_error(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or measured is None or measured == 0:
        return None
    return (predicted - measured) / measured


def one_step_ahead(cost: FittedCostModel, shapes: list[BatchShape], measured: list[float], budget: int,
                   max_model_len: int) -> tuple[list[float], StepCostModel]:
    """The online fit's prediction for each step made before that step is observed (seeded
    from the profile, as `--cost-profile` seeds the engine's): an out-of-sample error."""
    fit, _ = seeded_step_cost(cost, budget, max_model_len, snap=False)
    predicted = []
    for shape, seconds in zip(shapes, measured):
        predicted.append(fit.predict(shape))
        fit.observe(shape, seconds)
    return predicted, fit


def speed_followed(predicted: list[float], measured: list[float], shapes: list[BatchShape]) -> list[float]:
    """Each step's prediction times its kind's (with a prefill chunk or without) speed over the
    steps of that kind before it, by the rule the online fit scales its weights by
    (`step_cost.recent_speed`). One number per kind follows the run; the shape of the cost stays
    the profile's."""
    ratios: dict[bool, list[float]] = {False: [], True: []}
    out = []
    for p, m, shape in zip(predicted, measured, shapes):
        kind = bool(shape.prefills)
        out.append(p * recent_speed(np.array(ratios[kind][-speed_window(kind):]), kind))
        if p > 0:
            ratios[kind].append(m / p)
    return out


@dataclass
class AtRunSpeed:
    """A cost model with each kind of step scaled by its median measured / predicted ratio over a
    run: its shape at the speed the host ran. One ratio for both kinds would not do: a compute-bound
    chunk and a decode that reads the weights drift apart (in one run chunk steps ran 1.07x the
    profile and decodes 0.94x)."""

    cost: CostModel
    speeds: dict[bool, float]  # with a prefill chunk or without

    @property
    def num_stages(self) -> int:
        return self.cost.num_stages

    def stage_time(self, shape: BatchShape, stage: int) -> float:
        return self.speeds[bool(shape.prefills)] * self.cost.stage_time(shape, stage)

    @classmethod
    def of_run(cls, cost: CostModel, predicted: list[float], measured: list[float],
               shapes: list[BatchShape]) -> AtRunSpeed:
        speeds = {}
        for kind in (False, True):
            ratios = [m / p for p, m, sh in zip(predicted, measured, shapes) if bool(sh.prefills) == kind and p > 0]
            speeds[kind] = statistics.median(ratios) if ratios else 1.0
        return cls(cost, speeds)


def idle_before(steps) -> list[float]:
    """Seconds each step's engine sat idle (no step running) before it started; 0 for the first."""
    return [0.0] + [max(0.0, b.start_time - (a.start_time + a.duration)) for a, b in zip(steps, steps[1:])]


def errors_by_kind(predicted: list[float], measured: list[float], shapes: list[BatchShape]) -> dict:
    signed = (np.array(predicted) - np.array(measured)) / np.array(measured)
    errors = np.abs(signed)
    with_prefill = np.array([bool(sh.prefills) for sh in shapes])
    return {"iteration_error_p50": float(np.median(errors)),
            "iteration_error_p90": float(np.percentile(errors, 90)),
            # signed medians by kind: a bias on one kind shifts TTFT (prefills) or TBT (decodes)
            "prefill_iteration_bias": float(np.median(signed[with_prefill])) if with_prefill.any() else None,
            "decode_iteration_bias": float(np.median(signed[~with_prefill])) if (~with_prefill).any() else None}


def step_record(shape: BatchShape, measured: float, idle_before: float, profile: float, online: float,
                at_speed: float) -> dict:
    """One real step as `steps.jsonl` lists it: its whole shape, the idle time before it, and
    the measured and predicted times."""
    return {"prefills": [list(c) for c in shape.prefills], "decode_contexts": list(shape.decode_contexts),
            "num_sampled": shape.num_sampled, "num_drafts": shape.num_drafts, "idle_before_s": idle_before,
            "measured_s": measured, "profile_s": profile, "online_s": online, "profile_at_speed_s": at_speed}


def request_records(real, simulated: dict) -> list[dict]:
    """Each request's waits, real and simulated (by column: profile, online fit, ...), in arrival
    order: to see which requests a latency percentile's error comes from."""
    def waits(t) -> dict:
        ttft = t.token_times[0] - t.arrival_time if t.token_times else None
        gaps = np.diff(t.token_times) if len(t.token_times) > 1 else np.zeros(1)
        scheduled = None if t.first_scheduled_time is None else t.first_scheduled_time - t.arrival_time
        return {"queued_s": scheduled, "ttft_s": ttft, "tbt_max_s": float(gaps.max())}

    order = lambda ts: sorted(ts, key=lambda t: t.arrival_time)  # noqa: E731
    origin = min((t.arrival_time for t in real), default=0.0)
    columns = {name: order(ts) for name, ts in simulated.items()}
    return [{"arrival_s": r.arrival_time - origin, "prompt_tokens": r.num_prompt_tokens,
             "output_tokens": len(r.token_times), "real": waits(r),
             **{name: waits(ts[i]) for name, ts in columns.items()}}
            for i, r in enumerate(order(real))]


def latency_errors(real_summary, sim_summary) -> dict:
    latency = {}
    for metric in ("ttft", "tbt"):
        for q in ("p50", "p99"):
            r, s = getattr(getattr(real_summary, metric), q), getattr(getattr(sim_summary, metric), q)
            latency[f"{metric}_{q}"] = {"real": r, "simulated": s, "error": relative_error(s, r)}
    return latency


def busy_fraction(step_seconds: list[float], duration: float) -> float | None:
    """The share of a run's span (first arrival to last token) spent in steps. Near 1 the queue
    amplifies a step-time error: steps 10% long at 90% busy make the work of a 99% busy system,
    and a queue's wait (rho / (1 - rho) for M/M/1) grows from 9 to 99 service times, so TTFTs
    can be off by far more than any step."""
    return float(sum(step_seconds) / duration) if duration > 0 else None


def serve(engine: LLMEngine, new_scheduler: Callable[[], Scheduler], specs: list[RequestSpec]) -> tuple:
    """One real run of the workload under a fresh scheduler, the prefix cache cold (the driver's
    warm-up empties it): the run, its steps' stats and their shapes."""
    engine.scheduler = new_scheduler()
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
    return run, steps, shapes[-len(steps):]


def compare(engine: LLMEngine, cost: FittedCostModel, spec: SchedulerSpec, args) -> dict:
    """The profile's predictions, and the online fit's (`sarathi:dynamic`: the engine's own
    policy seeded from the profile; its simulation starts from the same seed). With
    `--real-runs` above 1 the engine serves the workload again, and each further run's latencies
    are compared with the first's as a simulation's are: the spread the engine itself shows."""
    scheduler, budget = spec.name, spec.budget or args.max_num_batched_tokens
    ref = reference_decode_time(cost)
    target = (args.target_tbt_ms or DEFAULT_TARGET_TBT_MS) / 1e3 if spec.dynamic else None  # the engine's default

    def new_scheduler():  # each run's SLO-following budget starts from the profile's seed, as the engine's does
        dynamic = {}
        if spec.dynamic:
            fit, sizes = seeded_step_cost(cost, budget, engine.max_model_len)
            dynamic = dict(target_tbt=target, cost=fit, chunk_sizes=sizes)
        return make_scheduler(scheduler, engine.block_manager, budget, args.max_num_seqs, engine.max_model_len,
                              **dynamic)

    specs = build_workload(workload_config(args, args.qps), PromptSource.from_tokenizer(engine.tokenizer))
    run, steps, shapes = serve(engine, new_scheduler, specs)
    again = [serve(engine, new_scheduler, specs) for _ in range(args.real_runs - 1)]
    measured = [s.duration for s in steps]
    predicted = [step_time(cost, sh) for sh in shapes]
    online, fit = one_step_ahead(cost, shapes, measured, budget, engine.max_model_len)
    at_speed = speed_followed(predicted, measured, shapes)
    run_speed = AtRunSpeed.of_run(cost, predicted, measured, shapes)

    # The same requests, token ids included, so that prefix-cache hits are the same too.
    cfg = ReplicaConfig(scheduler=scheduler, max_num_batched_tokens=budget,
                        max_num_seqs=args.max_num_seqs, block_size=engine.block_manager.block_size,
                        num_blocks=engine.block_manager.num_blocks, max_model_len=engine.max_model_len,
                        enable_prefix_caching=engine.block_manager.enable_prefix_caching,
                        target_tbt=target, seed_fit=True, step_jitter=cost.residuals)
    real_summary, _ = summarize(run.timelines, run.iterations, decode_time=ref)
    sim = simulate(specs, cfg, cost)
    fitted_sim = simulate(specs, cfg, FittedCostModel.from_fit(fit, list(zip(shapes, measured))))  # as after the run
    speed_sim = simulate(specs, cfg, run_speed)
    sim_steps, fitted_steps, speed_steps = iterations(sim), iterations(fitted_sim), iterations(speed_sim)
    sim_summary = summarize(timelines(sim), sim_steps, decode_time=ref)[0]
    fitted_summary = summarize(timelines(fitted_sim), fitted_steps, decode_time=ref)[0]
    speed_summary = summarize(timelines(speed_sim), speed_steps, decode_time=ref)[0]
    real_busy = busy_fraction(measured, real_summary.duration)
    again_summaries = [(summarize(r.timelines, r.iterations, decode_time=ref)[0], st) for r, st, _ in again]
    return {
        "scheduler": spec.label,
        "steps": [step_record(*record)
                  for record in zip(shapes, measured, idle_before(steps), predicted, online, at_speed)],
        "requests": request_records(run.timelines, {"profile": timelines(sim), "online": timelines(fitted_sim),
                                                    "profile_at_speed": timelines(speed_sim),
                                                    **{f"real_run_{i + 2}": r.timelines
                                                       for i, (r, _, _) in enumerate(again)}}),
        "iterations": len(steps),
        **errors_by_kind(predicted, measured, shapes),
        "iteration_time_real_s": float(np.sum(measured)),
        "iteration_time_predicted_s": float(np.sum(predicted)),
        "latency": latency_errors(real_summary, sim_summary),
        "busy": {"real": real_busy,
                 "simulated": busy_fraction([r.duration for r in sim_steps], sim_summary.duration)},
        "simulated_iterations": len(sim.micro_batches),
        "online": {**errors_by_kind(online, measured, shapes),
                   "latency": latency_errors(real_summary, fitted_summary),
                   "busy": {"real": real_busy,
                            "simulated": busy_fraction([r.duration for r in fitted_steps], fitted_summary.duration)},
                   "coefficients": fit.coefficients()},
        "profile_at_speed": {**errors_by_kind(at_speed, measured, shapes),
                             "latency": latency_errors(real_summary, speed_summary),
                             "busy": {"real": real_busy, "simulated": busy_fraction([r.duration for r in speed_steps],
                                                                                    speed_summary.duration)},
                             "run_speed": {"prefill": run_speed.speeds[True], "decode": run_speed.speeds[False]}},
        "slo_unreachable_iterations": sum(bool(s.slo_unreachable) for s in steps),
        "real_again": [{"iterations": len(st), "latency": latency_errors(real_summary, summary),
                        "busy": {"real": real_busy, "simulated": busy_fraction([x.duration for x in st],
                                                                                summary.duration)}}
                       for summary, st in again_summaries],
    }


def run_fidelity(config, args) -> dict:
    engine = LLMEngine(config)
    cost = FittedCostModel.load(args.profile)
    with startup_objects_frozen():
        results = [compare(engine, cost, spec, args) for spec in args.schedulers]
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    for name in ("steps", "requests"):  # every step and request, to see where the errors sit
        with (out / f"{name}.jsonl").open("w") as f:
            for r in results:
                for record in r.pop(name):
                    f.write(json.dumps({"scheduler": r["scheduler"], **record}) + "\n")
    (out / "fidelity.json").write_text(json.dumps({"profile": args.profile, "results": results}, indent=2))
    lines = ["| scheduler | iterations | iteration error P50 / P90 | bias prefill / decode steps | busy real / sim | "
             "TTFT P50 real / sim (err) | "
             "TTFT P99 real / sim (err) | TBT P50 real / sim (err) | TBT P99 real / sim (err) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        rows = [(f"{r['scheduler']}, profile", r), (f"{r['scheduler']}, online fit", r["online"]),
                (f"{r['scheduler']}, profile at the host's speed", r["profile_at_speed"]),
                *((f"{r['scheduler']}, the engine again (run {i + 2})", e) for i, e in enumerate(r["real_again"]))]
        for label, e in rows:
            cells = []
            for key in ("ttft_p50", "ttft_p99", "tbt_p50", "tbt_p99"):
                v = e["latency"][key]
                cells.append(f"{v['real'] * 1e3:.0f} / {v['simulated'] * 1e3:.0f} ms ({v['error']:+.0%})")
            busy = " / ".join("-" if b is None else f"{b:.0%}" for b in (e["busy"]["real"], e["busy"]["simulated"]))
            if "iteration_error_p50" in e:
                bias = " / ".join("-" if b is None else f"{b:+.1%}"
                                  for b in (e["prefill_iteration_bias"], e["decode_iteration_bias"]))
                steps = f"{r['iterations']} | {e['iteration_error_p50']:.1%} / {e['iteration_error_p90']:.1%} | {bias}"
            else:  # a repeat of the real run: its latencies against the first run's, as a simulation's are
                steps = f"{e['iterations']} | - | -"
            lines.append(f"| {label} | {steps} | {busy} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    (out / "fidelity.md").write_text(table + "\n")
    print(table)
    return {"results": results}
