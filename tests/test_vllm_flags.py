"""Every `vllm serve` flag (tests/data/vllm_serve_flags.txt) parses through `carpool serve`'s
parser, and is honoured, mapped, or named in exactly one warning line: a vLLM command line never
stops at an argparse error."""

from __future__ import annotations

import logging
import shlex
from pathlib import Path

import pytest

from carpool import args as vllm_args
from carpool.cli import build_parser, cmd_serve, engine_config, parse_args
from carpool.config import SpeculativeConfig
from carpool.server.options import ServerOptions

FLAGS_FILE = Path(__file__).parent / "data" / "vllm_serve_flags.txt"
LINES = [line for line in FLAGS_FILE.read_text().splitlines() if line.strip() and not line.startswith("#")]
# Ignored flags whose value is what carpool does anyway (args.DEFAULT_ONLY): nothing to say.
SILENT = {"--enable-chunked-prefill"}


def serve_parser():
    return next(a for a in build_parser()._actions if a.dest == "command").choices["serve"]


def argv_of(line: str, tmp_path: Path) -> list[str]:
    flag, _, value = line.partition(" ")
    if flag == "--config":
        (tmp_path / "config.yaml").write_text("max_num_seqs: 8\n")
        return [flag, str(tmp_path / "config.yaml")]
    if flag == "--model":
        return [flag, "m.gguf"]
    if flag == "--enable-auto-tool-choice":
        return [flag, "--tool-call-parser", "hermes"]  # as vLLM, it needs one
    if flag in ("--chat-template", "--allowed-origins", "--allowed-methods", "--allowed-headers") or "{" in value:
        return [flag, value]  # one value, spaces and all
    return [flag, *shlex.split(value)]


def warnings_for(argv: list[str], caplog) -> tuple[list[str], object]:
    vllm_args._warned.clear()
    caplog.clear()
    args = parse_args(["serve", "m.gguf", *argv])
    args.model = args.model_tag if args.model is None else args.model
    config = vllm_args.apply_vllm_engine_flags(args, engine_config(args))
    ServerOptions.from_args(args)  # the server's options take the parsed values
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING], config


def test_the_list_is_thorough():
    flags = {line.split()[0] for line in LINES}
    assert len(flags) >= 250
    for flag in ("--gpu-memory-utilization", "--max-num-seqs", "--enable-auto-tool-choice", "--api-server-count",
                 "--speculative-config", "--no-enable-prefix-caching", "-tp", "-O"):
        assert flag in flags


@pytest.mark.parametrize("line", LINES)
def test_every_vllm_serve_flag_is_accepted(line, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="carpool")
    argv = argv_of(line, tmp_path)
    try:
        warnings, _ = warnings_for(argv, caplog)
    except SystemExit:
        pytest.fail(f"`carpool serve {shlex.join(argv)}` is an argparse error")
    options = {o: a for a in serve_parser()._actions for o in a.option_strings}
    flag = argv[0]
    action = options.get(flag) or options[flag[:2]]  # -O3: -O with its value attached
    ignored = action.dest in vllm_args.IGNORED
    expected = 1 if (ignored and not flag.startswith("--no-") and flag not in SILENT
                     or flag == "--no-enable-chunked-prefill") else 0
    assert len(warnings) == expected, (line, warnings)
    if expected:
        name = flag if flag.startswith("--no-") else vllm_args.flag_name(action.dest)
        assert warnings[0].startswith(f"ignoring {name}"), warnings[0]
        assert "\n" not in warnings[0]


def test_vllm_values_are_mapped(caplog, tmp_path):
    _, config = warnings_for(["--dtype", "half", "--max-model-len", "1k", "--kv-cache-memory-bytes",
                              "64M", "--max-num-batched-tokens", "2K"], caplog)
    assert (config.dtype, config.max_model_len) == ("float16", 1000)
    assert config.kv_cache_memory == 64 << 20 and config.max_num_batched_tokens == 2048
    with pytest.raises(SystemExit):
        parse_args(["serve", "--max-model-len", "lots"])


def test_default_values_of_ignored_flags_say_nothing(caplog):
    caplog.set_level(logging.WARNING, logger="carpool")
    for flag, value in [("--kv-cache-dtype", "auto"), ("--tokenizer-mode", "auto"), ("--load-format", "gguf"),
                        ("-dp", "1"), ("--api-server-count", "1"), ("--no-trust-remote-code", None),
                        ("--tokenizer", "m.gguf")]:
        warnings, _ = warnings_for([flag] + ([value] if value else []), caplog)
        assert warnings == [], (flag, warnings)


def test_underscores_and_config_files(tmp_path):
    (tmp_path / "c.yaml").write_text("max_num_seqs: 8\nenable_prefix_caching: false\n"
                                     "served_model_name: [a, b]\nport: 9000\n")
    args = parse_args(["serve", "m.gguf", "--config", str(tmp_path / "c.yaml"), "--max_num_batched_tokens=64",
                       "--port", "9001"])
    assert (args.model_tag, args.max_num_seqs, args.enable_prefix_caching) == ("m.gguf", 8, False)
    assert args.served_model_name == ["a", "b"] and args.max_num_batched_tokens == 64
    assert args.port == 9001  # the command line wins over the file
    (tmp_path / "bad.yaml").write_text("- a list\n")
    with pytest.raises(SystemExit):
        parse_args(["serve", "--config", str(tmp_path / "bad.yaml")])


def test_cmd_serve_is_what_main_runs():
    assert parse_args(["serve", "m.gguf"]).func is cmd_serve


def test_speculative_config_is_honoured_and_the_old_flags_point_at_it(caplog):
    caplog.set_level(logging.WARNING, logger="carpool")
    warnings, config = warnings_for(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5, '
                                     '"prompt_lookup_max": 4}'], caplog)
    assert warnings == []
    assert config.speculative_config == SpeculativeConfig(num_speculative_tokens=5, prompt_lookup_max=4)
    for argv in (["--speculative-model", "ngram"], ["--num-speculative-tokens", "5"],
                 ["--ngram-prompt-lookup-max", "4"], ["--ngram-prompt-lookup-min", "1"]):
        warnings, config = warnings_for(argv, caplog)
        assert len(warnings) == 1 and "--speculative-config" in warnings[0], (argv, warnings)
        assert config.speculative_config is None
    with pytest.raises(SystemExit):
        parse_args(["serve", "m.gguf", "--speculative-config", '{"method": "medusa"}'])
