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
# vLLM's values for a carpool flag that carpool names otherwise.
ALIASES: dict[str, dict[str, str]] = {
    "dtype": {"half": "float16", "float": "float32"},
}

# vLLM engine and server arguments with nothing to set here, and why (said once, in the warning).
# `LLM(...)` keyword arguments and `vllm serve` flags (`--` + the name with dashes) alike.
_WHY = {
    "Downloads": ("models are local files; nothing is downloaded",
                  "revision code_revision tokenizer_revision download_dir hf_token hf_config_path "
                  "safetensors_load_strategy model_loader_extra_config ignore_patterns use_tqdm_on_load "
                  "pt_load_map_location load_format config_format max_parallel_loading_workers"),
    "Tokenizer": ("carpool always uses the model's own tokenizer",
                  "tokenizer tokenizer_mode skip_tokenizer_init tokenizer_pool_size tokenizer_pool_type"),
    "Code": ("carpool runs no code from model folders, plugins or import paths",
             "trust_remote_code model_impl worker_cls worker_extension_cls scheduler_cls logits_processors "
             "logits_processor_pattern io_processor_plugin middleware tool_parser_plugin reasoning_parser_plugin "
             "additional_config override_neuron_config"),
    "Memory": ("size the KV cache with --kv-cache-memory (bytes) instead",
               "gpu_memory_utilization num_gpu_blocks_override"),
    "Swap": ("preempted requests are recomputed, never swapped or offloaded",
             "swap_space cpu_offload_gb preemption_mode kv_offloading_size kv_offloading_backend"),
    "KV dtype": ("the KV cache is kept in the model's dtype",
                 "kv_cache_dtype calculate_kv_scales mamba_cache_dtype mamba_ssm_cache_dtype mamba_block_size "
                 "override_attention_dtype prefix_caching_hash_algo kv_sharing_fast_prefill"),
    "Graphs": ("carpool compiles with torch.compile's defaults (--enforce-eager to turn it off); no CUDA graphs",
               "compilation_config max_seq_len_to_capture cudagraph_capture_sizes cuda_graph_sizes "
               "max_cudagraph_capture_size attention_backend"),
    "All-reduce": ("tensor parallelism uses torch.distributed's collectives",
                   "disable_custom_all_reduce distributed_executor_backend ray_workers_use_nsight "
                   "worker_use_ray engine_use_ray"),
    "Data parallel": ("one engine per server; run several servers behind a load balancer instead",
                      "data_parallel_size data_parallel_rank data_parallel_start_rank data_parallel_size_local "
                      "data_parallel_address data_parallel_rpc_port data_parallel_backend data_parallel_hybrid_lb "
                      "disable_nccl_for_dp_synchronization decode_context_parallel_size headless "
                      "api_server_count disable_frontend_multiprocessing"),
    "Experts": ("no mixture-of-experts models", "enable_expert_parallel all2all_backend enable_dbo "
                "dbo_decode_token_threshold dbo_prefill_token_threshold enable_eplb eplb_config "
                "expert_placement_strategy num_redundant_experts eplb_window_size eplb_step_interval "
                "eplb_log_balancedness"),
    "Text only": ("carpool serves text-only models",
                  "allowed_local_media_path allowed_media_domains limit_mm_per_prompt enable_mm_embeds "
                  "media_io_kwargs mm_processor_kwargs mm_processor_cache_gb disable_mm_preprocessor_cache "
                  "mm_processor_cache_type mm_shm_cache_max_object_size_mb mm_encoder_tp_mode "
                  "mm_encoder_attn_backend interleave_mm_strings skip_mm_profiling video_pruning_rate "
                  "disable_chunked_mm_input enable_multimodal_encoder_data_parallel enable_prompt_embeds "
                  "chat_template_content_format"),
    "Generate only": ("carpool only generates", "task runner convert pooler_config override_pooler_config"),
    "LoRA": ("no LoRA or prompt adapters",
             "enable_lora max_loras max_lora_rank lora_extra_vocab_size lora_dtype max_cpu_loras fully_sharded_loras "
             "default_mm_loras lora_modules enable_lora_bias long_lora_scaling_factors qlora_adapter_name_or_path "
             "enable_prompt_adapter max_prompt_adapters max_prompt_adapter_token prompt_adapters"),
    "Speculative": ("set speculative decoding with --speculative-config (vLLM's JSON) instead",
                    "speculative_model num_speculative_tokens "
                    "speculative_draft_tensor_parallel_size ngram_prompt_lookup_max ngram_prompt_lookup_min"),
    "Disaggregated": ("no disaggregated prefill or KV events", "kv_transfer_config kv_events_config tokens_only"),
    "Tracing": ("no OpenTelemetry tracing; Prometheus metrics at /metrics",
                "otlp_traces_endpoint collect_detailed_traces show_hidden_metrics_for_version "
                "enable_server_load_tracking aggregate_engine_logging log_config_file log_error_stack "
                "enable_log_outputs"),
    "Scheduling": ("carpool's schedulers are chosen with --scheduler (chunked prefill always on)",
                   "max_num_partial_prefills max_long_partial_prefills long_prefill_token_threshold "
                   "num_lookahead_slots scheduling_policy async_scheduling "
                   "num_scheduler_steps multi_step_stream_outputs use_v2_block_manager disable_async_output_proc "
                   "scheduler_delay_factor enable_chunked_prefill"),
    "Rope": ("the model file's own settings are used", "rope_scaling rope_theta hf_overrides "
             "disable_sliding_window disable_cascade_attn override_generation_config logprobs_mode "
             "enable_sleep_mode"),
    "Structured": ("structured outputs always use llguidance; no reasoning parsers",
                   "structured_outputs_config reasoning_parser guided_decoding_backend "
                   "guided_decoding_disable_fallback guided_decoding_disable_any_whitespace "
                   "guided_decoding_disable_additional_properties enable_reasoning"),
    "TLS": ("serve plain HTTP on loopback and terminate TLS in a reverse proxy",
            "ssl_keyfile ssl_certfile ssl_ca_certs enable_ssl_refresh ssl_cert_reqs uds"),
    "Frontend": ("not a carpool server option", "trust_request_chat_template enable_request_id_headers "
                 "exclude_tools_when_tool_choice_none tool_server enable_force_include_usage "
                 "h11_max_incomplete_event_size h11_max_header_count"),
}
IGNORED: dict[str, str] = {name: why for why, names in _WHY.values() for name in names.split()}
# Values of an ignored argument that are what carpool does anyway: accepted without a warning.
DEFAULT_ONLY: dict[str, tuple] = {
    "kv_cache_dtype": ("auto",), "tokenizer_mode": ("auto",), "load_format": ("auto", "gguf"),
    "config_format": ("auto",), "task": ("auto", "generate"), "runner": ("auto", "generate"),
    "convert": ("auto", "none"), "model_impl": ("auto",), "chat_template_content_format": ("auto", "string"),
    "data_parallel_size": (1,), "decode_context_parallel_size": (1,), "api_server_count": (1,),
    "scheduling_policy": ("fcfs",), "enable_chunked_prefill": (True,), "distributed_executor_backend": ("mp",),
    "data_parallel_backend": ("mp",), "mamba_cache_dtype": ("auto",), "mamba_ssm_cache_dtype": ("auto",),
    "num_scheduler_steps": (1,), "logprobs_mode": ("raw_logprobs",), "prefix_caching_hash_algo": ("sha256",),
}
# How the ignored flags parse: switches take no value (and have a --no- form), lists one or
# more values, --hf-token an optional one; the rest one value each. Short names as vLLM's.
SWITCHES = frozenset(
    "trust_remote_code skip_tokenizer_init enable_prompt_embeds disable_sliding_window disable_cascade_attn "
    "enable_sleep_mode use_tqdm_on_load data_parallel_hybrid_lb enable_expert_parallel enable_dbo "
    "disable_nccl_for_dp_synchronization enable_eplb eplb_log_balancedness ray_workers_use_nsight "
    "disable_custom_all_reduce enable_multimodal_encoder_data_parallel calculate_kv_scales kv_sharing_fast_prefill "
    "enable_mm_embeds disable_mm_preprocessor_cache interleave_mm_strings skip_mm_profiling enable_lora "
    "fully_sharded_loras disable_chunked_mm_input async_scheduling "
    "aggregate_engine_logging headless trust_request_chat_template enable_ssl_refresh "
    "disable_frontend_multiprocessing enable_request_id_headers exclude_tools_when_tool_choice_none "
    "enable_server_load_tracking enable_force_include_usage enable_log_outputs log_error_stack tokens_only "
    "multi_step_stream_outputs use_v2_block_manager disable_async_output_proc enable_prompt_adapter "
    "enable_reasoning enable_lora_bias worker_use_ray engine_use_ray enable_chunked_prefill".split())
