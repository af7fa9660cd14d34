"""The fused step (model/fused_layers.py): one C call for all layers of a decode-only step
equals the eager layers bit for bit (logits and KV cache); a step with prefill chunks equals its
tokens one at a time; and it runs only where it applies."""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from carpool.harness.synthetic import SyntheticBatches
from carpool.core.step_cost import SMALL_STEP_TOKENS
from carpool.engine import LLMEngine
from carpool.model.cpu_kernels import has_kq_matmul, has_kq_tiles, has_quantized_matmul
from carpool.model.fused_layers import FusedLayers
from carpool.model.paths import FUSED_MAX_TOKENS
from carpool.model.gguf_encode import requantize_gguf
from carpool.model.quant import TILE_FROM, QuantizedLinear
from tests.conftest import PROMPTS
from tests.helpers import examples, run_greedy
from tests.model.test_hf_models import write_checkpoint

pytestmark = pytest.mark.skipif(not has_quantized_matmul(), reason="needs AVX-512 VNNI or AVX2 (the C quantized matmuls)")
MAX_TOKENS = 8


def fuse(engine: LLMEngine) -> FusedLayers:
    """The fused path up to MAX_TOKENS decodes (below quant.TILE_FROM: the eager layers run the
    same integer kernels there, so the two compute alike)."""
    engine.runner.fused = FusedLayers.build(engine.model, MAX_TOKENS)
    assert engine.runner.fused is not None and engine.runner.fused.max_tokens == MAX_TOKENS
    return engine.runner.fused


@contextlib.contextmanager
def eager(engine: LLMEngine):
    """The runner without its fused path: every step runs the model's eager forward."""
    saved, engine.runner.fused = engine.runner.fused, None
    try:
        yield
    finally:
        engine.runner.fused = saved


@pytest.fixture(scope="module", params=["int4", "int8"])
def engine(request, model_path):
    engine = LLMEngine(model=model_path, dtype="bfloat16", quantization=request.param, kv_cache_memory=128 << 20)
    fuse(engine)
    return engine


@pytest.fixture(scope="module")
def qwen2_engine(tmp_path_factory, engine_fp32):
    """A tiny Qwen2 (biases on q, k, v) with 64-wide heads, int8."""
    folder = tmp_path_factory.mktemp("qwen2")
    write_checkpoint(folder, engine_fp32.tokenizer, "Qwen2", hidden_size=128, intermediate_size=256,
                     num_attention_heads=2, num_key_value_heads=1)
    engine = LLMEngine(model=str(folder), dtype="bfloat16", quantization="int8", kv_cache_memory=16 << 20)
    assert engine.model_config.attention_bias
    fuse(engine)
    return engine


@contextlib.contextmanager
def tile_kernel_from(model, tile_from: int = 0):
    """Every quantized layer on the tile kernel from `tile_from` tokens, whatever this CPU's layers
    chose (quant.tile_from()); 0: on its integer kernel at any token count."""
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    saved = [m.tile_from for m in layers]
    for m in layers:
        m.tile_from = tile_from
    try:
        yield
    finally:
        for m, t in zip(layers, saved):
            m.tile_from = t


