"""Replay a workload and record timelines: in process (engine.step, no HTTP) or over HTTP.

Both drivers return the same `RunResult` (plain `RequestTimeline`s and `IterationRecord`s on the
`time.monotonic` clock), so `carpool.harness.metrics` never knows which one ran. Every request asks
for exactly its `output_len` tokens (greedy, `ignore_eos`).

A driver may be given a `stop` callback, called about every `check_interval` seconds with the
timelines so far and the current time; when it returns a reason the run ends early and every
request still in flight is aborted (the capacity search uses this to give up on a rate as soon
as its SLO is certainly violated).

Multi-turn workloads: a follow-up turn is sent `think time` after its previous turn finished,
with that turn's prompt and answer in front of its new message. In process these are the exact
token ids the engine holds, so the conversation's prefix really repeats; over HTTP the answer is
known as text only and is tokenized back with the local tokenizer (the same ids unless a token
boundary shifts). A turn whose previous turn failed fails too, without being sent.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from carpool.harness.metrics import IterationRecord, RequestTimeline
from carpool.harness.workload import RequestSpec, followup_prompt, split_conversations

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
        engine.reset_prefix_cache()  # each run starts cold: earlier runs replayed the same prompts
        firsts, followups = split_conversations(specs)
        added: list[tuple[RequestSpec, object]] = []
        errors: list[RequestTimeline] = []
        start = time.monotonic()
        # (arrival time, tie-break, spec, prompt ids): first turns now, follow-ups as turns finish
        pending = [(start + s.arrival_time, k, s, s.prompt_token_ids) for k, s in enumerate(firsts)]
        order = itertools.count(len(pending))
        waiting_for: dict[str, tuple[RequestSpec, object]] = {}  # request id -> a turn with follow-ups
        next_check = start + self.check_interval
        stopped = None
        while pending or engine.has_unfinished_requests():
            now = time.monotonic()
            while pending and pending[0][0] <= now:
                arrival, _, spec, prompt = heapq.heappop(pending)
                sp = SamplingParams(max_tokens=spec.output_len, ignore_eos=True, temperature=0.0)
                try:
                    req = engine.add_request(prompt, sp, request_id=f"bench{self._runs}-{spec.index}",
                                             arrival_time=arrival)
                    added.append((spec, req))
                    if spec.index in followups:
                        waiting_for[req.request_id] = (spec, req)
                except ValueError as e:
                    errors.append(RequestTimeline(str(spec.index), arrival, [], len(prompt),
                                                  num_expected_tokens=spec.output_len, error=str(e)))
                    fail_followups(spec, followups, arrival, errors)
            if stop is not None and now >= next_check:
                next_check = now + self.check_interval
                stopped = stop(self._timelines(added) + errors, now)
                if stopped:
                    for _, req in added:
                        engine.abort_request(req.request_id)
                    break
            if engine.has_unfinished_requests():
                for out in engine.step():
                    if not (out.finished and out.request_id in waiting_for):
                        continue
                    spec, req = waiting_for.pop(out.request_id)
                    if req.error is not None or req.finish_reason not in ("length", "stop"):
                        fail_followups(spec, followups, req.finished_time, errors)
                        continue
                    for f in followups[spec.index]:
                        heapq.heappush(pending, (req.finished_time + f.arrival_time, next(order), f,
                                                 followup_prompt(f, req.token_ids)))
            elif pending:
                time.sleep(max(0.0, pending[0][0] - time.monotonic()))
        end = time.monotonic()
        iterations = [IterationRecord(s.start_time, s.duration, s.num_prefill_tokens, s.num_decode_tokens,
                                      s.num_requests, s.num_preempted, s.predicted_duration, s.slo_unreachable)
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
                req.num_prompt_tokens, req.first_scheduled_time, req.finished_time, req.num_preemptions,
                spec.output_len, error, req.num_cached_tokens))
        return out


def fail_followups(spec: RequestSpec, followups: dict[int, list[RequestSpec]], when: float,
                   errors: list[RequestTimeline]) -> None:
    """The turn `spec` failed: its follow-ups (and theirs) fail without being sent."""
    for f in followups.get(spec.index, ()):
        errors.append(RequestTimeline(str(f.index), when, [], f.prompt_len, num_expected_tokens=f.output_len,
                                      error=f"previous turn {spec.index} failed"))
        fail_followups(f, followups, when, errors)


class OnlineDriver:
    """Streams /v1/completions from any OpenAI-compatible server (carpool serve, vLLM, ...).

    Token times are when each SSE chunk arrives at this client. With `logprobs` (default) the
    request asks for `logprobs: 0`, so each chunk says how many tokens it carries even when their
    text is empty; without it, each chunk counts as one token (see `count_tokens`), and the
    server's usage count, when sent, reveals how many went unseen: `notes["tokens_not_seen"]`. The time a
    request was first scheduled is not visible over HTTP, so scheduling delay is None here."""

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None,
                 prompt_format: str = "ids", detokenize: Callable[[list[int]], str] | None = None,
                 logprobs: bool = True, timeout: float = 3600.0, check_interval: float = 0.5,
                 extra_body: dict | None = None, tokenize: Callable[[str], list[int]] | None = None):
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
        self.tokenize = tokenize  # answer text -> ids, for the prompts of follow-up turns

    def run(self, specs: list[RequestSpec], stop: StopCheck | None = None) -> RunResult:
        firsts, followups = split_conversations(specs)
        if followups and self.tokenize is None:
            raise ValueError("a multi-turn workload over HTTP needs a tokenize function for the answers")
        import uvloop  # the client's own per-token work competes with the server for the cores

        return uvloop.run(self._run(firsts, followups, stop))

    def warmup(self, prompt_len: int = 64, output_len: int = 8) -> None:
        spec = RequestSpec(0, 0.0, [(i * 7919) % 30000 + 100 for i in range(prompt_len)], output_len)
        self.run([spec])

    async def resolve_model(self, client) -> str:
        if self.model:
            return self.model
        async with client.get(f"{self.base_url}/models", headers=self.headers) as r:
            if r.status != 200:
                raise RuntimeError(f"GET {self.base_url}/models: HTTP {r.status}: {(await r.text())[:200]}")
            data = (await r.json()).get("data") or []
        if not data:
            raise RuntimeError(f"{self.base_url}/models lists no model; pass --served-model")
        self.model = data[0]["id"]
        return self.model

    async def _run(self, specs: list[RequestSpec], followups: dict[int, list[RequestSpec]],
                   stop: StopCheck | None) -> RunResult:
        import aiohttp

        notes = {"driver": "online", "base_url": self.base_url, "tokens_not_seen": 0}
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=30.0, sock_read=self.timeout)
        async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as client:
            model = await self.resolve_model(client)
            notes["model"] = model
            start = time.monotonic() + 0.05
            timelines = [RequestTimeline(str(s.index), start + s.arrival_time, [], s.prompt_len,
                                         num_expected_tokens=s.output_len) for s in specs]
            tasks = [asyncio.create_task(self._turn(client, model, s, s.prompt_token_ids, t, timelines, followups,
                                                    notes)) for s, t in zip(specs, timelines)]
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

    async def _turn(self, client, model: str, spec: RequestSpec, prompt: list[int], timeline: RequestTimeline,
                    timelines: list[RequestTimeline], followups: dict[int, list[RequestSpec]], notes: dict) -> None:
        """One request, then (conversations) its follow-up turns once it has finished."""
        answer = await self._one(client, model, spec, prompt, timeline, notes)
        nxt = followups.get(spec.index, [])
        if not nxt:
            return
        if timeline.error is not None or not timeline.completed:
            errors: list[RequestTimeline] = []
            fail_followups(spec, followups, timeline.finished_time or time.monotonic(), errors)
            timelines.extend(errors)
            return
        history = prompt + self.tokenize(answer)
        turns = []
        for f in nxt:
            t = RequestTimeline(str(f.index), timeline.finished_time + f.arrival_time, [], f.prompt_len,
                                num_expected_tokens=f.output_len)
            timelines.append(t)
            turns.append(self._turn(client, model, f, followup_prompt(f, history), t, timelines, followups, notes))
        await asyncio.gather(*turns)

    def _body(self, model: str, spec: RequestSpec, prompt: list[int]) -> dict:
        prompt = prompt if self.prompt_format == "ids" else self.detokenize(prompt)
        body = {"model": model, "prompt": prompt, "max_tokens": spec.output_len, "min_tokens": spec.output_len,
                "ignore_eos": True, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}}
        if self.logprobs:
            body["logprobs"] = 0
        body.update(self.extra_body)
        return body

    async def _one(self, client, model: str, spec: RequestSpec, prompt: list[int], timeline: RequestTimeline,
                   notes: dict) -> str:
        """Stream one completion into `timeline` (sent at its arrival time); returns the text."""
        await asyncio.sleep(max(0.0, timeline.arrival_time - time.monotonic()))
        text: list[str] = []
        try:
            async with client.post(f"{self.base_url}/completions", json=self._body(model, spec, prompt),
                                   headers=self.headers) as resp:
                if resp.status != 200:
                    body = (await resp.read()).decode(errors="replace")
                    timeline.error = f"HTTP {resp.status}: {body[:300]}"
                    return ""
                reported = None
                async for line in resp.content:
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        break
                    now = time.monotonic()
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        timeline.error = str(chunk["error"].get("message", chunk["error"]))
                        break
                    for choice in chunk.get("choices") or []:
                        n = count_tokens(choice)
                        timeline.token_times.extend([now] * n)
                        text.append(choice.get("text") or "")
                    usage = chunk.get("usage")
                    if usage and usage.get("completion_tokens") is not None:
                        reported = usage["completion_tokens"]
                        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
                        timeline.num_cached_tokens = int(cached or 0)
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
        return "".join(text)


def count_tokens(choice: dict) -> int:
    """Tokens in one streamed completion choice: the logprobs entries if present, else one per
    chunk that has text or is not the last (a server that sends a chunk per token, as vLLM and
    carpool do, sends an empty one for a token whose text it holds back)."""
    lp = choice.get("logprobs")
    if isinstance(lp, dict) and isinstance(lp.get("tokens"), list):
        return len(lp["tokens"])
    text = choice.get("text")
    return 1 if text or (text == "" and choice.get("finish_reason") is None) else 0
