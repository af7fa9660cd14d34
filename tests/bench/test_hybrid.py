"""The roofline of `carpool bench hybrid` counts the weights' bytes as they are stored."""

from __future__ import annotations

import pytest

from carpool.bench.hybrid import weight_bytes_read
from carpool.cli import main
from carpool.engine import LLMEngine


@pytest.mark.parametrize("flag", [["--decodes", "0,1"], ["--chunks", "0"]])
def test_a_zero_count_is_a_clear_error_before_any_work(flag, capsys):
    assert main(["bench", "hybrid", "--no-hf", *flag]) != 0
    assert "take counts of 1 or more" in capsys.readouterr().err


@pytest.mark.slow
def test_weight_bytes_follow_the_quantization(model_path, engine_fp32):
    cfg = engine_fp32.model_config
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    linear_params = cfg.num_layers * (h * (q + 2 * kv) + q * h + 3 * h * cfg.intermediate_size) + h * cfg.vocab_size
    # fp32: every linear (the tied LM head once, the embedding table not at all) plus small norms
    fp32 = weight_bytes_read(engine_fp32.model)
    assert 4 * linear_params <= fp32 < 4 * linear_params * 1.01
    # int4: half a byte per weight plus group scales, with the LM head in int8
    int4 = weight_bytes_read(LLMEngine(model=model_path, dtype="bfloat16", quantization="int4",
                                       kv_cache_memory=16 << 20).model)
    lm_head = h * cfg.vocab_size
    assert 0.5 * (linear_params - lm_head) + lm_head < int4 < 0.2 * fp32
