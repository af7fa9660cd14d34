"""LLMEngine: request -> scheduler -> batch -> model runner -> sampler -> outputs, once per step."""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass

import torch

from carpool.config import (EngineConfig, default_kv_cache_memory, keep_freed_memory_in_process,
                            resolve_device, resolve_dtype)
from carpool.core.block_manager import BlockManager
from carpool.core.scheduler import ScheduledBatch, make_scheduler
from carpool.model.loader import is_gguf, load_model, open_gguf
from carpool.model_runner import ModelRunner, kv_bytes_per_token
from carpool.outputs import OutputProcessor, RequestOutput
from carpool.request import Request, RequestStatus
from carpool.sampler import Sampler
from carpool.sampling_params import SamplingParams
from carpool.tokenizer import load_tokenizer

log = logging.getLogger("carpool")


@dataclass
class IterationStats:
    start_time: float
    duration: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_requests: int
    num_preempted: int


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **kwargs):
        self.config = config = config or EngineConfig(**kwargs)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            keep_freed_memory_in_process()
        self.dtype = resolve_dtype(config.dtype, self.device)
        reader = open_gguf(config.model) if is_gguf(config.model) else None
        self.model = load_model(config.model, self.dtype, self.device, gguf_reader=reader)
        self.model_config = self.model.config
        self.tokenizer = load_tokenizer(config.model, gguf_reader=reader)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids or [self.tokenizer.eos_token_id])

        per_token = kv_bytes_per_token(self.model_config, self.dtype)
        budget = config.kv_cache_memory or default_kv_cache_memory(self.device)
        num_blocks = budget // (per_token * config.block_size)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory of {budget} bytes holds no block "
                             f"({per_token * config.block_size} bytes each)")
        self.block_manager = BlockManager(num_blocks, config.block_size)
        self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings,
                                 self.block_manager.capacity_tokens)
        self.scheduler = make_scheduler(config.scheduler, self.block_manager, config.max_num_batched_tokens,
                                        config.max_num_seqs, self.max_model_len)
        self.runner = ModelRunner(self.model, num_blocks, config.block_size, self.device, self.dtype)
        self.sampler = Sampler(config.seed)
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len)
        self.requests: dict[str, Request] = {}
        self.iteration_stats: deque[IterationStats] = deque(maxlen=100_000)
        self._ids = itertools.count()
        log.info("KV cache: %d blocks x %d tokens = %d tokens (%.0f MiB, %s); max_model_len %d",
                 num_blocks, config.block_size, self.block_manager.capacity_tokens,
                 num_blocks * config.block_size * per_token / 2**20, self.dtype, self.max_model_len)

    # ------------------------------------------------------------ requests in
    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        ids = list(prompt)
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        return ids

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> Request:
        """Validate and queue a request. Raises ValueError (and holds nothing) if it is bad."""
        sp = sampling_params or SamplingParams()
        if not isinstance(sp, SamplingParams):
            raise TypeError("sampling_params must be a SamplingParams")
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if isinstance(prompt, str) and not prompt:
            raise ValueError("the prompt is empty")
        ids = self.tokenize_prompt(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens, but at most {self.max_model_len - 1} fit "
                f"(context {self.model_config.max_position_embeddings} tokens, KV cache "
                f"{self.block_manager.capacity_tokens} tokens) with room for one generated token")
        bad = [t for t in sp.stop_token_ids if not 0 <= t < self.model_config.vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids {bad} are outside the vocabulary")
        request = Request(request_id, ids, sp, prompt=prompt if isinstance(prompt, str) else None,
                          eos_token_ids=self.eos_token_ids)
        if arrival_time is not None:
            request.arrival_time = arrival_time
        self.requests[request_id] = request
        self.outputs.add(request)
        self.scheduler.add_request(request)
        return request

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; returns its final output (None if unknown)."""
        request = self.requests.pop(request_id, None)
        if request is None or request.is_finished:
            return None
        self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
        return self.outputs.make_output(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    # ------------------------------------------------------------ one iteration
    def step(self) -> list[RequestOutput]:
        start = time.monotonic()
        batch = self.scheduler.schedule()
        if not batch.requests:
            return []
        num_decode, num_prefill = batch.num_decode_tokens, batch.num_prefill_tokens
        try:
            logits = self.runner.execute(batch)
            ready = self.scheduler.commit(batch)
            tokens, logprobs = self.sampler(logits, ready) if ready else ([], [])
        except Exception as exc:  # fail this batch's requests; the engine keeps serving others
            log.exception("step failed")
            return self._fail(batch, f"{type(exc).__name__}: {exc}")
        now = time.monotonic()
        outputs = []
        for request, token, lp in zip(ready, tokens, logprobs):
            if lp is not None:
                request.output_logprobs.append(lp)
            status = self.outputs.append_token(request, token, now)
            if status is not None:
                self.scheduler.finish(request, status)
                del self.requests[request.request_id]
            outputs.append(self.outputs.make_output(request))
        self.iteration_stats.append(IterationStats(start, time.monotonic() - start, num_prefill,
                                                   num_decode, len(batch), len(batch.preempted)))
        return outputs

    def _fail(self, batch: ScheduledBatch, message: str) -> list[RequestOutput]:
        outputs = []
        for request in batch.requests:
            request.error = message
            self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
            self.requests.pop(request.request_id, None)
            outputs.append(self.outputs.make_output(request))
        return outputs
