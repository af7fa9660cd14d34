"""Shared fixtures: the embedded model is loaded once per test session."""

from __future__ import annotations

import ctypes
import gc
import os

import pytest
import torch
from hypothesis import settings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Eager forwards unless a test asks for the compiled one: the suite builds hundreds of engines,
# and compiling each would add minutes (tests/model/test_compiled.py covers compilation).
os.environ.setdefault("CARPOOL_ENFORCE_EAGER", "1")
# The fixed token budget unless a test asks for sarathi's default step-time target: its batches
# follow measured step times, and each engine would time throwaway requests at start-up
# (tests/core/test_default_target.py covers the default).
os.environ.setdefault("CARPOOL_TARGET_TBT_MS", "0")
# No step-time calibration cached across tests: each engine that calibrates times its own steps
# (tests/core/test_step_cache.py covers the cache).
os.environ.setdefault("CARPOOL_STEP_CACHE", "off")
torch.set_num_threads(min(2, os.cpu_count() or 1))

# Hypothesis profiles: `dev` (make test) runs a quarter of each property test's examples, `ci`
# (make test-all, CI) all of them. Tests size their runs with `helpers.examples(n)`.
settings.register_profile("ci", deadline=None, print_blob=True)
settings.register_profile("dev", deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

from carpool.config import default_model_path  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _return_freed_memory():
    """After each module, hand the memory its engines freed back to the system: glibc keeps freed
    heap pages for reuse, and the suite's RSS would otherwise only grow."""
    yield
    gc.collect()
    libc = ctypes.CDLL(None)
    if hasattr(libc, "malloc_trim"):  # glibc
        libc.malloc_trim(0)


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "1, 2, 3, 4, 5,",
    "The quick brown fox",
    "Explain photosynthesis in one sentence:",
    "<|im_start|>user\nWhat is 7 times 8?<|im_end|>\n<|im_start|>assistant\n",
    "Les chats sont",
    "import numpy as np\nx = np.",
    "A list of prime numbers: 2, 3, 5, 7,",
]


@pytest.fixture(scope="session")
def model_path() -> str:
    return default_model_path()


@pytest.fixture(scope="session")
def engine_fp32(model_path):
    from carpool.engine import LLMEngine

    return LLMEngine(model=model_path, dtype="float32", kv_cache_memory=256 << 20)


@pytest.fixture(scope="session")
def hf_model(model_path):
    """transformers' own GGUF loader: the independent reference."""
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    p = Path(model_path)
    return AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name, dtype=torch.float32).eval()