def decode_step(engine: LLMEngine, contexts: list[int], seed: int, drafts: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of one decode step over random cached contexts (each decode scoring `drafts`
    speculative tokens after its own), and the sequences' KV after it (the new tokens' included)."""
    synthetic = SyntheticBatches(engine)
    try:
        g = torch.Generator().manual_seed(seed)
        requests = [synthetic.with_cached_context(n, g) for n in contexts]
        vocab = engine.model_config.vocab_size
        for r in requests:
            assert engine.block_manager.allocate(r, r.num_computed_tokens + 1 + drafts)
            r.spec_token_ids = torch.randint(vocab, (drafts,), generator=g).tolist()
        grants = [(r, 1) for r in requests]
        if drafts:
            batch = synthetic.batch(grants)
            for i, r in enumerate(batch.requests):
                batch.set_drafts(i, r.spec_token_ids)
            runner = engine.runner
            with torch.inference_mode():
                plan = runner.plan(batch)
                runner.clear_fresh_tails(plan)
                ids, pos, meta = runner.tensors(plan)
                logits = runner.model.compute_logits(runner.forward(ids, pos, meta))
        else:
            logits = synthetic.run(grants, all_logits=True, advance=False)
        runner = engine.runner
        slots = [torch.from_numpy(runner.slots_for(r.block_ids, 0, r.num_computed_tokens + 1 + drafts))
                 for r, _ in grants]
        return logits, runner.kv_cache[:, :, torch.cat(slots)]
    finally:
        synthetic.close()


class Counting:
    """The fused path, recording how many tokens each call had."""

    def __init__(self, fused: FusedLayers):
        self.fused, self.tokens, self.max_tokens = fused, [], fused.max_tokens

    def can_attend(self, meta, num_tokens: int) -> bool:
        return self.fused.can_attend(meta, num_tokens)

    def __call__(self, x, *args):
        self.tokens.append(x.shape[0])
        return self.fused(x, *args)


@settings(max_examples=examples(12), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(contexts=st.lists(st.integers(1, 300), min_size=1, max_size=MAX_TOKENS), seed=st.integers(0, 1 << 16))
def test_fused_equals_eager_exactly(engine, contexts, seed):
    got, got_cache = decode_step(engine, contexts, seed)
    with eager(engine):
        want, want_cache = decode_step(engine, contexts, seed)
    assert torch.equal(got, want)
    assert torch.equal(got_cache, want_cache)  # the new tokens' k, v written alike


@pytest.mark.parametrize("contexts, drafts", [([40] * 16, 0), ([3, 200, 17, 90, 64], 4), ([300] * 12, 2)])
def test_steps_past_the_tile_kernels_threshold_equal_eager_exactly(engine, contexts, drafts):
    """From quant.TILE_FROM tokens the fused layers multiply with the tile kernel, as the eager
    layers do; decodes with drafts attend as one run each, on both paths."""
    tokens = len(contexts) * (1 + drafts)
    assert tokens >= TILE_FROM
    saved = engine.runner.fused
    with tile_kernel_from(engine.model, TILE_FROM if has_kq_tiles() else 0):
        engine.runner.fused = counted = Counting(FusedLayers.build(engine.model, tokens))
        try:
            got, got_cache = decode_step(engine, contexts, 2, drafts)
        finally:
            engine.runner.fused = saved
        assert counted.tokens == [tokens]
        with eager(engine):
            want, want_cache = decode_step(engine, contexts, 2, drafts)
    assert torch.equal(got, want) and torch.equal(got_cache, want_cache)


@pytest.mark.skipif(not has_kq_matmul(), reason="needs AVX-512 VNNI or AVX2 (csrc/kquant.c)")
@pytest.mark.parametrize("mix", ["Q4_K_M", pytest.param("IQ4_XS", marks=pytest.mark.slow)])  # IQ4_XS: ~13 s
def test_a_k_quant_gguf_runs_fused_and_equals_eager(model_path, tmp_path, mix):
    """A GGUF's own K-quant (or IQ4, looked up) codes run in the fused path too (kquant.c's
    kernels, both sizes)."""
    path = str(tmp_path / f"{mix}.gguf")
    requantize_gguf(model_path, path, mix)
    engine = LLMEngine(model=path, dtype="bfloat16", kv_cache_memory=32 << 20)
    assert engine.model.layers[0].mlp.down_proj.kq is not None
    assert engine.runner.fused is not None
    for contexts in ([7], [30, 2, 111], [50] * 20):
        got, got_cache = decode_step(engine, contexts, 3)
        with eager(engine):
            want, want_cache = decode_step(engine, contexts, 3)
        assert torch.equal(got, want) and torch.equal(got_cache, want_cache)


def test_fused_equals_eager_with_biases(qwen2_engine):
    for contexts in ([5], [1, 17, 40, 3]):
        got, got_cache = decode_step(qwen2_engine, contexts, 1)
        with eager(qwen2_engine):
            want, want_cache = decode_step(qwen2_engine, contexts, 1)
        assert torch.equal(got, want) and torch.equal(got_cache, want_cache)


def chunk_request(synthetic: SyntheticBatches, cached: int, new: int, g: torch.Generator):
    """A prompt with `cached` tokens' (random) KV in the cache and `new` tokens still to prefill."""
    vocab = synthetic.engine.model_config.vocab_size
    if cached == 0:
        return synthetic.new(torch.randint(vocab, (new,), generator=g).tolist())
    r = synthetic.with_cached_context(cached, g)
    r.token_ids.extend(torch.randint(vocab, (new - 1,), generator=g).tolist())
    r.num_prompt_tokens = len(r.token_ids)  # no output yet: a prefill, not a decode
    return r


