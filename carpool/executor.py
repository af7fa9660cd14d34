"""The engine's one interface to wherever the model runs.

`UniprocExecutor` holds the whole model in this process (the default); `MultiprocExecutor`
(carpool/distributed) spreads it over tensor x pipeline parallel worker processes and keeps the
driver's shard here. The engine only submits micro-batches and collects their logits:

    submit(batch)          start a micro-batch (at most `max_in_flight` at once)
    collect() -> logits    wait for the oldest one; logits of its requests that are sampled
"""

from __future__ import annotations

from collections import deque
from typing import Any, Protocol

import torch
from torch import nn

from carpool.config import EngineConfig, ModelConfig
from carpool.core.scheduler import SCHEDULERS, ScheduledBatch
from carpool.model.loader import is_gguf, load_model, open_gguf
from carpool.model_runner import KVLayout, ModelRunner, kv_bytes_per_token


class ExecutorError(RuntimeError):
    """The parallel workers failed (a worker died, a transfer broke) and were shut down. The
    engine fails every request with this message and raises it from step() and add_request()."""


class Executor(Protocol):
    max_in_flight: int  # micro-batches submitted before the oldest must be collected (PP stages)
    num_local_processes: int  # processes on this host: they share its RAM for KV caches
    model_config: ModelConfig
    kv_bytes_per_token: int  # a block's bytes over its tokens, of the largest KV shard; every rank holds as many blocks
    kv_layout: KVLayout | None  # which table and cache slice each layer uses; None: a table for all, a slice each
    gguf_reader: Any | None  # the open GGUF file, for the tokenizer
    model: nn.Module  # this process's model (the whole model, or the driver's shard)
    runner: ModelRunner | None  # this process's runner, once init_kv_cache has run

    @property
    def num_in_flight(self) -> int: ...

    def init_kv_cache(self, num_blocks: int) -> None: ...

    def submit(self, batch: ScheduledBatch) -> None: ...

    def collect(self) -> torch.Tensor: ...

    def stage_timings(self, reset: bool = False) -> dict | None: ...

    def shutdown(self) -> None: ...


class UniprocExecutor:
    """The whole model in this process; a micro-batch runs when it is collected."""

    max_in_flight = 1
    num_local_processes = 1

    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype):
        self.config, self.device, self.dtype = config, device, dtype
        self.gguf_reader = open_gguf(config.model) if is_gguf(config.model) else None
        self.model = load_model(config.model, dtype, device, gguf_reader=self.gguf_reader,
                                quantization=config.quantization)
        self.model_config = self.model.config
        windowed = SCHEDULERS[config.scheduler].steps_within_budget and not config.disable_hybrid_kv_cache_manager
        self.kv_layout = KVLayout.of(self.model_config) if windowed else KVLayout.plain(self.model_config.num_layers)
        self.kv_bytes_per_token = kv_bytes_per_token(self.model_config, dtype, self.kv_layout.num_slices)
        self.runner: ModelRunner | None = None
        self._queue: deque[ScheduledBatch] = deque()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.runner = ModelRunner(self.model, num_blocks, self.config.block_size, self.device, self.dtype,
                                  enforce_eager=self.config.enforce_eager, layout=self.kv_layout)

    @property
    def num_in_flight(self) -> int:
        return len(self._queue)

    def submit(self, batch: ScheduledBatch) -> None:
        self._queue.append(batch)

    def collect(self) -> torch.Tensor:
        return self.runner.execute(self._queue.popleft())

    def stage_timings(self, reset: bool = False) -> dict | None:
        return None

    def shutdown(self) -> None:
        self._queue.clear()


def make_executor(config: EngineConfig, device: torch.device, dtype: torch.dtype) -> Executor:
    if config.world_size == 1:
        return UniprocExecutor(config, device, dtype)
    from carpool.distributed.executor import MultiprocExecutor

    return MultiprocExecutor(config, device, dtype)
