"""`python -m carpool.bench.decode_sweep` times the three paths and leaves the engine as it was."""

from __future__ import annotations

import pytest

from carpool.bench.decode_sweep import sweep
from carpool.engine import LLMEngine
from carpool.model.cpu_kernels import has_quantized_matmul
from carpool.model.quant import QuantizedLinear


@pytest.mark.skipif(not has_quantized_matmul(), reason="needs AVX-512 VNNI (the C quantized matmuls)")
def test_sweep_times_every_path_and_restores_the_engine(model_path):
    engine = LLMEngine(model=model_path, dtype="bfloat16", kv_cache_memory=32 << 20)
    fused = engine.model.fused_layers
    chosen = [m.max_quantized_tokens for m in engine.model.modules() if isinstance(m, QuantizedLinear)]
    rows = sweep(engine, 20, batches=(1, 3), repeats=1)
    assert [r["decodes"] for r in rows] == [1, 3]
    assert all(r[k] > 0 for r in rows for k in ("eager_s", "eager_quantized_s", "fused_s"))
    assert engine.model.fused_layers is fused
    assert [m.max_quantized_tokens for m in engine.model.modules() if isinstance(m, QuantizedLinear)] == chosen
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
