"""LLMEngine: request -> scheduler -> batch -> model runner -> sampler -> outputs, once per step.

The model runs behind an executor: in this process (the default), or over tensor x pipeline
parallel worker processes (carpool/distributed). With a pipeline of P stages, a step keeps up to
P micro-batches in flight: it submits new ones while the pipeline has room, then collects the
oldest and returns its outputs. The scheduler skips requests whose micro-batch is in flight."""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import torch

from carpool.config import (EngineConfig, default_kv_cache_memory, keep_freed_memory_in_process,
                            resolve_device, resolve_dtype)
from carpool.core import step_cache
from carpool.core.block_manager import BlockManager
from carpool.core.scheduler import ScheduledBatch, make_scheduler
from carpool.core.step_cost import BatchShape
from carpool.executor import Executor, ExecutorError, make_executor
from carpool.inputs import PromptType, parse_prompt
from carpool.model import cpu_kernels, quant
from carpool.model.loader import hf_generation_config, resolve_model_path
from carpool.outputs import OutputProcessor, RequestOutput
from carpool.request import Request, RequestStatus
from carpool.sampler import BAD_LOGITS, Sampler, score_prompt
from carpool.sampling_params import SamplingParams
from carpool.spec.acceptance import SpecDecodeStats, drafts_to_ask, next_draft_kept
from carpool.spec.proposers import make_proposer
from carpool.structured import StructuredOutputs
from carpool.structured.masks import MaskJob
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
    predicted_duration: float | None = None  # by an SLO-following policy, when it planned the step
    slo_unreachable: bool = False  # its decodes alone were predicted over the target TBT
    num_draft_tokens: int = 0  # speculative tokens scored (carpool/spec)
    num_accepted_tokens: int = 0  # of which verification kept


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, **kwargs):
        self.config = config = config or EngineConfig(**kwargs)
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config.device)
        if self.device.type == "cpu":
            keep_freed_memory_in_process()
        self.dtype = resolve_dtype(config.dtype, self.device, config.model, config.quantization)
        self.executor: Executor = make_executor(config, self.device, self.dtype)
        try:
            self._init_after_model(config)
        except BaseException:
            self.executor.shutdown()
            raise

    def _init_after_model(self, config: EngineConfig) -> None:
        ex = self.executor
        self.model = ex.model  # the whole model, or with TP/PP the driver's shard (last stage)
        self.model_config = ex.model_config
        if config.generation_config == "vllm":
            self.model_config.generation_defaults = {}
        elif config.generation_config != "auto":
            self.model_config.generation_defaults = hf_generation_config(Path(config.generation_config))[1]
        self.tokenizer = load_tokenizer(config.model, gguf_reader=ex.gguf_reader)
        self.eos_token_ids = frozenset(self.model_config.eos_token_ids or [self.tokenizer.eos_token_id])

        per_token = ex.kv_bytes_per_token  # of the largest KV shard with TP/PP; every rank has num_blocks
        budget = config.kv_cache_memory or default_kv_cache_memory(self.device)
        if config.kv_cache_memory is None and self.device.type == "cpu":
            budget //= ex.num_local_processes  # the processes of this host share its RAM
        num_blocks = budget // (per_token * config.block_size)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory of {budget} bytes holds no block "
                             f"({per_token * config.block_size} bytes each)")
        layout = ex.kv_layout
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching,
                                          window=layout.window if layout else None,
                                          window_tables=layout.window_tables if layout else 0,
                                          max_step_tokens=config.max_num_batched_tokens)
        if self.block_manager.capacity_tokens < config.block_size:
            raise ValueError(f"kv_cache_memory of {budget} bytes holds {num_blocks} blocks, fewer than the "
                             f"{self.block_manager.window_reserve} a step's sliding windows take")
        self.max_model_len = min(config.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings,
                                 self.block_manager.capacity_tokens)
        self.scheduler = make_scheduler(config.scheduler, self.block_manager, config.max_num_batched_tokens,
                                        config.max_num_seqs, self.max_model_len, **self._step_cost_args(config))
        ex.init_kv_cache(num_blocks)
        self.runner = ex.runner
        self.sampler = Sampler(config.seed)
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len)
        self.structured = StructuredOutputs(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self.requests: dict[str, Request] = {}
        self.iteration_stats: deque[IterationStats] = deque(maxlen=100_000)
        self._ids = itertools.count()
        # Submitted, not collected: each batch with its start time and its grammar masks' job.
        self._in_flight: deque[tuple[ScheduledBatch, float, MaskJob | None]] = deque()
        self._dead: str | None = None  # why the parallel workers failed; the engine then refuses work
        # Steps in a row whose batch failed as a whole: a sticky fault (a broken device) shows
        # as a run of these, which the server treats as the engine being dead.
        self.num_consecutive_failed_steps = 0
        self._batch_observers: list[Callable[[ScheduledBatch], None]] = []
        self.spec_config = config.speculative_config
        self.spec_stats = SpecDecodeStats()
        self.proposer = None if self.spec_config is None else make_proposer(self.spec_config, self)
        log.info("KV cache: %d blocks x %d tokens = %d tokens (%.0f MiB%s, %s%s); max_model_len %d",
                 num_blocks, config.block_size, self.block_manager.capacity_tokens,
                 num_blocks * config.block_size * per_token / 2**20,
                 " per worker" if config.world_size > 1 else "", self.dtype,
                 f"; sliding layers hold their {layout.window}-token window" if layout and layout.window else "",
                 self.max_model_len)
        if config.target_tbt is not None and not config.cost_profile:
            self._calibrate_step_cost()

    # ------------------------------------------------------------ requests in
    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's generation_config.json defaults (temperature, top_p,
        top_k, min_p, repetition_penalty, max_new_tokens -> max_tokens), as vLLM applies them to
        requests that give none; plain SamplingParams() for models without one."""
        defaults = self.model_config.generation_defaults
        try:
            return SamplingParams(**defaults)
        except (TypeError, ValueError) as e:
            log.warning("ignoring the model's generation_config.json defaults %s: %s", defaults, e)
            return SamplingParams()

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        ids = list(prompt)
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        return ids

    def add_request(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> Request:
        """Validate and queue a request. `prompt` is text, token ids, or vLLM's TextPrompt /
        TokensPrompt dict (carpool/inputs.py). Raises ValueError (and holds nothing) if it is bad."""
        if self._dead is not None:
            raise ExecutorError(self._dead)
        sp = sampling_params or self.default_sampling_params()
        if not isinstance(sp, SamplingParams):
            raise TypeError("sampling_params must be a SamplingParams")
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids = parse_prompt(prompt)
        if ids is None and not text:
            raise ValueError("the prompt is empty")
        ids = self.tokenize_prompt(text if ids is None else ids)
        if not ids:
            raise ValueError("the prompt is empty")
        if sp.truncate_prompt_tokens is not None:
            ids = ids[-sp.truncate_prompt_tokens:]
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens, but at most {self.max_model_len - 1} fit "
                f"(context {self.model_config.max_position_embeddings} tokens, KV cache "
                f"{self.block_manager.capacity_tokens} tokens) with room for one generated token")
        if sp.n != 1:
            raise ValueError("n: the engine runs one choice per request; add one request per choice "
                             "(LLM.generate and the server do)")
        vocab = self.model_config.vocab_size
        for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
            bad = [t for t in getattr(sp, name) or () if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{name}: token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        request = Request(request_id, ids, sp, prompt=text,
                          eos_token_ids=self.eos_token_ids)
        for word in sp.bad_words or ():
            for variant in (word, " " + word.lstrip()):
                seq = self.tokenizer.encode(variant, add_special_tokens=False)
                if seq and seq not in request.bad_words_token_ids:
                    request.bad_words_token_ids.append(seq)
        if sp.structured_outputs is not None:
            request.grammar = self.structured.matcher(sp.structured_outputs)  # ValueError if invalid
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

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix (benchmarks start each run cold); only while idle."""
        return self.block_manager.reset_prefix_cache()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.scheduler.waiting) + len(self.scheduler.running)

    # ------------------------------------------------------------ one iteration
    def step(self) -> list[RequestOutput]:
        if self._dead is not None:
            raise ExecutorError(self._dead)
        ex = self.executor
        start = time.monotonic()
        while ex.num_in_flight < ex.max_in_flight:  # one pass without a pipeline
            batch = self.scheduler.schedule()
            if not batch.requests:
                break
            for observe in self._batch_observers:
                observe(batch)
            try:
                ex.submit(batch)
            except ExecutorError as exc:
                self._die(exc)
            masks = self.structured.start_masks(batch)  # computed while the model runs
            if ex.max_in_flight > 1:
                self.scheduler.mark_in_flight(batch)
            self._in_flight.append((batch, start, masks))
            start = time.monotonic()
        if not self._in_flight:
            return []
        batch, start, masks = self._in_flight.popleft()
        num_decode, num_prefill = batch.num_decode_tokens, batch.num_prefill_tokens
        accepted_before = self.spec_stats.num_accepted_tokens
        scored = [(r, r.prompt_logprob_positions(n)) for r, n in zip(batch.requests, batch.num_tokens)
                  if r.prompt_logprobs is not None]
        try:
            logits = ex.collect()
            if scored:  # the rows after the sampled ones score prompt tokens (StepPlan.logit_rows)
                logits = self._score_prompts(scored, logits)
            if ex.max_in_flight > 1:
                logits = self._drop_aborted(batch, logits)
            ready = self.scheduler.commit(batch)
            drafts = batch.drafts_of(ready)
            grammar = masks.masks_for(ready) if masks is not None else None
            outputs = self._emit(logits, ready, drafts, grammar)
        except ExecutorError as exc:
            self._die(exc)
        except Exception as exc:  # fail this batch's requests; the engine keeps serving others
            log.exception("step failed")
            return self._fail(batch, f"{type(exc).__name__}: {exc}")
        if self.proposer is not None:
            self._propose([r for r in ready if r.status is RequestStatus.RUNNING])
        self.num_consecutive_failed_steps = 0
        duration = time.monotonic() - start
        self.scheduler.observe(batch, duration)
        self.iteration_stats.append(IterationStats(start, duration, num_prefill, num_decode, len(batch),
                                                   len(batch.preempted), batch.predicted_time,
                                                   batch.slo_unreachable, batch.num_draft_tokens,
                                                   self.spec_stats.num_accepted_tokens - accepted_before))
        return outputs

    def _emit(self, logits: torch.Tensor, ready: list[Request], drafts: list[list[int]],
              grammar) -> list[RequestOutput]:
        """Sample each ready request's next token and append it; then, for a request that
        scored drafts, keep going while the token sampled equals the draft at its place (that
        draft's KV is then valid, and the next row's logits follow it). Each position is sampled
        as a step without drafts would sample it: penalties, logprobs, stop checks and the
        request's generator all see the tokens before it. Returns one output per request."""
        rows = [0] * len(ready)  # the first logits row of each ready request
        for i in range(1, len(ready)):
            rows[i] = rows[i - 1] + 1 + len(drafts[i - 1])
        argmax = self._greedy_draft_tokens(logits, ready, drafts, rows)
        now = time.monotonic()
        failed: dict[int, RequestOutput] = {}
        kept = [0] * len(ready)
        last: dict[int, int] = {}  # each request's last token of the step
        active, position = list(range(len(ready))), 0
        while active:
            sampled = [i for i in active if position == 0 or i not in argmax]
            results = dict(zip(sampled, zip(*self.sampler(
                logits, [ready[i] for i in sampled], grammar if position == 0 else None,
                [rows[i] + position for i in sampled])))) if sampled else {}
            going = []
            for i in active:
                request = ready[i]
                if i in results:
                    token, lp, error = results[i]
                else:
                    token, lp = argmax[i][position - 1], None
                    error = BAD_LOGITS if token is None else None
                if error is None and request.grammar is not None:
                    error = self.structured.accept(request, token)
                if error is not None:  # this row alone failed to sample; the others go on
                    failed[i] = self._fail_request(request, error)
                    continue
                if lp is not None:
                    self.outputs.append_logprobs(request, token, lp)
                last[i] = token
                status = self.outputs.append_token(request, token, now)
                if status is None and request.grammar is not None and self.structured.is_complete(request):
                    status = RequestStatus.FINISHED_STOPPED  # the grammar allows nothing more
                if status is not None:
                    self.scheduler.finish(request, status)
                    del self.requests[request.request_id]
                elif position < len(drafts[i]) and token == drafts[i][position]:
                    self.scheduler.accept_draft(request)
                    kept[i] += 1
                    going.append(i)
            active, position = going, position + 1
        for i, request in enumerate(ready):
            if drafts[i]:
                self.spec_stats.record(len(drafts[i]), kept[i])
                self.scheduler.end_verification(request)
            if request.spec is not None and i in last:
                request.spec.observe(len(drafts[i]), kept[i],
                                     next_draft_kept(request.spec_token_ids, len(drafts[i]), kept[i], last[i]))
        return [failed[i] if i in failed else self.outputs.make_output(r) for i, r in enumerate(ready)]

    @staticmethod
    def _greedy_draft_tokens(logits: torch.Tensor, ready: list[Request], drafts: list[list[int]],
                             rows: list[int]) -> dict[int, list[int | None]]:
        """For greedy requests that nothing else edits (no penalties, token controls, logprobs or
        grammar), the token at each draft's place: the argmax of its row (None where the row
        is not finite), all in one call instead of one sampler call per position."""
        plain = [i for i, r in enumerate(ready) if drafts[i] and r.sampling_params.greedy
                 and not r.sampling_params.edits_logits and r.sampling_params.logprobs is None
                 and r.grammar is None]
        if not plain:
            return {}
        best, tokens = cpu_kernels.row_max(logits.float(), [rows[i] + p for i in plain for p in range(1, 1 + len(drafts[i]))])
        found = iter(t if ok else None for t, ok in zip(tokens.tolist(), (best < float("inf")).tolist()))
        return {i: [next(found) for _ in drafts[i]] for i in plain}

    # ~460 prompt tokens and 6 decodes each: ~1 s for the embedded model on a 2-core CPU, a few
    # for a 1B model (start-up waits for it); the 384-token prompt shows the fit attention over a
    # long prefix, unless its step would pass CALIBRATION_STEP_SECONDS (last_calibration_prompt).
    CALIBRATION_PROMPTS = (16, 64, 384)
    CALIBRATION_DECODES = 6
    CALIBRATION_STEP_SECONDS = 1.0

    @classmethod
    def last_calibration_prompt(cls, seconds_per_prompt_token: float) -> int:
        """The last calibration prompt's length at the measured cost of a prompt token: the last of
        CALIBRATION_PROMPTS, or fewer tokens where its step would pass CALIBRATION_STEP_SECONDS (a
        1B Q4_K_M on 2 Zen 3 cores: ~12 ms a token, 4.6 s for 384), but at least twice the one
        before. A model that slow plans chunks of tens of tokens beside decodes, and a lone prompt's
        longer steps widen the fit's trust region as they run; start-up waits for every step here."""
        before, last = cls.CALIBRATION_PROMPTS[-2:]
        if seconds_per_prompt_token <= 0:
            return last
        return max(2 * before, min(last, int(cls.CALIBRATION_STEP_SECONDS / seconds_per_prompt_token)))

    def _calibrate_step_cost(self) -> None:
        """Run a few throwaway requests through the SLO policy, so that its step-time fit starts
        ready: an empty fit predicts nothing, and the first users' steps would be sized by its
        trust region alone (64, 128, 256 tokens, ...), whatever they cost. The steps are kept on
        disk (core/step_cache.py); a later start with the same model, settings and machine
        replays them instead."""
        start = time.perf_counter()
        cost = self.scheduler.cost
        identity = self._calibration_identity()
        path = step_cache.cache_path(identity)
        cached = step_cache.load_steps(path)
        if cached is not None:
            for shape, seconds in cached:
                cost.observe(shape, seconds)
            log.info("fitted the step-time model on %d cached steps (%s)", cost.num_observations, path)
            return
        shapes: list[BatchShape] = []
        stop_observing = self.add_batch_observer(lambda batch: shapes.append(batch.shape or BatchShape.of(batch)))
        vocab = self.model_config.vocab_size
        params = SamplingParams(max_tokens=self.CALIBRATION_DECODES, ignore_eos=True, temperature=0)
        first = len(self.iteration_stats)
        try:
            for k, n in enumerate(self.CALIBRATION_PROMPTS):  # one at a time: steps of many shapes
                timed = list(self.iteration_stats)[first:] if k == len(self.CALIBRATION_PROMPTS) - 1 else []
                if timed:  # the last prompt, sized by the cost of the earlier ones' prompt tokens
                    longest = max(timed, key=lambda s: s.num_prefill_tokens)
                    n = self.last_calibration_prompt(longest.duration / max(longest.num_prefill_tokens, 1))
                if n < self.max_model_len - params.max_tokens:
                    self.add_request([(7919 * (i + k) + 1) % vocab for i in range(n)], params,
                                     request_id=f"calibration-{k}")
                    for _ in range(2):  # its prefill beside the earlier ones' decodes, then a decode
                        self.step()
            while self.has_unfinished_requests():
                self.step()
        finally:
            stop_observing()
        durations = [s.duration for s in list(self.iteration_stats)[len(self.iteration_stats) - len(shapes):]]
        step_cache.save_steps(path, identity, list(zip(shapes, durations)))  # each batch made one entry
        self.reset_prefix_cache()
        self.iteration_stats.clear()
        self.scheduler.num_slo_unreachable = 0
        log.info("fitted the step-time model on %d steps in %.1f s", cost.num_observations,
                 time.perf_counter() - start)

    def _calibration_identity(self) -> dict:
        """What a calibration step's cost depends on (its cache key)."""
        config = self.config
        lib = cpu_kernels.library() if self.device.type == "cpu" else None
        return {"model": step_cache.file_identity(resolve_model_path(config.model)),
                "quantization": config.quantization, "dtype": str(self.dtype), "device": str(self.device),
                "accelerator": torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else None,
                "cpu": cpu_kernels.cpu_model(), "kernels": getattr(lib, "_name", None),
                "tile_from": quant.tile_choices() if lib is not None else None,
                "threads": torch.get_num_threads(), "torch": torch.__version__,
                "eager": config.enforce_eager, "tp": config.tensor_parallel_size,
                "pp": config.pipeline_parallel_size, "block_size": config.block_size,
                "speculative": repr(config.speculative_config),
                "prompts": self.CALIBRATION_PROMPTS, "decodes": self.CALIBRATION_DECODES}

    def _step_cost_args(self, config: EngineConfig) -> dict:
        """A target TBT for sarathi, with the step-time fit seeded from a profile if one is given;
        held as an SLO when given, as a comfort level when it is the default."""
        if config.target_tbt is None:
            return {}
        from carpool.core.cost_profile import FittedCostModel
        from carpool.core.step_cost import StepCostModel, seeded_step_cost

        cost, sizes = StepCostModel(), None
        if config.cost_profile:
            profile = FittedCostModel.load(config.cost_profile)
            cost, sizes = seeded_step_cost(profile, config.max_num_batched_tokens, self.max_model_len)
        return {"target_tbt": config.target_tbt, "cost": cost, "chunk_sizes": sizes,
                "strict": config.target_tbt_ms is not None}

    def add_batch_observer(self, observe: Callable[[ScheduledBatch], None]) -> Callable[[], None]:
        """Call `observe(batch)` for every batch as it is submitted, before it runs (the
        simulator's fidelity and calibration tools record batch shapes this way; each later
        gets one `iteration_stats` entry). Returns a function that removes the observer."""
        self._batch_observers.append(observe)
        return lambda: self._batch_observers.remove(observe)

    def _score_prompts(self, scored: list[tuple[Request, range]], logits: torch.Tensor) -> torch.Tensor:
        """Append this step's prompt logprobs to their requests; returns the sampled rows."""
        first = len(logits) - sum(len(positions) for _, positions in scored)
        sampled, prompt_logits = logits[:first], logits[first:]
        for request, positions in scored:
            rows, prompt_logits = prompt_logits[:len(positions)], prompt_logits[len(positions):]
            if positions:
                self.outputs.append_prompt_logprobs(request, score_prompt(rows, request, positions))
        return sampled

    def _propose(self, requests: list[Request]) -> None:
        """Drafts for the next step of each request that just sampled (spec/acceptance.py says
        how many). Grammar-constrained requests do not speculate: their drafts would need
        checking against the grammar first."""
        asked, limits = [], []
        for request in requests:
            request.spec_token_ids = []
            if request.grammar is not None:
                continue
            limit = drafts_to_ask(request, self.spec_config.num_speculative_tokens, self.max_model_len)
            if limit > 0:
                asked.append(request)
                limits.append(limit)
        if asked:
            for request, proposal in zip(asked, self.proposer.propose(asked, limits)):
                request.spec_token_ids = proposal

    @staticmethod
    def _drop_aborted(batch: ScheduledBatch, logits: torch.Tensor) -> torch.Tensor:
        """Rows of requests aborted while their micro-batch was in flight are not sampled."""
        if all(r.status is RequestStatus.RUNNING for r in batch.requests):
            return logits
        rows, row = [], 0
        for r, n, drafts in zip(batch.requests, batch.num_tokens, batch.drafts):
            if r.num_computed_tokens + n - len(drafts) == r.num_tokens:  # sampled: 1 + len(drafts) rows
                if r.status is RequestStatus.RUNNING:
                    rows.extend(range(row, row + 1 + len(drafts)))
                row += 1 + len(drafts)
        return logits[rows]

    def _die(self, exc: BaseException) -> NoReturn:
        """The parallel workers failed (the executor has stopped the rest): fail every request
        with the reason, then raise it. The engine's state can no longer be trusted, so, as for
        any step that raises, callers stop (the server fails its open requests and turns
        unhealthy); later calls raise the same error."""
        self._dead = f"the engine's parallel workers failed: {exc}; the engine has shut down"
        log.error(self._dead)
        self.executor.shutdown()
        self._in_flight.clear()
        for request in list(self.requests.values()):
            if not request.is_finished:
                request.error = self._dead
                self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
        self.requests.clear()
        raise ExecutorError(self._dead) from exc

    def shutdown(self) -> None:
        """Stop the parallel workers, if any (a no-op for a single-process engine)."""
        self.executor.shutdown()
        self.structured.shutdown()
        if self.proposer is not None:
            self.proposer.close()

    def _fail(self, batch: ScheduledBatch, message: str) -> list[RequestOutput]:
        self.num_consecutive_failed_steps += 1
        # Requests aborted while their micro-batch was in flight are already finished.
        return [self._fail_request(r, message) for r in batch.requests if not r.is_finished]

    def _fail_request(self, request: Request, message: str) -> RequestOutput:
        request.error = message
        self.scheduler.finish(request, RequestStatus.FINISHED_ERROR)
        self.requests.pop(request.request_id, None)
        return self.outputs.make_output(request)
