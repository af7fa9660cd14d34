"""Fixtures for the tensor/pipeline-parallel tests: CPU, gloo, workers spawned on loopback.

torch.distributed allows one default process group per process, so at most one parallel engine
is alive in the test process: `parallel_engine(...)` returns a cached engine for the same
settings and shuts the previous one down otherwise. Every test is bounded: a hang dumps all
stacks and exits the test process (faulthandler) instead of stalling CI.
"""

from __future__ import annotations

import faulthandler
import sys

import pytest
import torch

from carpool.engine import LLMEngine
from tests.model.test_hf_folder import write_checkpoint

TEST_TIMEOUT_S = 240


@pytest.fixture(autouse=True)
def hang_guard():
    faulthandler.dump_traceback_later(TEST_TIMEOUT_S, exit=True, file=sys.stderr)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, engine_fp32) -> str:
    """A 3-layer random Llama with 8 heads / 4 KV heads (divides by TP 2, 4)."""
    folder = tmp_path_factory.mktemp("tiny_llama")
    write_checkpoint(folder, "llama", engine_fp32.tokenizer)
    return str(folder)


class EngineCache:
    def __init__(self):
        self.key = None
        self.engine: LLMEngine | None = None
        self.threads = torch.get_num_threads()

    def get(self, **kwargs) -> LLMEngine:
        key = tuple(sorted(kwargs.items()))
        # A test server's lifespan shuts its engine down on stop: start a fresh one then too.
        if key != self.key or self.engine._dead is not None or self.engine.executor.group.closed:
            self.close()
            kwargs.setdefault("num_threads", 1)
            self.engine = LLMEngine(**kwargs)
            self.key = key
        return self.engine

    def close(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        self.engine, self.key = None, None
        torch.set_num_threads(self.threads)  # the driver took 1 thread; give the others theirs back


@pytest.fixture(scope="module")
def parallel_engine():
    cache = EngineCache()
    yield cache.get
    cache.close()
