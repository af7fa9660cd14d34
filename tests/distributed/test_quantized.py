"""Quantized linears under tensor parallelism: each rank quantizes its own shards (after
sharding) and the TP engine generates what the single-process quantized engine does."""

from __future__ import annotations

import pytest

from carpool.engine import LLMEngine
from carpool.model.quant import QuantizedLinear
from tests.distributed.test_equivalence import MAX_TOKENS, PROMPTS, TINY
from tests.helpers import run_greedy


def quantized_layers(engine) -> int:
    """The quantized linears of the model in this process (the driver's rank in a TP engine)."""
    return sum(isinstance(m, QuantizedLinear) for m in engine.executor.model.modules())


@pytest.mark.parametrize("mode", [pytest.param("int8", marks=pytest.mark.slow), "int4"])
def test_tp2_quantized_generates_like_single_process(parallel_engine, tiny_llama, mode):
    single = LLMEngine(model=tiny_llama, quantization=mode, **TINY)
    assert quantized_layers(single) == 3 * 4 + 1
    expected = run_greedy(single, PROMPTS, MAX_TOKENS)
    engine = parallel_engine(model=tiny_llama, tensor_parallel_size=2, quantization=mode, **TINY)
    assert quantized_layers(engine) == 3 * 4 + 1  # rank 0's shards, LM head included
    assert run_greedy(engine, PROMPTS, MAX_TOKENS) == expected
