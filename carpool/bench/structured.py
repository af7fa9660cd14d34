"""`carpool bench structured`: do constrained outputs hold, and what do they cost per decode step?

Validity: every schema of carpool/data/structured/schemas.json (53, varied: nested objects,
arrays, enums, ranges, optional fields, patterns, formats, anyOf/oneOf/allOf, $ref) is asked for
through the chat template, greedy and sampled, and each output is parsed and validated with
`jsonschema` (formats checked too, as draft 2020-12 defines them).

Cost: rounds of `--batch` requests decode together, all constrained (each its own schema) or none
(the same prompts), rounds alternating so that both see the same host; the step times compared
are those of pure decode steps with the whole batch running. The engine's mask statistics say how
much of the mask work the forward pass hid.
"""

from __future__ import annotations

import json
import statistics
import time
from importlib import resources
from pathlib import Path

from carpool.config import EngineConfig
from carpool.sampling_params import SamplingParams, StructuredOutputsParams


def load_schemas() -> list[dict]:
    data = resources.files("carpool.data").joinpath("structured/schemas.json").read_text()
    return json.loads(data)["schemas"]


def chat_ids(engine, text: str) -> list[int]:
    ids = engine.tokenizer.apply_chat_template([{"role": "user", "content": text + " Answer in JSON."}],
                                               tokenize=True, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def run_all(engine, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    ids = [engine.add_request(p, sp).request_id for p, sp in zip(prompts, params)]
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    return [final[i] for i in ids]


def validity(engine, schemas: list[dict], max_tokens: int, seed: int) -> list[dict]:
    """One greedy and one sampled output per schema, each parsed and validated."""
    import jsonschema

    prompts, params, rows = [], [], []
    for s in schemas:
        for mode, temperature in (("greedy", 0.0), ("sampled", 0.8)):
            prompts.append(chat_ids(engine, s["prompt"]))
            params.append(SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed,
                                         structured_outputs=StructuredOutputsParams(json=s["schema"])))
            rows.append({"schema": s["name"], "mode": mode})
    for row, out, s in zip(rows, run_all(engine, prompts, params), [s for s in schemas for _ in range(2)]):
        row.update(text=out.text, finish_reason=out.finish_reason, tokens=len(out.token_ids), error=None)
        try:
            validator = jsonschema.Draft202012Validator(
                s["schema"], format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
            validator.validate(json.loads(out.text))
            row["valid"] = True
        except (ValueError, jsonschema.ValidationError) as e:
            row["valid"], row["error"] = False, str(e).splitlines()[0]
    return rows


def timed_round(engine, prompts: list[list[int]], params: list[SamplingParams]) -> list[float]:
    """Durations of the round's steps that decode the whole batch and nothing else."""
    first = len(engine.iteration_stats)
    run_all(engine, prompts, params)
    stats = list(engine.iteration_stats)[first:]
    return [s.duration for s in stats if s.num_prefill_tokens == 0 and s.num_decode_tokens == len(prompts)]


def step_times(engine, schemas: list[dict], batch: int, rounds: int, max_tokens: int) -> dict:
    chosen = [schemas[i % len(schemas)] for i in range(batch)]
    prompts = [chat_ids(engine, s["prompt"]) for s in chosen]
    plain = [SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True) for _ in chosen]
    constrained = [SamplingParams(max_tokens=max_tokens, temperature=0,
                                  structured_outputs=StructuredOutputsParams(json=s["schema"])) for s in chosen]
    times: dict[str, list[float]] = {"unconstrained": [], "constrained": []}
    timed_round(engine, prompts, plain)  # warm-up: kernels, the grammar thread, compiled schemas
    timed_round(engine, prompts, constrained)
    stats = engine.structured.stats
    before = (stats.num_masks, stats.compute_seconds, stats.wait_seconds, stats.num_jobs)
    for _ in range(rounds):  # interleaved, so that both see the same host
        times["unconstrained"] += timed_round(engine, prompts, plain)
        times["constrained"] += timed_round(engine, prompts, constrained)
    masks = stats.num_masks - before[0]
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "batch": batch, "rounds": rounds, "steps": {k: len(v) for k, v in times.items()},
        "median_step_ms": {k: v * 1e3 for k, v in med.items()},
        "mean_step_ms": {k: statistics.fmean(v) * 1e3 for k, v in times.items()},
        "ratio_median": med["constrained"] / med["unconstrained"],
        "masks": masks,
        "mask_compute_us_per_row": (stats.compute_seconds - before[1]) / max(masks, 1) * 1e6,
        "mask_wait_ms_per_constrained_step": (stats.wait_seconds - before[2]) / max(stats.num_jobs - before[3], 1) * 1e3,
        "times_ms": {k: [t * 1e3 for t in v] for k, v in times.items()},
    }


def run_structured_bench(config: EngineConfig, args) -> dict:
    from carpool.harness.metrics import cpu_name
    from carpool.engine import LLMEngine

    engine = LLMEngine(config)
    schemas = load_schemas()
    started = time.time()
    rows = validity(engine, schemas, args.max_tokens, args.seed)
    timing = step_times(engine, schemas, args.batch, args.rounds, args.decode_tokens)
    result = {
        "date": time.strftime("%Y-%m-%d"), "cpu": cpu_name(), "model": config.model, "dtype": str(engine.dtype),
        "num_schemas": len(schemas), "outputs": len(rows), "valid": sum(r["valid"] for r in rows),
        "finished_stop": sum(r["finish_reason"] == "stop" for r in rows),
        "step_time": timing, "validity": rows, "seconds": time.time() - started,
    }
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    (out / "structured.json").write_text(json.dumps(result, indent=2))
    plot(result, out / "structured.png")
    t = timing
    print(f"validity: {result['valid']}/{result['outputs']} outputs parse and validate "
          f"({result['num_schemas']} schemas, greedy + sampled); {result['finished_stop']} finished by the grammar")
    for r in rows:
        if not r["valid"]:
            print(f"  invalid: {r['schema']} ({r['mode']}, {r['finish_reason']}): {r['error']}")
    print(f"batch {t['batch']} decode step, median of {t['steps']['constrained']} / {t['steps']['unconstrained']} "
          f"steps: constrained {t['median_step_ms']['constrained']:.2f} ms, unconstrained "
          f"{t['median_step_ms']['unconstrained']:.2f} ms, ratio {t['ratio_median']:.3f}; mask "
          f"{t['mask_compute_us_per_row']:.0f} us per row in the background, engine waited "
          f"{t['mask_wait_ms_per_constrained_step']:.3f} ms per step")
    print(f"wrote {out / 'structured.json'} and {out / 'structured.png'}")
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = result["step_time"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    for label, times in t["times_ms"].items():
        xs = sorted(times)
        a.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=f"{label} (median {statistics.median(xs):.1f} ms)")
    a.set_xlabel("decode step time (ms)")
    a.set_ylabel("CDF")
    a.set_title(f"batch {t['batch']}: constrained / unconstrained = {t['ratio_median']:.3f}")
    a.legend(fontsize=8)
    names = sorted({r["schema"] for r in result["validity"]})
    valid = {n: sum(r["valid"] for r in result["validity"] if r["schema"] == n) for n in names}
    b.bar(range(len(names)), [valid[n] for n in names], color=["tab:green" if valid[n] == 2 else "tab:red" for n in names])
    b.set_xticks(range(len(names)), names, rotation=90, fontsize=5)
    b.set_ylabel("valid outputs (of 2)")
    b.set_title(f"{result['valid']}/{result['outputs']} outputs validate")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
