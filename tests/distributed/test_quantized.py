"""Quantized linears under tensor parallelism: each rank quantizes its own shards (after
sharding) and the TP engine generates what the single-process quantized engine does."""

from __future__ import annotations

import pytest

from carpool.engine import LLMEngine
from carpool.model.quant import QuantizedLinear
from tests.distributed.test_equivalence import MAX_TOKENS, PROMPTS, TINY
from tests.helpers import run_greedy


def force_quantized_kernels(engine) -> int:
    """The tiny model's shapes are faster dense, so the measured choice never runs the quantized
    kernels: force them on the models in this process (the driver's rank in a TP engine; the other
    rank keeps dense copies of the same dequantized weights)."""
    layers = [m for m in engine.executor.model.modules() if isinstance(m, QuantizedLinear)]
    for layer in layers:
        layer.max_quantized_tokens = 1 << 30
    return len(layers)


@pytest.mark.parametrize("mode", [pytest.param("int8", marks=pytest.mark.slow), "int4"])
def test_tp2_quantized_generates_like_single_process(parallel_engine, tiny_llama, mode):
    single = LLMEngine(model=tiny_llama, quantization=mode, **TINY)
    assert force_quantized_kernels(single) == 3 * 4 + 1
    expected = run_greedy(single, PROMPTS, MAX_TOKENS)
    engine = parallel_engine(model=tiny_llama, tensor_parallel_size=2, quantization=mode, **TINY)
    assert force_quantized_kernels(engine) == 3 * 4 + 1  # rank 0's shards, LM head included
    assert run_greedy(engine, PROMPTS, MAX_TOKENS) == expected
