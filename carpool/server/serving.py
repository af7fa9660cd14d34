"""What every generating endpoint shares: preparing a request off the event loop, submitting it
to the engine, and answering it -- streamed as server-sent events or collected into one body.

The endpoints (completions.py, chat.py) only say how their request becomes prompts and sampling
parameters, and how one choice's progress becomes a chunk or a final choice. Everything about
errors, usage, aborts and `[DONE]` lives here once.

Parsing, chat templates and tokenisation run on worker threads, never on the event loop: a
large body or a slow template must not hold up /health or other clients' streams. Bodies up to
SMALL_BODY_BYTES take one pool and larger ones another, so requests with megabytes of prompt
(seconds of tokenising each) never hold up a small one. The Rust tokenizer releases the GIL while
it encodes and the threads share it read-only (nothing here sets its truncation or padding).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from functools import lru_cache
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from carpool.outputs import Logprob
from carpool.sampling_params import SamplingParams, StructuredOutputsParams
from carpool.server.async_engine import Delta, RequestGroup
from carpool.server.engine_client import (
    EngineClient,
    EngineDeadError,
    EngineOverloadedError,
    RequestFailedError,
    RequestRejectedError,
)
from carpool.server.options import ServerOptions
from carpool.server.protocol import APIError, error_body
from carpool.structured.grammar import GrammarError
from carpool.sampler import NO_ALLOWED_TOKEN
from carpool.structured.masks import GRAMMAR_REFUSED
from carpool.tools.parsers import get_tool_parser
from carpool.tools.template import _variables, apply_chat_template, template_source

log = logging.getLogger("carpool.server")

RETRY_AFTER_SECONDS = 1
SMALL_BODY_BYTES = 64 << 10  # ~16k tokens of prompt: tens of milliseconds to tokenise
PREPARE_THREADS = 2  # per pool
# transformers' apply_chat_template parameters: a chat_template_kwargs key may not set these
TEMPLATE_ARGUMENTS = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                                "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                                "truncation", "max_length", "return_tensors", "return_dict",
                                "return_assistant_tokens_mask", "tokenizer_kwargs"})
DISCONNECT_POLL_SECONDS = 0.5
ENGINE_FAILED = "the engine failed while generating this request; see the server log (request id {})"


def generation_error(request_id: str, error: str) -> tuple[str, int, str | None, str]:
    """(message, status, param, code) for a request that failed while generating: its
    constraint refusing a token is the request's to fix (400); anything else is the engine's."""
    if error.startswith(GRAMMAR_REFUSED):
        message = f"{error.splitlines()[0]} (the constraint could not be followed)"
        return message, 400, "structured_outputs", "constraint_failed"
    if error.startswith(NO_ALLOWED_TOKEN):
        return error, 400, "structured_outputs", "constraint_failed"
    return ENGINE_FAILED.format(request_id), 500, None, "engine_error"


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens`: prompt tokens whose KV came from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def prompt_logprobs_body(entries: list[dict[int, Logprob] | None] | None) -> list | None:
    """vLLM's JSON for prompt logprobs: per prompt token None (the first) or
    {token id: {logprob, rank, decoded_token}}."""
    if entries is None:
        return None
    return [None if e is None else {str(t): {"logprob": finite(lp.logprob), "rank": lp.rank,
                                             "decoded_token": lp.decoded_token} for t, lp in e.items()}
            for e in entries]


class ClientDisconnected(Exception):
    pass


@dataclass
class Prepared:
    """A validated request, ready for the engine: its prompts (the text where one was given,
    and the ids) and one (prompt ids, params) entry per choice, prompt-major."""

    req: Any  # the parsed request model
    prompts: list[tuple[str | None, list[int]]]
    entries: list[tuple[list[int], SamplingParams]]
    request_id: str

    @property
    def prompt_tokens(self) -> int:
        return sum(len(ids) for _, ids in self.prompts)

    def prompt_of(self, choice: int) -> tuple[str | None, list[int]]:
        return self.prompts[choice // self.req.n]

    def cached_tokens(self, by_choice: dict[int, int]) -> int:
        """Prompt tokens found in the prefix cache, counted once per prompt (its first choice's),
        as `prompt_tokens` counts each prompt once."""
        return sum(by_choice.get(k * self.req.n, 0) for k in range(len(self.prompts)))


@dataclass
class Choice:
    """One choice's output, accumulated from its deltas (for a non-streaming answer)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    def add(self, d: Delta) -> None:
        self.num_cached_tokens = d.num_cached_tokens
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        self.text += d.text
        self.token_ids += d.token_ids
        self.logprobs += d.logprobs
        self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason


class AbortOnCloseStreamingResponse(StreamingResponse):
    """A streaming response that always runs `on_close` when it ends, however it ends:
    finished, client disconnected (Starlette cancels the stream), or server shutdown."""

    def __init__(self, content, on_close: Callable[[], None], **kwargs):
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class ServingContext:
    """The engine, tokenizer and limits every endpoint needs, and the shared request path."""

    def __init__(self, client: EngineClient, options: ServerOptions):
        self.options = options
        self.client = client
        info = client.info
        self.tokenizer = info.tokenizer  # the frontend's own (the engine detokenizes with another)
        self.structured = client.structured
        self.served_model_names = options.model_names(info.model)
        self.model_name = self.served_model_names[0]
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        # What a request leaves unset comes from the model's generation_config.json (as in vLLM).
        self.sampling_defaults = info.sampling_defaults
        self.created = int(time.time())
        self.token_str = lru_cache(maxsize=65536)(self._token_str)
        self._small_pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="carpool-prepare")
        self._large_pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix="carpool-prepare-large")
        # Generation requests let through by the overload guard (app.py) and not yet submitted:
        # they count against --max-waiting-requests as the engine's waiting requests do.
        self.admitting = 0
        self._warned_fields: set[str] = set()
        self.chat_template = options.chat_template_text()

    def close(self) -> None:
        for pool in (self._small_pool, self._large_pool):
            pool.shutdown(wait=False, cancel_futures=True)

    async def off_loop(self, fn: Callable, body: bytes, *args) -> Any:
        """`fn(*args, body)`: CPU work (parsing, templates, tokenisation) on a prepare thread of
        the pool for the body's size."""
        pool = self._small_pool if len(body) <= SMALL_BODY_BYTES else self._large_pool
        return await asyncio.get_running_loop().run_in_executor(pool, lambda: fn(*args, body))

    def overloaded(self) -> str | None:
        """Why a new generation request is refused (503), or None: the engine's waiting requests
        and those being prepared already reach --max-waiting-requests. Not while the engine is
        down: its queue no longer moves, and the handler says why it cannot serve (engine_dead)."""
        limit = self.options.max_waiting_requests
        waiting = self.client.num_waiting + self.admitting
        if limit is None or waiting < limit or not self.client.healthy:
            return None
        return f"the server is overloaded: {waiting} requests are waiting (--max-waiting-requests {limit}); retry later"

    # ------------------------------------------------------------ validation (prepare threads)
    def _token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_namer(self, req) -> Callable[[int], str]:
        """How a request's logprobs name tokens: their text, or "token_id:N" (vLLM's
        return_tokens_as_token_ids, for tokens whose text is not valid UTF-8 on its own)."""
        as_ids = req.return_tokens_as_token_ids
        if as_ids if as_ids is not None else self.options.return_tokens_as_token_ids:
            return lambda t: f"token_id:{t}"
        return self.token_str

    def check_logprobs(self, value: int | None, param: str) -> None:
        limit = self.options.max_logprobs
        if value is not None and value > limit:
            raise APIError(f"{param}: {value} asked for; this server allows at most {limit} (--max-logprobs)",
                           param=param)

    def warn_unknown_fields(self, req) -> None:
        """Fields nobody here knows are ignored (as vLLM does); say so once per field name."""
        new = [f for f in req.unknown_fields if f not in self._warned_fields]
        if new:
            self._warned_fields.update(new)
            log.warning("ignoring unknown request field(s): %s", ", ".join(new))

    def check_model(self, name: str | None) -> None:
        """An unknown model is a 404, as vLLM and OpenAI answer it (OpenAI's code)."""
        if name is not None and name not in self.served_model_names:
            raise APIError(f"The model `{name}` does not exist; this server serves "
                           f"{', '.join(repr(n) for n in self.served_model_names)}",
                           404, param="model", code="model_not_found")

    def check_token_ids(self, ids: list[int], param: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(f"{param}: token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})",
                           param=param)

    def check_num_choices(self, num_prompts: int, n: int) -> None:
        limit = self.options.max_choices_per_request
        if num_prompts * n > limit:
            raise APIError(f"n: {num_prompts} prompt(s) x n={n} asks for {num_prompts * n} choices; this server "
                           f"allows at most {limit} per request (--max-choices-per-request)", param="n")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def template_kwargs(self, request_kwargs: dict[str, Any] | None) -> dict[str, Any]:
        """--default-chat-template-kwargs, then the request's: only the variables the template
        reads, never one of apply_chat_template's own arguments (a request must not turn
        `tokenize` or `return_dict` into something the server does not expect), as vLLM filters them."""
        merged = {**(self.options.default_chat_template_kwargs or {}), **(request_kwargs or {})}
        if not merged:
            return {}
        known = _variables(template_source(self.tokenizer, self.chat_template))
        return {k: v for k, v in merged.items() if k in known and k not in TEMPLATE_ARGUMENTS}

    def apply_chat_template(self, messages, add_generation_prompt: bool, tools: list[dict] | None = None,
                            chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
        fmt = get_tool_parser(self.options.tool_call_parser or "hermes")
        kwargs = self.template_kwargs(chat_template_kwargs)
        try:
            return apply_chat_template(self.tokenizer, [m.to_template() for m in messages], tools=tools,
                                       chat_template=self.chat_template, add_generation_prompt=add_generation_prompt,
                                       tool_format=fmt, **({"chat_template_kwargs": kwargs} if kwargs else {}))
        except Exception as exc:  # the template itself may reject a conversation
            log.info("chat template rejected a conversation: %s", exc)
            raise APIError("messages: the model's chat template rejected this conversation "
                           "(check the order of roles)", param="messages") from None

    def check_length(self, num_prompt: int, max_tokens: int | None, param: str) -> None:
        limit = self.max_model_len
        if num_prompt >= limit:
            raise APIError(f"This model's maximum context length is {limit} tokens. However, your {param} has "
                           f"{num_prompt} tokens, which leaves no room for a completion.",
                           param=param, code="context_length_exceeded")
        if max_tokens is not None and num_prompt + max_tokens > limit:
            raise APIError(f"This model's maximum context length is {limit} tokens. However, you requested "
                           f"{num_prompt + max_tokens} tokens ({num_prompt} in the {param}, {max_tokens} for "
                           f"the completion). Reduce the length of the {param} or max_tokens.",
                           param="max_tokens", code="context_length_exceeded")

    def sampling_params(self, req, max_tokens: int, choice: int, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """One choice's parameters; `prompt_logprobs` defaults to the request's own field."""
        if req.min_tokens > max_tokens:
            raise APIError(f"min_tokens: {req.min_tokens} exceeds max_tokens {max_tokens}", param="min_tokens")
        d = self.sampling_defaults
        seed = None
        if req.seed is not None:  # choice j draws with seed + j, wrapped into the 64-bit range
            seed = (req.seed + choice + 2**63) % 2**64 - 2**63
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                temperature=d.temperature if req.temperature is None else req.temperature,
                top_p=d.top_p if req.top_p is None else req.top_p,
                top_k=d.top_k if req.top_k is None else (-1 if req.top_k == 0 else req.top_k),
                min_p=d.min_p if req.min_p is None else req.min_p,
                seed=seed,
                repetition_penalty=d.repetition_penalty if req.repetition_penalty is None else req.repetition_penalty,
                presence_penalty=0.0 if req.presence_penalty is None else req.presence_penalty,
                frequency_penalty=0.0 if req.frequency_penalty is None else req.frequency_penalty,
                stop=req.stop or [],
                stop_token_ids=req.stop_token_ids or [],
                include_stop_str_in_output=req.include_stop_str_in_output,
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                skip_special_tokens=req.skip_special_tokens,
                logit_bias=req.logit_bias_ids,
                allowed_token_ids=req.allowed_token_ids,
                bad_words=req.bad_words,
                truncate_prompt_tokens=req.truncate_prompt_tokens,
                prompt_logprobs=req.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
                output_kind="delta",
                structured_outputs=self.structured_outputs(req),
            )
        except ValueError as exc:
            raise APIError(str(exc), param=_field_of(str(exc))) from None

    def structured_outputs(self, req) -> StructuredOutputsParams | None:
        """The request's constraint, compiled here on a prepare thread: a bad schema is a 400
        naming the field it came in, and the engine thread later only copies the cached grammar."""
        if req.structured is None:
            return None
        params, param = req.structured
        try:
            self.structured.matcher(params)
        except GrammarError as exc:
            raise APIError(f"{param}: {exc.reason}", param=param) from None
        return params

    # ------------------------------------------------------------ submitting (event loop)
    async def submit(self, prepared: Prepared, arrival: float, param: str, raw: Request | None = None) -> RequestGroup:
        """Hand the request to the engine; from then on it counts as waiting there, no longer as
        admitted by the overload guard (app.py)."""
        try:
            return await self._submit(prepared, arrival, param)
        finally:
            release = raw.scope.get("state", {}).get("release_admission") if raw is not None else None
            if release is not None:
                release()

    async def _submit(self, prepared: Prepared, arrival: float, param: str) -> RequestGroup:
        if self.options.enable_log_requests:
            text = self.tokenizer.decode(prepared.entries[0][0]) if prepared.entries else ""
            log.info("request %s: %d choice(s), prompt %r", prepared.request_id, len(prepared.entries),
                     text[:self.options.max_log_len] if self.options.max_log_len is not None else text)
        try:
            return await self.client.add_requests(prepared.entries, arrival_time=arrival,
                                                        prefix=prepared.request_id)
        except EngineOverloadedError as exc:
            raise APIError(str(exc), 503, code="overloaded",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        except EngineDeadError as exc:
            raise APIError(str(exc), 503, code="engine_dead") from None
        except RequestRejectedError as exc:  # the engine names the field, or it is about the prompt
            field = _field_of(str(exc))
            raise APIError(str(exc) if field else f"{param}: {exc}", param=field or param) from None
        except RequestFailedError as exc:
            raise APIError(str(exc), 500, code="internal_error") from None

    async def collect(self, group: RequestGroup, raw: Request, request_id: str) -> list[Choice]:
        """Wait for every choice of the group to finish; abort them if the client leaves."""
        choices = [Choice() for _ in range(len(group))]

        async def drain():
            async for index, delta in group:
                if delta.error:
                    message, status, param, code = generation_error(request_id, delta.error)
                    raise APIError(message, status, param=param, code=code)
                choices[index].add(delta)

        task = asyncio.ensure_future(drain())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
                if done:
                    task.result()  # re-raises
                    return choices
                if await raw.is_disconnected():
                    raise ClientDisconnected()
        except EngineDeadError as exc:
            raise APIError(str(exc), 500, code="engine_dead") from None
        finally:
            if not task.done():
                task.cancel()
            group.abort()

    def stream(self, group: RequestGroup, request_id: str, first: list[dict],
               chunk: Callable[[int, Delta], dict | None],
               usage_chunk: Callable[[int, dict[int, int]], dict] | None) -> Response:
        """Server-sent events: the `first` chunks, then `chunk(index, delta)` for every delta
        (None: nothing to send yet), then `usage_chunk(completion tokens, cached prompt tokens
        by choice)` if given (include_usage), then `[DONE]`. The `first` chunks go out with the
        first output, not when the request is accepted: clients time the first token by the first
        event, as they do on vLLM. An engine failure becomes an error event; the group is aborted
        whenever the stream ends, however it ends."""

        async def events() -> AsyncIterator[str]:
            completion_tokens, cached = 0, {}
            pending = list(first)
            try:
                async for index, delta in group:
                    for obj in pending:
                        yield sse(obj)
                    pending = []
                    if delta.error:
                        yield sse(error_body(*generation_error(request_id, delta.error)))
                        break
                    completion_tokens += len(delta.token_ids)
                    cached[index] = delta.num_cached_tokens
                    obj = chunk(index, delta)
                    if obj is not None:
                        yield sse(obj)
                else:
                    if usage_chunk is not None:
                        yield sse(usage_chunk(completion_tokens, cached))
            except EngineDeadError as exc:
                yield sse(error_body(str(exc), 500, code="engine_dead"))
            yield "data: [DONE]\n\n"

        return AbortOnCloseStreamingResponse(events(), on_close=group.abort, media_type="text/event-stream",
                                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _field_of(message: str) -> str | None:
    """SamplingParams and the engine name the field first: 'stop_token_ids must ...'."""
    head = message.split(" ", 1)[0].rstrip(":")
    return head if head in SAMPLING_FIELDS else None


SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))
