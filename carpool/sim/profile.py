"""`carpool profile`: measure the real model runner's parts on this machine, write a CSV.

Each part is timed in isolation on exact shapes built with SyntheticBatches:
linear layers (the model with attention stubbed out), prefill attention and decode attention
(the real kernel over real block tables, one layer, times the layer count), LM head plus
sampling, and the per-iteration work outside the model measured on real engine steps.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from unittest import mock

import torch

from carpool.bench.hybrid import median_time
from carpool.bench.synthetic import SyntheticBatches
from carpool.engine import LLMEngine
from carpool.model import attention as attention_module
from carpool.sampling_params import SamplingParams
from carpool.sim.cost_model import Profile

LINEAR_TOKENS = (1, 2, 4, 8, 16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
PREFILL_CHUNKS = (1, 16, 64, 128, 256, 512, 1024)
PREFILL_PREFIXES = (0, 256, 512, 1024, 2048)
DECODE_BATCH = (1, 2, 4, 8, 16, 32, 64)
DECODE_CONTEXT = (16, 128, 512, 1024, 2048)
SAMPLE_ROWS = (1, 4, 16, 64, 128)


@contextmanager
def attention_stubbed():
    """Attention returns its query: what is left of a forward pass is the linear part."""
    with mock.patch("carpool.model.llama.paged_attention", lambda q, k, v, cache, meta, scale: q):
        yield


def profile_engine(engine: LLMEngine, repeats: int = 5, quick: bool = False) -> Profile:
    prof = Profile()
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model_config.vocab_size
    layers = engine.model.num_local_layers
    runner, model = engine.runner, engine.model
    synth = SyntheticBatches(engine)
    pick = (lambda xs: xs[::2] + ((xs[-1],) if len(xs) % 2 == 0 else ())) if quick else (lambda xs: xs)

    def forward(batch_grants):
        ids, pos, meta, _ = runner.prepare(synth.batch(batch_grants))
        return lambda: model(ids, pos, runner.kv_cache, meta)

    with torch.inference_mode():
        with attention_stubbed():
            for n in pick(LINEAR_TOKENS):
                r = synth.new(torch.randint(vocab, (n,), generator=gen).tolist())
                prof.add("linear", n, 0, median_time(forward([(r, n)]), repeats))

        attn = model.layers[0].self_attn
        head_dim, heads, kv_heads = attn.head_dim, attn.num_heads, attn.num_kv_heads

        def attention_time(grants) -> float:
            ids, pos, meta, _ = runner.prepare(synth.batch(grants))
            q = torch.randn(len(ids), heads, head_dim, generator=gen).to(runner.kv_cache.dtype)
            k = torch.randn(len(ids), kv_heads, head_dim, generator=gen).to(runner.kv_cache.dtype)
            cache = runner.kv_cache[0]
            return layers * median_time(
                lambda: attention_module.paged_attention(q, k, k, cache, meta, attn.scale), repeats)

        for prefix in pick(PREFILL_PREFIXES):
            for n in pick(PREFILL_CHUNKS):
                r = synth.with_cached_context(prefix, gen) if prefix else synth.new([0] * n)
                if prefix:
                    r.token_ids.extend([0] * (n - 1))  # a prefill chunk, not a decode
                    r.num_prompt_tokens = len(r.token_ids)
                prof.add("prefill_attn", n, prefix, attention_time([(r, n)]))

        for ctx in pick(DECODE_CONTEXT):
            reqs = [synth.with_cached_context(ctx - 1, gen) for _ in range(max(DECODE_BATCH))]
            for d in pick(DECODE_BATCH):
                prof.add("decode_attn", d, ctx, attention_time([(r, 1) for r in reqs[:d]]))
            synth.close()

        hidden = torch.randn(max(SAMPLE_ROWS), model.config.hidden_size, generator=gen).to(runner.kv_cache.dtype)
        for rows in pick(SAMPLE_ROWS):
            prof.add("sample", rows, 0, median_time(lambda: model.compute_logits(hidden[:rows]).argmax(-1), repeats))
    synth.close()
    prof.add("overhead", 0, 0, step_overhead(engine))
    prof.add("calibration", 0, 0, calibrate(engine, prof))
    return prof


def calibrate(engine: LLMEngine, prof: Profile, num_requests: int = 24) -> float:
    """Median of measured / predicted over the steps of a mixed workload on the real engine:
    prompts of 64..1024 tokens arriving together with outputs of 16..64, so steps span
    prefill-only, hybrid and decode-only batches."""
    import tempfile
    from pathlib import Path

    from carpool.sim.cost_model import BatchShape, ProfiledCostModel

    with tempfile.TemporaryDirectory() as tmp:
        prof.write(Path(tmp) / "p.csv")
        model = ProfiledCostModel.load(Path(tmp) / "p.csv")
    rng = torch.Generator().manual_seed(1)
    vocab = engine.model_config.vocab_size
    shapes: list[BatchShape] = []
    real_execute = engine.runner.execute

    def recording(batch):
        shapes.append(BatchShape.of(batch))
        return real_execute(batch)

    for _ in range(num_requests):
        n = int(torch.randint(64, 1025, (1,), generator=rng))
        out = int(torch.randint(16, 65, (1,), generator=rng))
        engine.add_request(torch.randint(vocab, (n,), generator=rng).tolist(),
                           SamplingParams(max_tokens=out, ignore_eos=True, temperature=0))
    start = len(engine.iteration_stats)
    with mock.patch.object(engine.runner, "execute", recording):
        while engine.has_unfinished_requests():
            engine.step()
    steps = list(engine.iteration_stats)[start:]
    ratios = [s.duration / model.stage_time(sh, 0) for s, sh in zip(steps, shapes)]
    return statistics.median(ratios)


def step_overhead(engine: LLMEngine, steps: int = 40) -> float:
    """Median over real engine steps of (step time - model and LM head time)."""
    model = engine.model
    inside: list[float] = []
    real_forward, real_logits = model.forward, model.compute_logits

    def timed(fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            out = fn(*a, **k)
            inside[-1] += time.perf_counter() - t
            return out
        return wrapper

    prompts = [[(7 * i + j) % 1000 + 10 for j in range(24 + 8 * i)] for i in range(8)]
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=steps, ignore_eos=True, temperature=0))
    gaps = []
    with mock.patch.object(model, "forward", timed(real_forward)), \
            mock.patch.object(model, "compute_logits", timed(real_logits)):
        while engine.has_unfinished_requests():
            inside.append(0.0)
            t = time.perf_counter()
            engine.step()
            gaps.append(time.perf_counter() - t - inside[-1])
    return statistics.median(gaps)


def run_profile(config, args) -> None:
    engine = LLMEngine(config)
    prof = profile_engine(engine, repeats=args.repeats, quick=args.quick)
    prof.write(args.output)
    print(f"wrote {len(prof.rows)} rows to {args.output}")
