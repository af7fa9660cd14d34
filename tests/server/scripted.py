"""A scripted `EngineClient` for the HTTP-contract tests: no model, deterministic tokens.

Each request's reply is the text `reply(prompt ids, params)` returns (REPLY by default), encoded
with the real tokenizer and handed out one token per step on the server's event loop, with the
deltas the real clients deliver (text, ids, logprobs, prompt logprobs, finish reason). A reply
shorter than max_tokens finishes with "stop" (as at an EOS token) unless the request says
ignore_eos, when the reply repeats; a longer one is cut at max_tokens with "length".

The engine's own checks on a request (token ids in the vocabulary, the prompt's length) are
made here too, with the engine's messages, so that its refusals take the server's path for them.
Tests steer the rest: `paused` holds requests in the waiting queue, `fail_after` makes a
request fail mid-generation with an error text, `kill()` is the engine dying.

`serve(engine, **options)` runs `create_app` over it in process, through httpx.ASGITransport.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx

from carpool.outputs import Logprob
from carpool.sampling_params import SamplingParams
from carpool.server.app import create_app
from carpool.server.async_engine import RequestGroup
from carpool.server.engine_client import (
    DEAD_AFTER_ERROR,
    NOT_RUNNING,
    EngineDeadError,
    EngineInfo,
    EngineOverloadedError,
    RequestRejectedError,
)
from carpool.server.metrics import ServerMetrics
from carpool.server.options import ServerOptions
from carpool.structured import StructuredOutputs

MODEL_NAME = "smol"
REPLY = " Paris is the capital and largest city of France."
SAMPLED_LOGPROB = -0.25  # the scripted token's; the runners-up below it, one less per rank


@dataclass
class OutputDelta:
    """The fields of an engine output that a RequestGroup merges."""

    new_text: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, Logprob]]
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list | None = None


class ScriptedEngine:
    """An EngineClient whose model says what the test scripted."""

    def __init__(self, tokenizer, structured: StructuredOutputs, vocab_size: int, max_model_len: int = 2048,
                 reply: Callable[[list[int], SamplingParams], str] | None = None,
                 max_waiting_requests: int | None = None):
        eos = [tokenizer.eos_token_id]
        self.info = EngineInfo("scripted", max_model_len, vocab_size, SamplingParams(), tokenizer, eos, 64, 16)
        self.structured = structured
        self.reply = reply or (lambda prompt_ids, params: REPLY)
        self.max_waiting_requests = max_waiting_requests
        self.metrics = ServerMetrics(MODEL_NAME, max_model_len)
        self.num_aborted = 0
        self.paused = False  # requests wait (num_waiting) until it turns False
        self.fail_after: tuple[int, str] | None = None  # (tokens, error): a request fails after that many
        self.added: list[tuple[list[int], SamplingParams]] = []  # every engine request, as the server sent it
        self.aborted: list[str] = []
        self._waiting: set[str] = set()
        self._live: dict[str, asyncio.Task] = {}
        self._groups: set[RequestGroup] = set()
        self._started = self._stopped = False
        self._error: BaseException | None = None

    # ------------------------------------------------------------ EngineClient
    @property
    def healthy(self) -> bool:
        return self._started and not self._stopped and self._error is None

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def dead_message(self) -> str:
        return DEAD_AFTER_ERROR if self._error is not None else NOT_RUNNING

    def start(self) -> None:
        self._started, self._stopped = True, False

    async def add_requests(self, entries: Sequence[tuple[list[int], SamplingParams]],
                           arrival_time: float | None = None, prefix: str | None = None) -> RequestGroup:
        if not self.healthy:
            raise EngineDeadError(self.dead_message())
        limit = self.max_waiting_requests
        if limit is not None and self.num_waiting + len(entries) > limit:
            raise EngineOverloadedError(f"the server is overloaded: {self.num_waiting} requests are waiting "
                                        f"(--max-waiting-requests {limit}); retry later")
        prefix = prefix or uuid.uuid4().hex
        ids = [f"{prefix}-{i}" for i in range(len(entries))]
        group = RequestGroup(self, asyncio.get_running_loop(), ids)
        for index, (prompt, params) in enumerate(entries):
            error = self._check(index, prompt, params)
            if error is not None:
                group.accepted(index, error)
                break
            self.added.append((list(prompt), params))
            self._waiting.add(ids[index])
            self._live[ids[index]] = asyncio.ensure_future(self._generate(group, index, ids[index], prompt, params))
            group.accepted(index, None)
        self._groups.add(group)
        await group.wait_accepted()
        return group

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            task = self._live.pop(rid, None)
            if task is not None:
                task.cancel()
                self._waiting.discard(rid)
                self.aborted.append(rid)
                self.num_aborted += 1

    async def render_metrics(self) -> tuple[bytes, str]:
        if self._error is not None:  # as EngineProcess: the metrics live in the dead engine
            raise EngineDeadError(self.dead_message())
        return self.metrics.render()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopped = True

    def shutdown(self) -> None:
        pass

    # ------------------------------------------------------------ for the tests
    def kill(self) -> None:
        """The engine dies: every live request fails and /health turns 503."""
        self._error = RuntimeError("scripted death")
        for task in self._live.values():
            task.cancel()
        self._live.clear()
        self._waiting.clear()
        for group in self._groups:
            group.fail(EngineDeadError(self.dead_message()))

    @property
    def idle(self) -> bool:
        return not self._live

    def tokens(self, prompt: list[int], params: SamplingParams) -> list[int]:
        """The scripted tokens of a request, and so what the server must answer."""
        reply = self.info.tokenizer.encode(self.reply(list(prompt), params), add_special_tokens=False)
        if params.ignore_eos:
            return list(itertools.islice(itertools.cycle(reply), params.max_tokens))
        return reply[:params.max_tokens]

    # ------------------------------------------------------------ generation
    def _check(self, index: int, prompt: list[int], params: SamplingParams) -> RequestRejectedError | None:
        """The engine's own refusals (LLMEngine.add_request), with its messages."""
        vocab = self.info.vocab_size
        if len(prompt) >= self.info.max_model_len:
            return RequestRejectedError(index, f"the prompt has {len(prompt)} tokens, but at most "
                                               f"{self.info.max_model_len - 1} fit")
        for name in ("stop_token_ids", "allowed_token_ids", "logit_bias"):
            bad = [t for t in getattr(params, name) or () if not 0 <= t < vocab]
            if bad:
                return RequestRejectedError(index, f"{name}: token ids {bad[:5]} are outside the vocabulary "
                                                   f"[0, {vocab})")
        if params.structured_outputs is not None:
            try:
                self.structured.matcher(params.structured_outputs)
            except ValueError as exc:
                return RequestRejectedError(index, str(exc))
        return None

    def _logprobs(self, token: int, k: int | None) -> list[dict[int, Logprob]]:
        if k is None:
            return []
        decode = self.info.tokenizer.decode
        top = {token: Logprob(SAMPLED_LOGPROB, 1, decode([token]))}
        for rank, other in enumerate((t for t in itertools.count(token + 1) if t < self.info.vocab_size), 2):
            if rank > max(k, 1):
                break
            top[other] = Logprob(SAMPLED_LOGPROB - (rank - 1), rank, decode([other]))
        return [top]

    def _prompt_logprobs(self, prompt: list[int], k: int | None) -> list | None:
        if k is None:
            return None
        return [None] + [self._logprobs(t, k)[0] for t in prompt[1:]]

    async def _generate(self, group: RequestGroup, index: int, rid: str, prompt: list[int],
                        params: SamplingParams) -> None:
        while self.paused:
            await asyncio.sleep(0.005)
        self._waiting.discard(rid)
        tokens = self.tokens(prompt, params)
        finish = "length" if len(tokens) == params.max_tokens else "stop"
        prompt_lps = self._prompt_logprobs(prompt, params.prompt_logprobs)
        decode = self.info.tokenizer.decode
        text = ""
        for i, token in enumerate(tokens):
            await asyncio.sleep(0)  # one step: other requests' tokens interleave
            if self.fail_after is not None and i == self.fail_after[0]:
                group.deliver([(index, OutputDelta("", [], [], True, None, error=self.fail_after[1]))])
                break
            full = decode(tokens[:i + 1], skip_special_tokens=params.skip_special_tokens)
            new_text, text = full[len(text):], full
            last = i == len(tokens) - 1
            group.deliver([(index, OutputDelta(new_text, [token], self._logprobs(token, params.logprobs),
                                               last, finish if last else None,
                                               prompt_logprobs=prompt_lps if i == 0 else None))])
        else:
            if not tokens:
                group.deliver([(index, OutputDelta("", [], [], True, "stop", prompt_logprobs=prompt_lps))])
        self._live.pop(rid, None)


@asynccontextmanager
async def serve(engine: ScriptedEngine, **options) -> AsyncIterator[httpx.AsyncClient]:
    """`create_app(engine)` behind an httpx client, its lifespan run as a server would."""
    options.setdefault("served_model_name", [MODEL_NAME])
    app = create_app(engine, ServerOptions(**options))
    async with app.router.lifespan_context(app):
        # as uvicorn does: the 500 the app sends is the answer; its exception is only re-raised
        # for the server's log, not to the client
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://scripted", timeout=30) as http:
            http.ctx = app.state.ctx  # the ServingContext, for tests that reach behind the routes
            http.wait_idle = lambda timeout=10.0: engine.idle  # (as Served.wait_idle)
            yield http
