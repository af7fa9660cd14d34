"""Engine flags are generated from EngineConfig: every field has one, with the field's default and
the help its metadata holds."""

from __future__ import annotations

import argparse
import ast
import re
from dataclasses import fields
from pathlib import Path

import pytest

from carpool import config
from carpool.args import NOT_FLAGS, add_engine_args, engine_config_from_args
from carpool.config import SCHEDULER_NAMES, EngineConfig, SpeculativeConfig


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


def test_help_and_short_names_come_from_the_field_metadata():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    actions = {a.dest: a for a in p._actions}
    quantization = next(f for f in fields(EngineConfig) if f.name == "quantization")
    assert actions["quantization"].help == quantization.metadata["help"]
    assert actions["quantization"].option_strings == ["--quantization", "-q"]
    assert actions["quantization"].choices == quantization.metadata["choices"]
    flags = [f for f in fields(EngineConfig) if f.metadata.get("flag", True)]
    assert all(actions[f.name].help == f.metadata["help"] for f in flags)  # every flag has its help
    assert NOT_FLAGS == {"distributed_init_method", "distributed_timeout"}
    assert not NOT_FLAGS & set(actions)


def test_config_names_the_schedulers_without_importing_them():
    """config.py is a leaf: it checks scheduler names against its own list, which must be the
    scheduler registry's, in the registry's order (the error message lists them)."""
    from carpool.core.scheduler import SCHEDULERS

    assert tuple(SCHEDULERS) == SCHEDULER_NAMES
    imported = set()
    for node in ast.walk(ast.parse(Path(config.__file__).read_text())):
        if isinstance(node, ast.ImportFrom):
            imported.add(node.module)
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    # The one carpool import: resolve_dtype asks whether carpool's C kernels exist on this host.
    assert {m for m in imported if m.startswith("carpool")} == {"carpool.model"}
    with pytest.raises(ValueError, match="unknown scheduler"):
        EngineConfig(model="m.gguf", scheduler="nope")


def test_speculative_config_is_vllms_json():
    config = engine_config_from_args(parse(
        "--model", "m.gguf", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5, '
        '"prompt_lookup_max": 4}'))
    assert config.speculative_config == SpeculativeConfig(method="ngram", num_speculative_tokens=5,
                                                          prompt_lookup_max=4)
    assert engine_config_from_args(parse("--model", "m.gguf")).speculative_config is None
    draft = engine_config_from_args(parse("--model", "m.gguf", "--speculative-config", '{"model": "d.gguf"}'))
    assert (draft.speculative_config.method, draft.speculative_config.model) == ("draft_model", "d.gguf")


@pytest.mark.parametrize("value, said", [
    ("{method: ngram}", "not valid JSON"),
    ('{"method": "eagle"}', "unknown method 'eagle'"),
    ('{"method": "ngram", "num_speculative_token": 5}', "unknown keys ['num_speculative_token']"),
    ('{"num_speculative_tokens": 0}', "num_speculative_tokens must be an integer in [1, 32]"),
    ("[5]", "must be a JSON object"),
])
def test_a_bad_speculative_config_is_an_argparse_error_that_says_why(value, said, capsys):
    with pytest.raises(SystemExit):
        parse("--speculative-config", value)
    err = capsys.readouterr().err
    assert "argument --speculative-config: speculative_config" in err and said in err
    with pytest.raises(ValueError, match=re.escape(said)):
        EngineConfig(model="m.gguf", speculative_config=value)
