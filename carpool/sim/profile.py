"""`carpool profile`: measure the real model runner's parts on this machine, write a CSV.

Each part is timed in isolation on exact shapes built with SyntheticBatches: linear layers
(the runner's step with `query_only` standing in for attention), prefill attention and decode
attention (the real kernel over real block tables, on every layer's cache in turn), whole
decode-only forwards where the runner fuses them into one call, LM head plus sampling, and the
per-iteration work outside the model measured on real engine steps.
"""

from __future__ import annotations

import statistics
import time

import torch

from carpool.core.cost_profile import Profile
from carpool.engine import LLMEngine
from carpool.harness.synthetic import SyntheticBatches, median_time
from carpool.model import attention as attention_module
from carpool.sampling_params import SamplingParams

# Grids are dense where the cost bends: decode attention grows faster than linearly once a
# batch's gathered KV outgrows the caches (16 -> 32 rows at 512 tokens: 2.5x the time). Linear
# interpolation over a sparse grid there under-predicted real steps: the calibration factor that
# absorbs it was 1.25 with 7 x 5 decode points, 1.09 with these.
LINEAR_TOKENS = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
PREFILL_CHUNKS = (1, 16, 32, 64, 128, 256, 384, 512, 768, 1024)
PREFILL_PREFIXES = (0, 128, 256, 512, 768, 1024, 1536, 2048)
DECODE_BATCH = (1, 2, 4, 8, 12, 16, 20, 24, 28, 32, 40, 48, 64)
DECODE_CONTEXT = (16, 128, 256, 512, 768, 1024, 1536, 2048)
SAMPLE_ROWS = (1, 4, 16, 64, 128)


def query_only(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
               meta: attention_module.AttentionMetadata, scale: float) -> torch.Tensor:
    """An attention stand-in that returns its query: what is left of a forward pass is the
    linear part. The runner takes it as its `attention` argument, for the steps timed with it."""
    return q


def profile_engine(engine: LLMEngine, repeats: int = 5, quick: bool = False) -> Profile:
    prof = Profile()
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    layers = engine.model.num_local_layers
    runner, model = engine.runner, engine.model
    synth = SyntheticBatches(engine)
    grid = profile_grid(engine.max_model_len, quick)

    def forward(batch_grants, attention=None):
        """One step, as the runner runs it (down the path it picks), to call again and again."""
        ids, pos, meta, _ = runner.prepare(synth.batch(batch_grants))
        return lambda: runner.forward(ids, pos, meta, attention=attention)

    def linear_part(batch_grants):
        return forward(batch_grants, attention=query_only)

    with torch.inference_mode():
        warm_up(linear_part, synth, vocab, gen)
        for n in grid["linear"]:
            r = synth.new(torch.randint(vocab, (n,), generator=gen).tolist())
            prof.add("linear", n, 0, median_time(linear_part([(r, n)]), repeats))
            synth.close()

        attn = model.layers[0].self_attn
        head_dim, heads, kv_heads = attn.head_dim, attn.num_heads, attn.num_kv_heads

        def attention_time(grants) -> float:
            ids, pos, meta, _ = runner.prepare(synth.batch(grants))
            q = torch.randn(len(ids), heads, head_dim, generator=gen).to(runner.kv_cache.dtype)
            k = torch.randn(len(ids), kv_heads, head_dim, generator=gen).to(runner.kv_cache.dtype)
            caches = list(runner.kv_cache)[:layers]

            def every_layer():  # each layer's own cache, so KV comes from DRAM as in a real step
                for cache in caches:
                    attention_module.paged_attention(q, k, k, cache, meta, attn.scale)
            return median_time(every_layer, repeats)

        for prefix in grid["prefill_prefix"]:
            for n in grid["prefill_chunk"]:
                r = synth.with_cached_context(prefix, gen) if prefix else synth.new([0] * n)
                if prefix:
                    r.token_ids.extend([0] * (n - 1))  # a prefill chunk, not a decode
                    r.num_prompt_tokens = len(r.token_ids)
                prof.add("prefill_attn", n, prefix, attention_time([(r, n)]))
                synth.close()

        fused = runner.fused  # small decode-only steps run their own path: time it whole
        for ctx in grid["decode_context"]:
            reqs = [synth.with_cached_context(ctx - 1, gen) for _ in range(max(grid["decode_batch"]))]
            for d in grid["decode_batch"]:
                prof.add("decode_attn", d, ctx, attention_time([(r, 1) for r in reqs[:d]]))
                if fused is not None and d <= fused.max_tokens:
                    prof.add("decode_step", d, ctx, median_time(forward([(r, 1) for r in reqs[:d]]), repeats))
            synth.close()

        hidden = torch.randn(max(SAMPLE_ROWS), model.config.hidden_size, generator=gen).to(runner.kv_cache.dtype)
        for rows in grid["sample"]:
            prof.add("sample", rows, 0, median_time(lambda: model.compute_logits(hidden[:rows]).argmax(-1), repeats))
    synth.close()
    prof.add("overhead", 0, 0, step_overhead(engine))
    prof.add("calibration", 0, 0, calibrate(engine, prof))
    return prof


