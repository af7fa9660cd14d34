"""The compiled layers (model/compiled.py) equal the eager ones on chunked, hybrid and decode
batches, serve greedy requests identically, and the runner falls back to eager when compiling
fails. The model is never touched: the runner holds the compiled layers and picks them per step.

bf16 comparisons are bounded, not counted (`bf16_bound`): the logits must lie within a bound
stated a priori, and every row whose top-2 margin puts its argmax beyond that bound must agree.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from carpool.harness.synthetic import SyntheticBatches
from carpool.engine import LLMEngine
from carpool.model import compiled as compiled_module
from carpool.model.loader import load_model
from carpool.model.paths import COMPILE_MIN_TOKENS, FUSED_MAX_TOKENS, Path
from carpool.model_runner import ModelRunner
from carpool.sampling_params import SamplingParams
from tests.conftest import PROMPTS
from tests.model.test_hf_folder import write_checkpoint

BF16_UNIT_ROUNDOFF = 2.0 ** -8  # 8 significant bits: round to nearest is within 2^-8 relative

LONG_PROMPT = ("In the middle of the night, the old lighthouse keeper climbed the stairs once more, "
               "counting every step as he had done for forty years. ") * 3


@pytest.fixture(scope="module", params=["float32", pytest.param("bfloat16", marks=pytest.mark.slow)])
def engine(request, model_path):
    """fp32 without quantization; bf16 with the default int4 weights."""
    engine = LLMEngine(model=model_path, dtype=request.param, kv_cache_memory=256 << 20, enforce_eager=False)
    assert engine.runner.compiled is not None
    return engine


@contextlib.contextmanager
def eager(runner: ModelRunner):
    """The runner without its compiled layers: steps that took them run the eager forward."""
    saved, runner.compiled = runner.compiled, None
    assert saved is not None, "the runner has no compiled layers"
    try:
        yield
    finally:
        runner.compiled = saved


def assert_untouched(model) -> None:
    """No path bound onto the model: its layers' methods are the class's own."""
    for layer in model.layers:
        assert not {"forward", "before_attention", "after_attention"} & set(vars(layer))
    assert not {"fused_layers", "compiled", "forward"} & set(vars(model))


def bf16_bound(logits: torch.Tensor, num_layers: int) -> torch.Tensor:
    """Per row, how far apart two bf16 evaluations of the same layers may put a logit.

    The paths differ only in where they round: a fused loop keeps fp32 between ops where eager
    rounds each intermediate to bf16 (relative error u = 2^-8 per rounding). Each layer adds
    an update to the residual stream, rounded differently by the two paths: up to u of the
    stream's size per layer, so up to L * u of it after L layers when no difference cancels
    another (to first order: amplification by later layers is left out, and the tests check
    that the bound holds). The final norm and LM head are the same calls on both paths, so the
    logits (linear in the normed stream) differ by up to L * u times the row's logit scale:

        bound = L * 2^-8 * max_j |z_j|      (30 layers: 0.117 * max |z|)

    A row whose eager top-2 margin exceeds 2 * bound has the same argmax on both paths when
    every logit is within the bound (the top logit drops by at most `bound`, the runner-up
    rises by at most `bound`); closer rows are near ties that either rounding may flip, so
    their argmax is not compared."""
    return num_layers * BF16_UNIT_ROUNDOFF * logits.abs().amax(-1)


def top2_margin(logits: torch.Tensor) -> torch.Tensor:
    top = logits.topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


def batch_logits(engine, build) -> torch.Tensor:
    """All rows' logits of the batch `build(synthetic)` returns (requests keep their state)."""
    synthetic = SyntheticBatches(engine)
    try:
        grants = build(synthetic)
        assert sum(n for _, n in grants) >= COMPILE_MIN_TOKENS  # the compiled layers run
        return synthetic.run(grants, all_logits=True, advance=False)
    finally:
        synthetic.close()


def text(synthetic, n: int, offset: int) -> list[int]:
    """n tokens of English (random token ids would make every logit a near tie)."""
    ids = synthetic.engine.tokenizer.encode(LONG_PROMPT * 4)
    return ids[offset:offset + n]


def prompt(synthetic, n: int, offset: int):
    return synthetic.new(text(synthetic, n, offset))


