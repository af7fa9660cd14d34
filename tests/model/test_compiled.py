"""The compiled forward (model/compiled.py) equals the eager one on chunked, hybrid and decode
batches, serves greedy requests identically, and falls back to eager when compiling fails."""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

from carpool.harness.synthetic import SyntheticBatches
from carpool.engine import LLMEngine
from carpool.model import compiled as compiled_module
from carpool.model.compiled import COMPILE_MIN_TOKENS, CompiledAbove
from carpool.model.loader import load_model
from carpool.model.quant import QuantizedLinear
from carpool.model_runner import ModelRunner
from tests.conftest import PROMPTS
from tests.helpers import run_greedy
from tests.model.test_hf_folder import write_checkpoint

LONG_PROMPT = ("In the middle of the night, the old lighthouse keeper climbed the stairs once more, "
               "counting every step as he had done for forty years. ") * 3


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def engine(request, model_path):
    """fp32 without quantization; bf16 with the default int4 weights."""
    engine = LLMEngine(model=model_path, dtype=request.param, kv_cache_memory=256 << 20, enforce_eager=False)
    if not engine.runner.compiled:  # AVX2 alone: the int4 kernels win at every size, so it stays eager
        for m in engine.model.modules():  # here the compiled steps run the dense copies, as on other CPUs
            if isinstance(m, QuantizedLinear):
                m.max_quantized_tokens = COMPILE_MIN_TOKENS - 1
        assert engine.runner.compile_forward()
        engine.runner.compiled = True
    return engine


@contextlib.contextmanager
def eager(model):
    """Every compiled layer method takes its eager branch for the duration."""
    methods = [m for layer in model.layers for m in vars(layer).values() if isinstance(m, CompiledAbove)]
    assert methods, "the model is not compiled"
    saved = [m.min_tokens for m in methods]
    for m in methods:
        m.min_tokens = 1 << 62
    try:
        yield
    finally:
        for m, n in zip(methods, saved):
            m.min_tokens = n


def batch_logits(engine, build) -> torch.Tensor:
    """All rows' logits of the batch `build(synthetic)` returns (requests keep their state)."""
    synthetic = SyntheticBatches(engine)
    try:
        grants = build(synthetic)
        assert sum(n for _, n in grants) >= COMPILE_MIN_TOKENS  # the compiled branch runs
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
    assert engine.runner.compiled
    got = batch_logits(engine, BATCHES[kind])
    with eager(engine.model):
        want = batch_logits(engine, BATCHES[kind])
    if engine.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-2)  # 30 layers of reordered sums
    else:  # bf16: fused loops keep fp32 where eager rounds to bf16 (measured: <= 1.0 apart)
        torch.testing.assert_close(got, want, rtol=0.05, atol=1.0)
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.95


def test_compiled_greedy_equals_eager(engine):
    prompts = [engine.tokenizer.encode(p) for p in [LONG_PROMPT, *PROMPTS[:3]]]
    assert len(prompts[0]) >= COMPILE_MIN_TOKENS
    got = run_greedy(engine, prompts, 8)
    engine.reset_prefix_cache()  # the same steps again, not the few uncached tokens as small chunks
    with eager(engine.model):
        want = run_greedy(engine, prompts, 8)
    if engine.dtype == torch.float32:
        assert got == want
    else:
        assert sum(g == w for g, w in zip(got, want)) >= len(prompts) - 1


def test_enforce_eager_compiles_nothing(model_path):
    engine = LLMEngine(model=model_path, dtype="float32", kv_cache_memory=16 << 20, enforce_eager=True)
    assert not engine.runner.compiled
    assert not any(isinstance(m, CompiledAbove) for layer in engine.model.layers for m in vars(layer).values())


def tiny_runner(folder) -> ModelRunner:
    model = load_model(str(folder), torch.float32, torch.device("cpu"))
    return ModelRunner(model, 8, 16, torch.device("cpu"), torch.float32, enforce_eager=False)


def test_each_model_compiles_its_own_graphs(tmp_path, engine_fp32):
    """Guards skip module attributes, so a model without biases must not lend its graphs to one
    with them: each model's compiled forward equals its eager forward."""
    for kind in ("llama", "qwen2"):
        write_checkpoint(tmp_path / kind, kind, engine_fp32.tokenizer)
        runner = tiny_runner(tmp_path / kind)
        assert runner.compiled
        x = torch.randn(COMPILE_MIN_TOKENS, runner.model.config.hidden_size)
        cos, sin = runner.model.rotary.cos_sin(torch.arange(COMPILE_MIN_TOKENS), x.dtype)
        layer = runner.model.layers[0]
        got = layer.before_attention(x, cos, sin)
        with eager(runner.model):
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
    assert not runner.compiled
    assert "running eager" in caplog.text and "no C++ compiler" in caplog.text
    assert not any(isinstance(m, CompiledAbove) for layer in runner.model.layers for m in vars(layer).values())
    pad = runner.kv_cache[:, :, runner.pad_block * runner.block_size:]
    assert not pad.any()  # the warm-up's writes to the pad block are undone
