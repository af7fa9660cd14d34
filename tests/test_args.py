"""Engine flags are generated from EngineConfig: every field has one, with the field's default."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from carpool.args import NOT_FLAGS, add_engine_args, engine_config_from_args
from carpool.config import EngineConfig


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p.parse_args(list(argv))


def test_defaults_are_the_dataclass_defaults():
    args = parse("--model", "m.gguf")
    assert engine_config_from_args(args) == EngineConfig(model="m.gguf")
    flagged = {f.name for f in fields(EngineConfig)} - NOT_FLAGS
    assert flagged <= set(vars(args))


def test_flags_convert_their_values():
    config = engine_config_from_args(parse(
        "--model", "m.gguf", "--kv-cache-memory", "2GiB", "-tp", "2", "--no-enable-prefix-caching", "-q", "int8",
        "--target-tbt-ms", "80", "--max-model-len", "1024", "--dtype", "float32", "--generation-config", "vllm"))
    assert config.kv_cache_memory == 2 << 30 and config.tensor_parallel_size == 2
    assert config.enable_prefix_caching is False and config.quantization == "int8"
    assert config.target_tbt_ms == 80.0 and config.max_model_len == 1024 and config.dtype == "float32"
    assert config.generation_config == "vllm"


def test_bad_values_are_argparse_errors():
    with pytest.raises(SystemExit):
        parse("--max-num-seqs", "many")
    with pytest.raises(SystemExit):
        parse("--quantization", "int3")
