"""The roofline of `carpool bench hybrid` counts the weights' bytes as they are stored."""

from __future__ import annotations

import pytest

from carpool.bench.hybrid import weight_bytes_read
from carpool.engine import LLMEngine


@pytest.fixture(scope="module")
def weight_bytes(model_path) -> dict[str, int]:
    return {q: weight_bytes_read(LLMEngine(model=model_path, dtype="bfloat16", quantization=q,
                                           kv_cache_memory=16 << 20).model)
            for q in ("none", "int8", "int4")}


def test_weight_bytes_follow_the_quantization(weight_bytes, engine_fp32):
    cfg = engine_fp32.model_config
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    linear_params = cfg.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size) + h * cfg.vocab_size
    # bf16: every linear (the tied LM head once, the embedding table not at all) plus small norms
    assert 2 * linear_params <= weight_bytes["none"] < 2 * linear_params * 1.01
    # int8: a byte per weight plus per-row scales; int4: half a byte plus group scales, LM head int8
    assert linear_params <= weight_bytes["int8"] < 0.52 * weight_bytes["none"]
    assert weight_bytes["int4"] < 0.75 * weight_bytes["int8"]
