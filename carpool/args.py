"""Engine arguments in one place: the command-line flags are generated from `EngineConfig`'s
fields (name, type, default, and the help and argparse extras in each field's metadata), and
vLLM's engine arguments are honoured (a field of the same name), mapped (another name or unit for a field), or
ignored with one warning each -- never a TypeError for an argument a vLLM script passes.
`LLM(...)` uses `engine_config`; every `carpool` command that runs an engine uses
`add_engine_args` / `engine_config_from_args`; `carpool serve` also accepts vLLM's flags."""

from __future__ import annotations

import argparse
import logging
from dataclasses import MISSING, fields
from typing import Any

from carpool.config import EngineConfig

log = logging.getLogger("carpool")

# vLLM name -> (EngineConfig field, conversion)
MAPPED: dict[str, tuple[str, Any]] = {
    "kv_cache_memory_bytes": ("kv_cache_memory", int),
    "max_num_batched_tokens": ("max_num_batched_tokens", int),
}
# vLLM arguments with nothing to do here, and why (said once, in the warning).
IGNORED: dict[str, str] = {
    "gpu_memory_utilization": "size the KV cache with kv_cache_memory (bytes) instead",
    "tokenizer": "carpool always uses the model's own tokenizer",
    "tokenizer_mode": "carpool always uses the model's own tokenizer",
    "trust_remote_code": "carpool runs no code from model folders",
    "swap_space": "preempted requests are recomputed, never swapped",
    "cpu_offload_gb": "no offloading",
    "revision": "models are local files",
    "tokenizer_revision": "models are local files",
    "enable_chunked_prefill": "chunked prefill is always on (Sarathi-Serve)",
    "max_seq_len_to_capture": "no CUDA graphs",
    "disable_custom_all_reduce": "no custom all-reduce",
    "hf_token": "nothing is downloaded",
    "download_dir": "nothing is downloaded",
    "task": "carpool only generates",
    "compilation_config": "carpool compiles with Inductor's defaults (--enforce-eager to turn it off)",
    "kv_cache_dtype": "the KV cache is kept in the model's dtype",
}
# vLLM arguments whose only value here is this one: accepted without a warning.
DEFAULT_ONLY: dict[str, Any] = {"kv_cache_dtype": "auto"}
_warned: set[str] = set()

# Fields set another way: the environment (torchrun's rendezvous) or their default.
NOT_FLAGS = frozenset(f.name for f in fields(EngineConfig) if f.metadata.get("flag", True) is False)
_SCALARS = {"int": int, "float": float, "str": str}


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field, named as the field (as vLLM names them), with the help,
    short name, parser and choices its metadata holds."""
    g = p.add_argument_group("engine (named as in vllm serve)")
    for f in fields(EngineConfig):
        if f.name in NOT_FLAGS:
            continue
        extras = dict(f.metadata)
        names = ["--" + f.name.replace("_", "-")] + ([extras.pop("short")] if "short" in extras else [])
        default = None if f.default is MISSING else f.default
        if f.type in ("bool", "bool | None"):
            g.add_argument(*names, action=argparse.BooleanOptionalAction, default=default, **extras)
        else:
            extras.setdefault("type", _SCALARS[f.type.split(" | ")[0]])
            g.add_argument(*names, default=default, **extras)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig) if f.name not in NOT_FLAGS})


def engine_config(model: str | None = None, **kwargs) -> EngineConfig:
    """An EngineConfig from vLLM-style keyword arguments."""
    names = {f.name for f in fields(EngineConfig)}
    values: dict[str, Any] = {"model": model}
    for key, value in kwargs.items():
        if key in names:
            values[key] = value
        elif key in MAPPED:
            name, convert = MAPPED[key]
            values[name] = None if value is None else convert(value)
        elif key not in DEFAULT_ONLY or value != DEFAULT_ONLY[key]:
            warn_ignored(f"{key}={value!r}" if key in DEFAULT_ONLY else key,
                         IGNORED.get(key, "not a carpool engine argument"))
    if kwargs.get("enable_chunked_prefill") is False:
        warn_ignored("enable_chunked_prefill=False", "chunked prefill is how carpool schedules; use "
                     "scheduler='vllm' for whole-prompt prefills")
    return EngineConfig(**values)


def warn_ignored(name: str, why: str) -> None:
    if name not in _warned:
        _warned.add(name)
        log.warning("ignoring %s: %s", name, why)


def add_vllm_engine_flags(p) -> None:
    """`vllm serve` engine flags with nothing to set here, or another name for a carpool flag;
    `apply_vllm_engine_flags` honours or warns about them once parsed."""
    g = p.add_argument_group("accepted from vllm serve (mapped, or ignored with a warning)")
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None, help="same as --kv-cache-memory, in bytes")
    for flag in ("--gpu-memory-utilization", "--tokenizer", "--tokenizer-mode", "--swap-space", "--revision",
                 "--download-dir", "--max-seq-len-to-capture", "--cpu-offload-gb", "--kv-cache-dtype"):
        g.add_argument(flag, default=None, help=argparse.SUPPRESS)
    for flag in ("--trust-remote-code", "--disable-custom-all-reduce"):
        g.add_argument(flag, action="store_true", default=None, help=argparse.SUPPRESS)
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=None,
                   help=argparse.SUPPRESS)


def apply_vllm_engine_flags(args, config: EngineConfig) -> EngineConfig:
    from dataclasses import replace

    if args.kv_cache_memory_bytes is not None:
        config = replace(config, kv_cache_memory=args.kv_cache_memory_bytes)
    for name, why in IGNORED.items():
        value = getattr(args, name, None)
        if value is not None and not (name == "tokenizer" and value == config.model) and value != DEFAULT_ONLY.get(name):
            flag = f"--{name.replace('_', '-')}"
            warn_ignored(f"{flag} {value}" if name in DEFAULT_ONLY else flag, why)
    if getattr(args, "enable_chunked_prefill", None) is False:
        warn_ignored("--no-enable-chunked-prefill", "chunked prefill is how carpool schedules; use "
                     "--scheduler vllm for whole-prompt prefills")
    return config