def hybrid_step(engine: LLMEngine, decodes: list[int], chunks: list[tuple[int, int]], seed: int,
                one_token_at_a_time: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of every row of a step with `decodes` (contexts) and prefill `chunks` ((cached,
    new) tokens), and the KV of all their tokens after it: as one step, or the decodes as one
    step and then each chunk a token per step."""
    synthetic = SyntheticBatches(engine)
    try:
        g = torch.Generator().manual_seed(seed)
        grants = [(synthetic.with_cached_context(n, g), 1) for n in decodes]
        grants += [(chunk_request(synthetic, c, n, g), n) for c, n in chunks]
        if one_token_at_a_time:
            logits = [synthetic.run(grants[:len(decodes)], all_logits=True)] if decodes else []
            logits += [synthetic.run([(r, 1)], all_logits=True) for r, n in grants[len(decodes):] for _ in range(n)]
            logits = torch.cat(logits)
        else:
            logits = synthetic.run(grants, all_logits=True)
        runner = engine.runner
        slots = [torch.from_numpy(runner.slots_for(r.block_ids, 0, r.num_computed_tokens)) for r, _ in grants]
        return logits, runner.kv_cache[:, :, torch.cat(slots)]
    finally:
        synthetic.close()


@settings(max_examples=examples(10), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(decodes=st.lists(st.integers(1, 100), max_size=3),
       chunks=st.lists(st.tuples(st.integers(0, 60), st.integers(1, 12)), min_size=1, max_size=2),
       seed=st.integers(0, 1 << 16))
def test_a_hybrid_step_equals_its_tokens_one_at_a_time(engine, decodes, chunks, seed):
    """Decodes and prefill chunks in one fused step give, bit for bit, the logits and KV of the
    decodes alone and then each chunk's tokens one per step: a chunk's queries share the passes
    over their context but each computes exactly what it would as a decode."""
    model, runner = engine.model, engine.runner
    saved = runner.fused
    try:
        with tile_kernel_from(model):  # every row from the integer kernels, however many rows
            counted = runner.fused = Counting(FusedLayers.build(model, FUSED_MAX_TOKENS))
            got, got_cache = hybrid_step(engine, decodes, chunks, seed, one_token_at_a_time=False)
            assert counted.tokens == [len(decodes) + sum(n for _, n in chunks)]  # one fused call for the step
            want, want_cache = hybrid_step(engine, decodes, chunks, seed, one_token_at_a_time=True)
    finally:
        runner.fused = saved
    assert torch.equal(got, want)
    assert torch.equal(got_cache, want_cache)


def test_a_stage_without_the_final_norm(engine):
    """A pipeline stage that is not the last returns the residual stream, not normed."""
    model, fused = engine.model, engine.runner.fused
    stage = FusedLayers(model, MAX_TOKENS)
    stage.final_norm = None
    synthetic = SyntheticBatches(engine)
    try:
        g = torch.Generator().manual_seed(0)
        grants = [(synthetic.with_cached_context(n, g), 1) for n in (9, 30)]
        runner = engine.runner
        with torch.inference_mode():
            ids, pos, meta = runner.tensors(runner.plan(synthetic.batch(grants)))
            x, cos, sin = model.layer_inputs(ids, pos)
            stream = stage(x.clone(), cos, sin, runner.kv_cache, meta)
            normed = fused(x, cos, sin, runner.kv_cache, meta)
        assert not torch.equal(stream, normed)
        assert torch.equal(model.norm(stream), normed)
    finally:
        synthetic.close()


def test_engine_greedy_runs_fused_and_matches_eager(engine):
    fused = engine.runner.fused
    engine.runner.fused = counted = Counting(fused)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS[:MAX_TOKENS]]
    try:
        got = run_greedy(engine, prompts, 12)
    finally:
        engine.runner.fused = fused
    assert counted.tokens and max(counted.tokens) == MAX_TOKENS
    assert engine.reset_prefix_cache()
    with eager(engine):
        want = run_greedy(engine, prompts, 12)
    assert got == want


def test_only_where_every_layer_runs_the_c_kernels(engine, engine_fp32, model_path):
    assert engine_fp32.runner.fused is None  # fp32: torch's kernels, the reference arithmetic
    dense = LLMEngine(model=model_path, dtype="bfloat16", quantization="none", kv_cache_memory=16 << 20)
    assert dense.runner.fused is None
    assert FusedLayers.build(engine.model).max_tokens == FUSED_MAX_TOKENS
    assert SMALL_STEP_TOKENS == FUSED_MAX_TOKENS + 1  # where the step-cost fit expects the jump
    down = engine.model.layers[-1].mlp.down_proj
    kernel, down.kernel = down.kernel, None  # one weight on torch's kernel
    try:
        assert FusedLayers.build(engine.model) is None
    finally:
        down.kernel = kernel
