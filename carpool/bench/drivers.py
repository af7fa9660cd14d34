"""Replay a workload and record timelines: in process (engine.step, no HTTP) or over HTTP.

Both drivers return the same `RunResult` (plain `RequestTimeline`s and `IterationRecord`s on the
`time.monotonic` clock), so `carpool.bench.metrics` never knows which one ran. Every request asks
for exactly its `output_len` tokens (greedy, `ignore_eos`).

A driver may be given a `stop` callback, called about every `check_interval` seconds with the
timelines so far and the current time; when it returns a reason the run ends early and every
request still in flight is aborted (the capacity search uses this to give up on a rate as soon
as its SLO is certainly violated).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from carpool.bench.metrics import IterationRecord, RequestTimeline
from carpool.bench.workload import RequestSpec

StopCheck = Callable[[list[RequestTimeline], float], "str | None"]


@dataclass
class RunResult:
    timelines: list[RequestTimeline]
    iterations: list[IterationRecord]
    start_time: float  # the workload's t=0 on the monotonic clock
    end_time: float
    stopped_early: str | None = None  # the stop callback's reason, if it fired
    notes: dict = field(default_factory=dict)


class InProcessDriver:
    """Adds each request to an `LLMEngine` at its arrival time and steps the engine in between.
    Arrival times are the workload's (not when the loop got round to adding it), so time a
    request waits behind a running step counts as its queueing delay."""

    def __init__(self, engine, check_interval: float = 0.5):
        self.engine = engine
        self.check_interval = check_interval
        self._runs = 0

    def warmup(self, prompt_len: int = 64, output_len: int = 8) -> None:
        """One short request, so first-call costs (allocator, kernels) stay out of measurements."""
        from carpool.sampling_params import SamplingParams

        vocab = self.engine.model_config.vocab_size
        ids = [(i * 7919) % vocab for i in range(1, prompt_len + 1)]
        request = self.engine.add_request(ids, SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0))
        while not request.is_finished:
            self.engine.step()

    def run(self, specs: list[RequestSpec], stop: StopCheck | None = None) -> RunResult:
        from carpool.sampling_params import SamplingParams

        engine = self.engine
        if engine.has_unfinished_requests():
            raise RuntimeError("the engine is busy; the in-process driver needs it idle")
        self._runs += 1
        specs = sorted(specs, key=lambda s: s.arrival_time)
        added: list[tuple[RequestSpec, object]] = []
        errors: list[RequestTimeline] = []
        start = time.monotonic()
        next_check = start + self.check_interval
        stopped = None
        i = 0
        while i < len(specs) or engine.has_unfinished_requests():
            now = time.monotonic()
            while i < len(specs) and start + specs[i].arrival_time <= now:
                spec = specs[i]
                arrival = start + spec.arrival_time
                sp = SamplingParams(max_tokens=spec.output_len, ignore_eos=True, temperature=0.0)
                try:
                    req = engine.add_request(spec.prompt_token_ids, sp, request_id=f"bench{self._runs}-{spec.index}",
                                             arrival_time=arrival)
                    added.append((spec, req))
                except ValueError as e:
                    errors.append(RequestTimeline(str(spec.index), arrival, [], spec.prompt_len,
                                                  num_expected_tokens=spec.output_len, error=str(e)))
                i += 1
            if stop is not None and now >= next_check:
                next_check = now + self.check_interval
                stopped = stop(self._timelines(added) + errors, now)
                if stopped:
                    for _, req in added:
                        engine.abort_request(req.request_id)
                    break
            if engine.has_unfinished_requests():
                engine.step()
            elif i < len(specs):
                time.sleep(max(0.0, start + specs[i].arrival_time - time.monotonic()))
        end = time.monotonic()
        iterations = [IterationRecord(s.start_time, s.duration, s.num_prefill_tokens, s.num_decode_tokens,
                                      s.num_requests, s.num_preempted)
                      for s in engine.iteration_stats if s.start_time >= start]
        timelines = self._timelines(added, copy=True) + errors
        timelines.sort(key=lambda t: (t.arrival_time, int(t.request_id)))
        return RunResult(timelines, iterations, start, end, stopped,
                         {"driver": "in-process", "scheduler": engine.config.scheduler,
                          "max_num_batched_tokens": engine.config.max_num_batched_tokens})

    @staticmethod
    def _timelines(added, copy: bool = False) -> list[RequestTimeline]:
        out = []
        for spec, req in added:
            error = req.error or (f"finished early: {req.finish_reason}" if req.is_finished
                                  and req.finish_reason not in ("length", "stop") else None)
            out.append(RequestTimeline(
                str(spec.index), req.arrival_time, list(req.token_times) if copy else req.token_times,
                spec.prompt_len, req.first_scheduled_time, req.finished_time, req.num_preemptions,
                spec.output_len, error))
        return out


class OnlineDriver:
    """Streams /v1/completions from any OpenAI-compatible server (carpool serve, vLLM, ...).

    Token times are when each SSE chunk arrives at this client. With `logprobs` (default) the
    request asks for `logprobs: 0`, so each chunk says how many tokens it carries even when their
    text is empty; without it, each non-empty chunk counts as one token (and the server's usage
    count, when sent, reveals how many went unseen: `notes["tokens_not_seen"]`). The time a
    request was first scheduled is not visible over HTTP, so scheduling delay is None here."""

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None,
                 prompt_format: str = "ids", detokenize: Callable[[list[int]], str] | None = None,
                 logprobs: bool = True, timeout: float = 3600.0, check_interval: float = 0.5,
                 extra_body: dict | None = None):
        if prompt_format not in ("ids", "text"):
            raise ValueError(f"prompt_format must be ids or text, got {prompt_format!r}")
        if prompt_format == "text" and detokenize is None:
            raise ValueError("prompt_format 'text' needs a detokenize function")
        self.base_url = base_url.rstrip("/")
        if not self.base_url.endswith("/v1"):
            self.base_url += "/v1"
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.prompt_format = prompt_format
        self.detokenize = detokenize
        self.logprobs = logprobs
        self.timeout = timeout
        self.check_interval = check_interval
        self.extra_body = extra_body or {}

    def run(self, specs: list[RequestSpec], stop: StopCheck | None = None) -> RunResult:
        return asyncio.run(self._run(sorted(specs, key=lambda s: s.arrival_time), stop))

    def warmup(self, prompt_len: int = 64, output_len: int = 8) -> None:
        spec = RequestSpec(0, 0.0, [(i * 7919) % 30000 + 100 for i in range(prompt_len)], output_len)
        self.run([spec])

    async def resolve_model(self, client) -> str:
        if self.model:
            return self.model
        r = await client.get(f"{self.base_url}/models", headers=self.headers)
        if r.status_code != 200:
            raise RuntimeError(f"GET {self.base_url}/models: HTTP {r.status_code}: {r.text[:200]}")
        data = r.json().get("data") or []
        if not data:
            raise RuntimeError(f"{self.base_url}/models lists no model; pass --served-model")
        self.model = data[0]["id"]
        return self.model

    async def _run(self, specs: list[RequestSpec], stop: StopCheck | None) -> RunResult:
        import httpx

        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        timeout = httpx.Timeout(self.timeout, connect=30.0)
        notes = {"driver": "online", "base_url": self.base_url, "tokens_not_seen": 0}
        async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
            model = await self.resolve_model(client)
            notes["model"] = model
            start = time.monotonic() + 0.05
            timelines = [RequestTimeline(str(s.index), start + s.arrival_time, [], s.prompt_len,
                                         num_expected_tokens=s.output_len) for s in specs]
            tasks = [asyncio.create_task(self._one(client, model, s, t, start, notes))
                     for s, t in zip(specs, timelines)]
            stopped = None
            pending = set(tasks)
            while pending:
                _, pending = await asyncio.wait(pending, timeout=self.check_interval)
                now = time.monotonic()
                if stop is not None and pending:
                    stopped = stop([t for t in timelines if t.arrival_time <= now], now)
                    if stopped:
                        for task in pending:
                            task.cancel()
                        await asyncio.gather(*pending, return_exceptions=True)
                        break
            end = time.monotonic()
        if stopped:  # requests that never arrived are not part of the run
            timelines = [t for t in timelines if t.arrival_time <= end]
        return RunResult(timelines, [], start, end, stopped, notes)

    def _body(self, model: str, spec: RequestSpec) -> dict:
        prompt = spec.prompt_token_ids if self.prompt_format == "ids" else self.detokenize(spec.prompt_token_ids)
        body = {"model": model, "prompt": prompt, "max_tokens": spec.output_len, "min_tokens": spec.output_len,
                "ignore_eos": True, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}}
        if self.logprobs:
            body["logprobs"] = 0
        body.update(self.extra_body)
        return body

    async def _one(self, client, model: str, spec: RequestSpec, timeline: RequestTimeline, start: float,
                   notes: dict) -> None:
        await asyncio.sleep(max(0.0, start + spec.arrival_time - time.monotonic()))
        try:
            async with client.stream("POST", f"{self.base_url}/completions", json=self._body(model, spec),
                                     headers=self.headers) as resp:
                if resp.status_code != 200:
                    text = (await resp.aread()).decode(errors="replace")
                    timeline.error = f"HTTP {resp.status_code}: {text[:300]}"
                    return
                reported = None
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    now = time.monotonic()
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        timeline.error = str(chunk["error"].get("message", chunk["error"]))
                        break
                    for choice in chunk.get("choices") or []:
                        n = count_tokens(choice)
                        timeline.token_times.extend([now] * n)
                    usage = chunk.get("usage")
                    if usage and usage.get("completion_tokens") is not None:
                        reported = usage["completion_tokens"]
                timeline.finished_time = time.monotonic()
                if reported is not None and reported > len(timeline.token_times):
                    notes["tokens_not_seen"] += reported - len(timeline.token_times)
                    if not self.logprobs:  # the server did generate them; only their times are unknown
                        timeline.num_expected_tokens = len(timeline.token_times)
        except asyncio.CancelledError:
            timeline.error = timeline.error or "cancelled"
            raise
        except Exception as e:  # a connection failure fails this request, not the run
            timeline.error = f"{type(e).__name__}: {e}"


def count_tokens(choice: dict) -> int:
    """Tokens in one streamed completion choice: the logprobs entries if present, else one per
    non-empty text chunk."""
    lp = choice.get("logprobs")
    if isinstance(lp, dict) and isinstance(lp.get("tokens"), list):
        return len(lp["tokens"])
    return 1 if choice.get("text") else 0