def decodes(synthetic, count: int, context: int):
    """`count` requests with `context` tokens prefilled (in one step) and one to decode."""
    requests = [synthetic.new(text(synthetic, context + 1, i)) for i in range(count)]
    synthetic.run([(r, context) for r in requests])
    return [(r, 1) for r in requests]


def chunk_after_prefix(synthetic):
    """The second 40-token chunk of a prompt: it attends to the first chunk's cached KV."""
    r = prompt(synthetic, 80, 2)
    synthetic.run([(r, 40)])
    return [(r, 40)]


BATCHES = {
    "prefill": lambda s: [(prompt(s, 48, 5), 48)],
    "chunk_with_prefix": chunk_after_prefix,
    "hybrid": lambda s: decodes(s, 4, 100) + [(prompt(s, 60, 7), 60)],
    "decode": lambda s: decodes(s, COMPILE_MIN_TOKENS + 8, 70),
}


@pytest.mark.parametrize("kind", list(BATCHES))
def test_compiled_equals_eager(engine, kind):
    """fp32: equal up to reordered sums. bf16: every logit within `bf16_bound` of eager's, and
    every row whose top-2 margin exceeds twice the bound has the same argmax."""
    got = batch_logits(engine, BATCHES[kind])
    with eager(engine.runner):
        want = batch_logits(engine, BATCHES[kind])
    if engine.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-2)  # 30 layers of reordered sums
        return
    bound = bf16_bound(want, engine.model.num_local_layers)
    error = (got - want).abs().amax(-1)
    assert (error <= bound).all(), f"max |compiled - eager| {error.max():.3f} > bound {bound.min():.3f}"
    clear = top2_margin(want) > 2 * bound
    assert clear.any()  # English text: some predictions are not near ties
    assert torch.equal(got.argmax(-1)[clear], want.argmax(-1)[clear])


def greedy(engine, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[torch.Tensor]]]:
    """Greedy tokens of each prompt, each with the logits it was sampled from (recorded as the
    runner returns them: one row per request whose prompt is complete, in batch order)."""
    runner, logits_of = engine.runner, {}
    execute = runner.execute

    def recording(batch):
        ready = [r for r, n in zip(batch.requests, batch.num_tokens) if r.num_computed_tokens + n == r.num_tokens]
        logits = execute(batch)
        for r, row in zip(ready, logits, strict=True):
            logits_of.setdefault(id(r), []).append(row.clone())
        return logits

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    runner.execute = recording
    try:
        requests = [engine.add_request(p, sp) for p in prompts]
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        del runner.execute  # the class's method again
    return [(r.output_token_ids, logits_of[id(r)]) for r in requests]


def test_compiled_greedy_equals_eager(engine):
    """fp32: the same tokens. bf16: while a sequence's tokens coincide on both paths, each
    step's logits lie within `bf16_bound` of eager's; the sequences part only at a near tie
    (an eager top-2 margin within twice the bound), after which they legitimately differ."""
    prompts = [engine.tokenizer.encode(p) for p in [LONG_PROMPT, *PROMPTS[:3]]]
    assert sum(map(len, prompts)) >= COMPILE_MIN_TOKENS  # the first step, all prompts, runs compiled
    got = greedy(engine, prompts, 8)
    engine.reset_prefix_cache()  # the same steps again, not the few uncached tokens as small chunks
    with eager(engine.runner):
        want = greedy(engine, prompts, 8)
    if engine.dtype == torch.float32:
        assert [tokens for tokens, _ in got] == [tokens for tokens, _ in want]
        return
    for (got_tokens, got_logits), (want_tokens, want_logits) in zip(got, want):
        for g, w, zg, zw in zip(got_tokens, want_tokens, got_logits, want_logits, strict=True):
            bound = bf16_bound(zw, engine.model.num_local_layers)
            assert (zg - zw).abs().max() <= bound
            if top2_margin(zw) > 2 * bound:
                assert g == w
            if g != w:
                break