LISTS = frozenset("allowed_media_domains ignore_patterns logits_processors lora_modules cudagraph_capture_sizes "
                  "cuda_graph_sizes collect_detailed_traces prompt_adapters long_lora_scaling_factors".split())
SHORT = {"decode_context_parallel_size": "-dcp", "data_parallel_size": "-dp", "data_parallel_rank": "-dpn",
         "data_parallel_start_rank": "-dpr", "data_parallel_size_local": "-dpl", "data_parallel_address": "-dpa",
         "data_parallel_rpc_port": "-dpp", "data_parallel_backend": "-dpb", "api_server_count": "-asc",
         "compilation_config": "-O"}
_warned: set[str] = set()

# Fields set another way: the environment (torchrun's rendezvous) or their default.
NOT_FLAGS = frozenset(f.name for f in fields(EngineConfig) if f.metadata.get("flag", True) is False)
_SCALARS = {"int": int, "float": float, "str": str}


def human_int(text: str) -> int:
    """vLLM's sizes: 4096, 32k (x1000), 32K (x1024), 1.5m."""
    text = text.strip()
    decimal, binary = {"k": 10**3, "m": 10**6, "g": 10**9}, {"K": 2**10, "M": 2**20, "G": 2**30}
    try:
        if text[-1:] in decimal:
            return int(float(text[:-1]) * decimal[text[-1]])
        if text[-1:] in binary:
            return int(text[:-1]) * binary[text[-1]]
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer such as 4096, 32k or 32K, got {text!r}") from None