def profile_grid(max_model_len: int, quick: bool = False) -> dict[str, list[int]]:
    """The shapes to time, clipped to what the model can hold (a chunk plus its prefix, a
    decode's context); `quick` keeps every other point and the last."""
    def pick(xs, limit):
        xs = [x for x in xs if x <= limit]
        return xs[::2] + xs[-1:] * (len(xs) % 2 == 0) if quick else xs

    chunks = pick(PREFILL_CHUNKS, max_model_len // 2)
    return {"linear": pick(LINEAR_TOKENS, max_model_len),
            "prefill_chunk": chunks,
            "prefill_prefix": pick(PREFILL_PREFIXES, max_model_len - max(chunks)),
            "decode_batch": pick(DECODE_BATCH, max(DECODE_BATCH)),
            "decode_context": pick(DECODE_CONTEXT, max_model_len - 1),
            "sample": pick(SAMPLE_ROWS, max(SAMPLE_ROWS))}


def warm_up(forward, synth: SyntheticBatches, vocab: int, gen: torch.Generator, seconds: float = 3.0) -> None:
    """Run forwards of several sizes for a few seconds before timing anything: the first
    passes after loading ran 2.3x slower (thread pool, allocator and page warm-up;
    measured), and the smallest shapes are timed first."""
    r = synth.new(torch.randint(vocab, (256,), generator=gen).tolist())
    steps = [forward([(r, n)]) for n in (1, 16, 256)]
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for step in steps:
            step()


def calibrate(engine: LLMEngine, prof: Profile, num_requests: int = 24) -> float:
    """Median of measured / predicted over the steps of a mixed workload on the real engine:
    prompts of 64..1024 tokens arriving together with outputs of 16..64, so steps span
    prefill-only, hybrid and decode-only batches."""
    import tempfile
    from pathlib import Path

    from carpool.core.cost_profile import ProfiledCostModel
    from carpool.core.step_cost import BatchShape

    with tempfile.TemporaryDirectory() as tmp:
        prof.write(Path(tmp) / "p.csv")
        model = ProfiledCostModel.load(Path(tmp) / "p.csv")
    rng = torch.Generator().manual_seed(1)
    vocab = engine.model_config.vocab_size
    shapes: list[BatchShape] = []

    longest = min(1024, engine.max_model_len - 64)
    for _ in range(num_requests):
        n = int(torch.randint(min(64, longest), longest + 1, (1,), generator=rng))
        out = int(torch.randint(16, 65, (1,), generator=rng))
        engine.add_request(torch.randint(vocab, (n,), generator=rng).tolist(),
                           SamplingParams(max_tokens=out, ignore_eos=True, temperature=0))
    start = len(engine.iteration_stats)
    stop_recording = engine.add_batch_observer(lambda batch: shapes.append(BatchShape.of(batch)))
    try:
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        stop_recording()
    steps = list(engine.iteration_stats)[start:]
    ratios = [s.duration / model.stage_time(sh, 0) for s, sh in zip(steps, shapes)]
    return statistics.median(ratios)


def step_overhead(engine: LLMEngine, steps: int = 40) -> float:
    """Median over real engine steps of (step time - model and LM head time)."""
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(24 + 8 * i)] for i in range(8)]
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=steps, ignore_eos=True, temperature=0))
    gaps = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        gaps.append(time.perf_counter() - t - engine.runner.last_forward_seconds)
    return statistics.median(gaps)


def run_profile(config, args) -> None:
    engine = LLMEngine(config)
    prof = profile_engine(engine, repeats=args.repeats, quick=args.quick)
    prof.write(args.output)
    print(f"wrote {len(prof.rows)} rows to {args.output}")