def test_the_runner_picks_the_path_per_step(engine):
    """Decode-only steps: fused up to FUSED_MAX_TOKENS where the model has the fused layers,
    else compiled from COMPILE_MIN_TOKENS and eager below; without compiled layers, eager."""
    runner = engine.runner
    synthetic = SyntheticBatches(engine)
    try:
        g = torch.Generator().manual_seed(0)
        requests = [synthetic.with_cached_context(20, g) for _ in range(FUSED_MAX_TOKENS + 1)]
        with torch.inference_mode():
            def path(n):
                plan = runner.plan(synthetic.batch([(r, 1) for r in requests[:n]]))
                return runner.path(n, runner.tensors(plan)[2])
            first_compiled = COMPILE_MIN_TOKENS
            if runner.fused is not None:
                assert path(COMPILE_MIN_TOKENS) is path(FUSED_MAX_TOKENS) is Path.FUSED
                first_compiled = FUSED_MAX_TOKENS + 1
            else:
                assert path(COMPILE_MIN_TOKENS - 1) is Path.EAGER
            assert path(first_compiled) is Path.COMPILED
            with eager(runner):
                assert path(first_compiled) is Path.EAGER
    finally:
        synthetic.close()
    assert_untouched(engine.model)


def test_enforce_eager_compiles_nothing(tmp_path, engine_fp32):
    write_checkpoint(tmp_path, "llama", engine_fp32.tokenizer)  # the flag's path, on a tiny model
    engine = LLMEngine(model=str(tmp_path), dtype="float32", kv_cache_memory=16 << 20, enforce_eager=True)
    assert engine.runner.compiled is None
    assert_untouched(engine.model)


def tiny_runner(folder) -> ModelRunner:
    model = load_model(str(folder), torch.float32, torch.device("cpu"))
    return ModelRunner(model, 8, 16, torch.device("cpu"), torch.float32, enforce_eager=False)


def test_each_model_compiles_its_own_graphs(tmp_path, engine_fp32):
    """Guards skip module attributes, so a model without biases must not lend its graphs to one
    with them: each model's compiled forward equals its eager forward."""
    for kind in ("llama", "qwen2"):
        write_checkpoint(tmp_path / kind, kind, engine_fp32.tokenizer)
        runner = tiny_runner(tmp_path / kind)
        assert runner.compiled is not None
        assert_untouched(runner.model)
        x = torch.randn(COMPILE_MIN_TOKENS, runner.model.config.hidden_size)
        cos, sin = runner.model.rotary.cos_sin(torch.arange(COMPILE_MIN_TOKENS), x.dtype)
        layer = runner.model.layers[0]
        got = runner.compiled.before_attention(layer, x, cos, sin)
        want = layer.before_attention(x, cos, sin)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_failed_compile_falls_back_to_eager(tmp_path, engine_fp32, monkeypatch, caplog):
    write_checkpoint(tmp_path, "llama", engine_fp32.tokenizer)

    def broken_compile(fn, **kwargs):
        def run(*args):
            raise RuntimeError("no C++ compiler")
        return run

    monkeypatch.setattr(compiled_module.torch, "compile", broken_compile)
    with caplog.at_level(logging.WARNING, logger="carpool"):
        runner = tiny_runner(tmp_path)
    assert runner.compiled is None
    assert "running eager" in caplog.text and "no C++ compiler" in caplog.text
    assert_untouched(runner.model)
    pad = runner.kv_cache[:, :, runner.pad_block * runner.block_size:]
    assert not pad.any()  # the warm-up's writes to the pad block are undone


def test_warm_up_reaches_both_sides_of_an_int4_layers_kernel_switch():
    """An int4 / int8 layer branches on the token count at its tile_from: a switch above the
    smallest compiled step is a second graph, warmed up too; a GGUF's codes switch inside their op."""
    from carpool.model.quant import QuantizedLinear

    layer = QuantizedLinear(torch.nn.Linear(64, 32), "int4", torch.bfloat16)
    model = torch.nn.Sequential(layer)
    for tile_from, sizes in ((0, [COMPILE_MIN_TOKENS]), (16, [COMPILE_MIN_TOKENS]),
                             (COMPILE_MIN_TOKENS, [COMPILE_MIN_TOKENS]), (64, [COMPILE_MIN_TOKENS, 64])):
        layer.tile_from = tile_from
        assert compiled_module.warm_up_sizes(model) == sizes
    layer.kq = object()  # as from_codes makes it: the kernel picks inside the C op
    assert compiled_module.warm_up_sizes(model) == [COMPILE_MIN_TOKENS]