HUMAN_INTS = frozenset({"max_model_len", "max_num_batched_tokens"})


def _aliased(name: str, convert):
    aliases = ALIASES[name]
    return lambda text: convert(aliases.get(text, text))


def _said(parse):
    """A field's own parser, its ValueError shown as the error (argparse would print only
    "invalid parse_x value"): e.g. which key of --speculative-config is wrong."""
    def parse_flag(text: str):
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse_flag


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field, named as the field (as vLLM names them), with the help,
    short name, parser and choices its metadata holds; vLLM's sizes (32k) and value names
    (--dtype half) are read too."""
    g = p.add_argument_group("engine (named as in vllm serve)")
    for f in fields(EngineConfig):
        if f.name in NOT_FLAGS:
            continue
        extras = dict(f.metadata)
        names = ["--" + f.name.replace("_", "-")] + ([extras.pop("short")] if "short" in extras else [])
        default = None if f.default is MISSING else f.default
        if f.type in ("bool", "bool | None"):
            g.add_argument(*names, action=argparse.BooleanOptionalAction, default=default, **extras)
            continue
        if f.name in HUMAN_INTS:
            extras.setdefault("type", human_int)
        elif "type" in extras:
            extras["type"] = _said(extras["type"])
        if "type" not in extras:
            extras["type"] = _SCALARS[f.type.split(" | ")[0]]
        if f.name in ALIASES:
            extras["type"] = _aliased(f.name, extras["type"])
        g.add_argument(*names, default=default, **extras)


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig) if f.name not in NOT_FLAGS})


def engine_config(model: str | None = None, **kwargs) -> EngineConfig:
    """An EngineConfig from vLLM-style keyword arguments."""
    names = {f.name for f in fields(EngineConfig)}
    values: dict[str, Any] = {"model": model}
    for key, value in kwargs.items():
        if key == "enable_chunked_prefill" and value is False:
            continue  # said below, with what to use instead
        if key in names:
            values[key] = ALIASES.get(key, {}).get(value, value) if isinstance(value, str) else value
        elif key in MAPPED:
            name, convert = MAPPED[key]
            values[name] = None if value is None else convert(value)
        elif value not in DEFAULT_ONLY.get(key, ()):
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


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_vllm_engine_flags(p: argparse.ArgumentParser) -> None:
    """Every other `vllm serve` flag (IGNORED): parsed as vLLM parses it, then warned about once
    by `apply_vllm_engine_flags`; and vLLM's other name for --kv-cache-memory."""
    g = p.add_argument_group("accepted from vllm serve (mapped, or ignored with a warning)")
    g.add_argument("--kv-cache-memory-bytes", type=human_int, default=None, help="same as --kv-cache-memory, in bytes")
    taken = {option for action in p._actions for option in action.option_strings}
    for name in IGNORED:
        names = [flag_name(name)] + ([SHORT[name]] if name in SHORT else [])
        if names[0] in taken:
            continue
        if name in SWITCHES:
            g.add_argument(*names, dest=name, action=argparse.BooleanOptionalAction, default=None,
                           help=argparse.SUPPRESS)
        elif name == "hf_token":  # --hf-token alone: the token huggingface_hub has stored
            g.add_argument(*names, dest=name, nargs="?", const=True, default=None, help=argparse.SUPPRESS)
        else:
            g.add_argument(*names, dest=name, nargs="+" if name in LISTS else None, default=None,
                           help=argparse.SUPPRESS)


def _shown(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def apply_vllm_engine_flags(args, config: EngineConfig) -> EngineConfig:
    """--kv-cache-memory-bytes honoured; one warning per ignored flag that asks for something
    carpool does not do (a switch turned off, or a value carpool has anyway, says nothing)."""
    from dataclasses import replace

    if args.kv_cache_memory_bytes is not None:
        config = replace(config, kv_cache_memory=args.kv_cache_memory_bytes)
    for name, why in IGNORED.items():
        value = getattr(args, name, None)
        if value is None or value is False or (name == "tokenizer" and value == config.model):
            continue
        if _shown(value) in map(str, DEFAULT_ONLY.get(name, ())):
            continue
        flag = flag_name(name)
        warn_ignored(flag if value is True else f"{flag} {_shown(value)}", why)
    if getattr(args, "enable_chunked_prefill", None) is False:
        warn_ignored("--no-enable-chunked-prefill", "chunked prefill is how carpool schedules; use "
                     "--scheduler vllm for whole-prompt prefills")
    return config
