"""GPU cost estimates from the shipped A100/H100 operator profiles."""

from __future__ import annotations

import pytest

from carpool.core.step_cost import BatchShape
from carpool.data import PROFILES_DIR
from carpool.sim.gpu import GPUS, GpuCostModel, resolve_shape

PROFILES = PROFILES_DIR  # carpool/data/profiles; tests pass it explicitly, as --profiles-dir does


def test_gpu_model_uses_measured_operators():
    model = GpuCostModel(resolve_shape("llama-2-7b"), GPUS["a100"], profiles=PROFILES)
    small = model.stage_time(BatchShape(decode_contexts=(1024,) * 8, num_sampled=8), 0)
    big = model.stage_time(BatchShape(prefills=((2048, 0),), num_sampled=1), 0)
    assert 0.005 < small < 0.05  # a 7B decode step on an A100: ~10-20 ms
    assert big > 5 * small
    assert any("attention modelled" in n for n in model.notes)


def test_gpu_tp_and_pp_add_collectives():
    shape = resolve_shape("llama-2-70b")
    batch = BatchShape(prefills=((512, 0),), decode_contexts=(2048,) * 16, num_sampled=17)
    tp4 = GpuCostModel(shape, GPUS["a100"], tp=4, profiles=PROFILES)
    pp2 = GpuCostModel(shape, GPUS["a100"], tp=4, num_stages=2, gpus_per_node=4, profiles=PROFILES)
    assert pp2.stage_time(batch, 0) < tp4.stage_time(batch, 0)  # half the layers per stage
    assert pp2.stage_time(batch, 0) + pp2.stage_time(batch, 1) > tp4.stage_time(batch, 0)  # + send/recv


def test_unprofiled_models_are_scaled_and_say_so():
    model = GpuCostModel(resolve_shape("yi-34b"), GPUS["a100"], tp=2, profiles=PROFILES)
    assert any("scaled by FLOPs" in n for n in model.notes)


def test_unknown_shapes_and_bad_parallelism():
    with pytest.raises(ValueError, match="unknown model shape"):
        resolve_shape("gpt-5")
    with pytest.raises(ValueError, match="layers"):
        GpuCostModel(resolve_shape("llama-2-7b"), GPUS["a100"], num_stages=3, profiles=PROFILES)
    with pytest.raises(ValueError, match="tensor parallel size 16"):
        GpuCostModel(resolve_shape("llama-2-7b"), GPUS["a100"], tp=16, profiles=PROFILES)


def test_shape_from_hf_config(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2,
        "intermediate_size": 512, "vocab_size": 1000}))
    shape = resolve_shape(str(tmp_path))
    assert (shape.num_layers, shape.kv_heads, shape.head_dim) == (4, 2, 32)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 256}))
    with pytest.raises(ValueError, match="lacks"):
        resolve_shape(str(tmp_path))
