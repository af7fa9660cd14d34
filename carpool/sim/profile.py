"""`carpool profile`: time whole engine steps on this machine, for the simulator's cost model.

The engine serves a few designed workloads, every request of one arriving at once (so no idle
time is timed), each under a scheduler chosen for the batches it makes:
- decode ladders: 32 requests on one cached prompt (its prefill is paid once, then the prefix
  cache serves it), with staggered output lengths, so decode-only batches shrink from 32 rows
  to 1 (which then runs 24 steps alone) at contexts of 128 to 4,096;
- prefill sizes: prompts of 16 .. 2,048 tokens under vLLM's whole prefills and sarathi's chunks
  of 512, 256 and 128, beside whatever decodes are running (without the 256-token chunks the
  fit's bend at 256 tokens rested on a few whole prefills, and two profiles of one machine put a
  256-token chunk 22% apart: Xeon 480M, BENCHMARKS.md "Simulator fidelity");
- mixed contexts: decodes of prompts of many lengths side by side (a ladder's rows all share
  one context, so it cannot tell attention over each context from attention padded to the
  longest);
- small hybrids: short chunks beside a dozen decodes, as an SLO-following budget makes them, in
  steps of up to 88 tokens (the fused path runs to 95, and speculation's drafts land there).

Each step is recorded as the engine ran it: the batch's shape (`BatchShape.of`) and its measured
time (`IterationStats.duration`), which is all the per-step work the engine does, down the same
paths, kernels and thresholds it takes when it serves. core/cost_profile.py fits the step-time
model to them. Any object with the engine's serving interface can be profiled (tests profile a
synthetic engine whose cost function is known).
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

from carpool.core.cost_profile import FittedCostModel, Profile
from carpool.core.scheduler import make_scheduler
from carpool.core.step_cost import BatchShape, seed_shapes
from carpool.harness.metrics import cpu_name
from carpool.sampling_params import SamplingParams
from carpool.server.startup import startup_objects_frozen

LADDER_CONTEXTS = (128, 512, 1536, 4096)
LADDER_REQUESTS = 32
LADDER_ALONE = 24  # steps the longest request of a ladder decodes alone
PREFILL_LENGTHS = (16, 48, 96, 200, 400, 700, 1000, 1500, 2000)
PREFILL_SCHEDULERS = (("vllm", 2048), ("sarathi", 512), ("sarathi", 256), ("sarathi", 128))
MIXED_REQUESTS, MIXED_LONGEST = 24, 3072  # prompts 32 .. 3,072 tokens, spaced geometrically
SMALL_HYBRID_BUDGETS = (16, 24, 48, 88)


@dataclass(frozen=True)
class Phase:
    """Requests that arrive together and are served by one scheduler until all are done. A
    `warm` prompt runs alone first (so the requests after it find its prefix cached)."""

    name: str
    scheduler: str
    budget: int
    prompts: tuple[tuple[int, ...], ...]
    max_tokens: tuple[int, ...]
    warm: tuple[int, ...] = ()


def profile_phases(max_model_len: int, vocab: int, seed: int = 0) -> list[Phase]:
    """The designed workloads, clipped to what the model can hold."""
    rng = random.Random(seed)
    ids = lambda n: tuple(rng.randrange(vocab) for _ in range(n))  # noqa: E731
    phases = []
    for ctx in LADDER_CONTEXTS:
        ctx = min(ctx, max_model_len - 128)
        prefix = ids(ctx)
        prompts = tuple(prefix + ids(4) for _ in range(LADDER_REQUESTS))
        outputs = [8 + 2 * i for i in range(LADDER_REQUESTS)]
        outputs[-1] += LADDER_ALONE  # light load is mostly one decode at a time: time it too
        phases.append(Phase(f"decode ladder at {ctx}", "sarathi", 512, prompts, tuple(outputs), warm=prefix))
    lengths = [n for n in PREFILL_LENGTHS if n + 16 < max_model_len]
    for scheduler, budget in PREFILL_SCHEDULERS:
        budget = min(budget, max_model_len)
        phases.append(Phase(f"prefill sizes, {scheduler}:{budget}", scheduler, budget,
                            tuple(ids(n) for n in lengths), (16,) * len(lengths)))
    longest = min(MIXED_LONGEST, max_model_len - 128)
    mixed = [round(32 * (longest / 32) ** (i / (MIXED_REQUESTS - 1))) for i in range(MIXED_REQUESTS)]
    phases.append(Phase("mixed contexts", "sarathi", 512, tuple(ids(n) for n in mixed),
                        tuple(8 + 3 * i for i in range(MIXED_REQUESTS))))
    for budget in SMALL_HYBRID_BUDGETS:  # fused-path hybrids: a dozen decodes and a chunk
        phases.append(Phase(f"small hybrids, sarathi:{budget}", "sarathi", budget,
                            tuple(ids(min(160, max_model_len - 64)) for _ in range(12)), (40,) * 12))
    return phases


def run_phase(engine, phase: Phase, profile: Profile) -> None:
    """Serve one phase on `engine` under its scheduler and add every step it ran to `profile`."""
    engine.scheduler = make_scheduler(phase.scheduler, engine.block_manager, phase.budget,
                                      engine.config.max_num_seqs, engine.max_model_len)
    engine.reset_prefix_cache()
    greedy = lambda n: SamplingParams(max_tokens=n, ignore_eos=True, temperature=0)  # noqa: E731
    if phase.warm:
        engine.add_request(list(phase.warm), greedy(1))
        while engine.has_unfinished_requests():
            engine.step()
    shapes: list[BatchShape] = []
    stop_recording = engine.add_batch_observer(lambda batch: shapes.append(BatchShape.of(batch)))
    try:
        for prompt, n in zip(phase.prompts, phase.max_tokens):
            engine.add_request(list(prompt), greedy(n))
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        stop_recording()
    # each batch observed got one IterationStats entry, the last ones (the deque may be full)
    for shape, step in zip(shapes, list(engine.iteration_stats)[-len(shapes):] if shapes else []):
        profile.add(shape, step.duration)


def profile_engine(engine, repeats: int = 3, quick: bool = False) -> Profile:
    """Every phase `repeats` times (phases interleaved, so a slow spell of the host spreads over
    all of them), after one phase that is not recorded (first calls, allocator and caches)."""
    phases = profile_phases(engine.max_model_len, engine.model_config.vocab_size)
    if quick:
        phases = phases[::2]
    saved = engine.scheduler
    profile = Profile(meta={"cpu": cpu_name(), "model": str(engine.config.model or "embedded default"),
                            "num_threads": engine.config.num_threads, "repeats": repeats,
                            "phases": [p.name for p in phases]})
    try:
        run_phase(engine, phases[len(phases) // 2], Profile())
        for _ in range(repeats):
            for phase in phases:
                run_phase(engine, phase, profile)
    finally:
        engine.scheduler = saved
        engine.reset_prefix_cache()
    return profile


def agreement(a: Profile, b: Profile, max_tokens: int = 2048, max_context: int = 2048) -> dict[str, float]:
    """How far two profiles' cost models disagree over the shapes serving runs (`seed_shapes`:
    decode-only batches and a chunk beside a few decodes): |a / b - 1| per shape, and the same
    after dividing out their median ratio (`speed`: a host whose speed drifted between the two
    moves every shape alike; what is left is disagreement about shapes)."""
    fa, fb = FittedCostModel.from_profile(a), FittedCostModel.from_profile(b)
    ratios = [fa.stage_time(s, 0) / fb.stage_time(s, 0) for s in seed_shapes(max_tokens, max_context)]
    speed = statistics.median(ratios)

    def spread(gaps: list[float]) -> dict[str, float]:
        gaps = sorted(gaps)
        return {"median": statistics.median(gaps), "p90": gaps[int(0.9 * (len(gaps) - 1))], "max": gaps[-1]}

    return {"shapes": len(ratios), "speed": speed, "raw": spread([abs(r - 1) for r in ratios]),
            "shape": spread([abs(r / speed - 1) for r in ratios])}


def run_profile(config, args) -> None:
    from carpool.engine import LLMEngine

    engine = LLMEngine(config)
    with startup_objects_frozen():
        profile = profile_engine(engine, repeats=args.repeats, quick=args.quick)
    profile.write(args.output)
    print(f"wrote {len(profile.steps)} steps to {args.output}")
    if args.compare:
        gap = agreement(profile, Profile.load(args.compare), max_context=engine.max_model_len)
        raw, shape = gap["raw"], gap["shape"]
        print(f"against {args.compare}, over {gap['shapes']} step shapes: the two predict within {raw['median']:.1%} "
              f"(median), {raw['p90']:.1%} (P90), {raw['max']:.1%} (max); with their median ratio "
              f"{gap['speed']:.3f} divided out, within {shape['median']:.1%}, {shape['p90']:.1%}, {shape['max']:.1%}")
