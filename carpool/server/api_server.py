"""OpenAI-compatible HTTP API over LLMEngine (FastAPI + uvicorn).

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
POST /tokenize, POST /detokenize, GET /metrics.

Request flow: parse and validate the body (protocol.py; 400 naming the field), tokenize on the
event loop with the server's own copy of the tokenizer, check the context, build one
SamplingParams per choice, hand the engine requests to the engine thread (async_engine.py),
then either stream the outputs as server-sent events or collect them into one response. A
client that goes away mid-request has its engine requests aborted, which frees their KV blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import hmac
import json
import logging
import math
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from carpool.engine import LLMEngine
from carpool.outputs import RequestOutput
from carpool.sampling_params import SamplingParams
from carpool.server.async_engine import (AsyncLLMEngine, EngineDeadError, EngineOverloadedError,
                                         RequestGroup, RequestRejectedError)
from carpool.server.metrics import ServerMetrics
from carpool.server.protocol import (APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                     TokenizeRequest, error_body, parse_request)

log = logging.getLogger("carpool.server")

DEFAULT_COMPLETION_MAX_TOKENS = 16  # as in OpenAI's legacy completions API
RETRY_AFTER_SECONDS = 1
DISCONNECT_POLL_SECONDS = 0.5


def default_model_name(model_path: str | None, config_model: str) -> str:
    """vLLM reports --model as given; the embedded GGUF is reported by its file name."""
    if model_path:
        return model_path
    return Path(config_model).name.removesuffix(".gguf")


def _json(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def _sse(obj: Any) -> str:
    return f"data: {_json(obj)}\n\n"


def _finite(x: float) -> float:
    return x if math.isfinite(x) else -9999.0


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


class ApiKeyMiddleware:
    """Pure ASGI (streams and disconnects pass straight through): Bearer key on API routes."""

    PROTECTED = ("/v1/", "/tokenize", "/detokenize")

    def __init__(self, app, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"].startswith(self.PROTECTED):
            auth = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(auth, self.expected):
                response = JSONResponse(error_body("invalid or missing API key (send 'Authorization: Bearer KEY')",
                                                   401), status_code=401,
                                        headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class OpenAIServer:
    """The request handlers, bound to one engine."""

    def __init__(self, engine: LLMEngine, served_model_names: list[str], max_waiting_requests: int | None):
        self.engine = engine
        self.served_model_names = served_model_names
        self.model_name = served_model_names[0]
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        # The engine thread detokenizes with engine.tokenizer; the event loop gets its own copy
        # so that the two threads never share one Rust tokenizer object.
        try:
            self.tokenizer = copy.deepcopy(engine.tokenizer)
        except Exception:  # pragma: no cover - tokenizers that cannot be copied
            self.tokenizer = engine.tokenizer
        self.metrics = ServerMetrics(self.model_name, self.max_model_len)
        self.async_engine = AsyncLLMEngine(engine, max_waiting_requests, observer=self.metrics)
        self.created = int(time.time())
        self.token_str = lru_cache(maxsize=65536)(self._token_str)

    # ------------------------------------------------------------ helpers
    def _token_str(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.served_model_names:
            raise APIError(f"The model `{name}` does not exist; this server serves "
                           f"{', '.join(repr(n) for n in self.served_model_names)}",
                           param="model", code="model_not_found")

    def check_token_ids(self, ids: list[int], param: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(f"{param}: token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})",
                           param=param)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def apply_chat_template(self, messages, add_generation_prompt: bool) -> list[int]:
        conversation = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()}
                        for m in messages]
        try:
            ids = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                     tokenize=True)
        except Exception as exc:  # the template itself may reject a conversation
            raise APIError(f"messages: the chat template failed: {exc}", param="messages") from None
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

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

    @staticmethod
    def sampling_params(req, max_tokens: int, choice: int, logprobs: int | None) -> SamplingParams:
        if req.min_tokens > max_tokens:
            raise APIError(f"min_tokens: {req.min_tokens} exceeds max_tokens {max_tokens}", param="min_tokens")
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=-1 if req.top_k in (None, 0) else req.top_k,
                min_p=0.0 if req.min_p is None else req.min_p,
                seed=None if req.seed is None else req.seed + choice,
                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                presence_penalty=0.0 if req.presence_penalty is None else req.presence_penalty,
                frequency_penalty=0.0 if req.frequency_penalty is None else req.frequency_penalty,
                stop=req.stop or [],
                stop_token_ids=req.stop_token_ids or [],
                include_stop_str_in_output=req.include_stop_str_in_output,
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                skip_special_tokens=req.skip_special_tokens,
            )
        except ValueError as exc:
            field = str(exc).split(" ", 1)[0]
            raise APIError(str(exc), param=field if field.replace("_", "").isalpha() else None) from None

    async def submit(self, entries: list[tuple[list[int], SamplingParams]], arrival: float, prefix: str,
                     param: str) -> RequestGroup:
        try:
            return await self.async_engine.add_requests(entries, arrival_time=arrival, prefix=prefix)
        except EngineOverloadedError as exc:
            raise APIError(str(exc), 503, code="overloaded",
                           headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        except EngineDeadError as exc:
            raise APIError(str(exc), 503, code="engine_dead") from None
        except RequestRejectedError as exc:
            raise APIError(f"{param}: {exc}", param=param) from None

    @staticmethod
    def engine_error(out: RequestOutput) -> APIError:
        return APIError(f"the engine failed this request: {out.error}", 500, code="engine_error")

    async def collect(self, group: RequestGroup, raw: Request) -> list[RequestOutput]:
        """Wait for every request of the group to finish; abort them if the client leaves."""
        finals: list[RequestOutput | None] = [None] * len(group)

        async def drain():
            async for index, out in group:
                if out.error:
                    raise self.engine_error(out)
                if out.finished:
                    finals[index] = out

        task = asyncio.ensure_future(drain())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_SECONDS)
                if done:
                    task.result()  # re-raises
                    return finals  # type: ignore[return-value]
                if await raw.is_disconnected():
                    raise ClientDisconnected()
        except EngineDeadError as exc:
            raise APIError(str(exc), 500, code="engine_dead") from None
        finally:
            if not task.done():
                task.cancel()
            group.abort()

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    # ------------------------------------------------------------ logprobs
    def completion_logprobs(self, token_ids: list[int], entries: list[dict[int, float]] | None,
                            text_offset: int) -> dict[str, list]:
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for i, t in enumerate(token_ids):
            s = self.token_str(t)
            out["tokens"].append(s)
            out["text_offset"].append(text_offset)
            text_offset += len(s)
            d = entries[i] if entries is not None and i < len(entries) else None
            if d is None:  # prompt tokens under echo: the engine computes no prompt logprobs
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
            else:
                out["token_logprobs"].append(_finite(d[t]))
                out["top_logprobs"].append({self.token_str(k): _finite(v) for k, v in d.items()})
        return out

    def chat_logprobs(self, token_ids: list[int], entries: list[dict[int, float]], top: int) -> list[dict]:
        content = []
        for t, d in zip(token_ids, entries):
            s = self.token_str(t)
            best = sorted(d.items(), key=lambda kv: -kv[1])[:top]
            content.append({"token": s, "logprob": _finite(d[t]), "bytes": list(s.encode()),
                            "top_logprobs": [{"token": self.token_str(k), "logprob": _finite(v),
                                              "bytes": list(self.token_str(k).encode())} for k, v in best]})
        return content

    # ------------------------------------------------------------ /v1/completions
    async def completions(self, raw: Request) -> Response:
        arrival = time.monotonic()
        req: CompletionRequest = parse_request(CompletionRequest, await raw.body())
        self.check_model(req.model)
        max_tokens = req.max_tokens if req.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
        prompts: list[tuple[str | None, list[int]]] = []
        for p in req.prompts():
            if isinstance(p, str):
                ids = self.encode(p)
            else:
                self.check_token_ids(p, "prompt")
                ids = p
            if not ids:
                raise APIError("prompt: the prompt has no tokens", param="prompt")
            self.check_length(len(ids), max_tokens, "prompt")
            prompts.append((p if isinstance(p, str) else None, ids))
        entries, choice_prompt = [], []
        for pi, (_, ids) in enumerate(prompts):
            for j in range(req.n):
                entries.append((ids, self.sampling_params(req, max_tokens, j, req.logprobs)))
                choice_prompt.append(pi)
        rid = f"cmpl-{uuid.uuid4().hex}"
        group = await self.submit(entries, arrival, rid, "prompt")
        prompt_tokens = sum(len(ids) for _, ids in prompts)

        def echo_prefix(i: int) -> tuple[str, list[int]]:
            text, ids = prompts[choice_prompt[i]]
            return (text if text is not None else self.tokenizer.decode(ids)), ids

        base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.model_name}
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return self.stream_response(
                self.completion_stream(group, req, base, echo_prefix, prompt_tokens, include_usage), group)

        finals = await self.collect(group, raw)
        choices = []
        for i, out in enumerate(finals):
            text, logprobs = out.text, None
            if req.echo:
                ptext, pids = echo_prefix(i)
                text = ptext + text
            if req.logprobs is not None:
                if req.echo:
                    lp_ids, lp_entries = pids + out.token_ids, [None] * len(pids) + list(out.logprobs or [])
                else:
                    lp_ids, lp_entries = out.token_ids, list(out.logprobs or [])
                logprobs = self.completion_logprobs(lp_ids, lp_entries, 0)
            choices.append({"index": i, "text": text, "logprobs": logprobs, "finish_reason": out.finish_reason,
                            "stop_reason": out.stop_reason})
        body = dict(base, choices=choices,
                    usage=self.usage(prompt_tokens, sum(len(o.token_ids) for o in finals)))
        return JSONResponse(body)

    async def completion_stream(self, group: RequestGroup, req: CompletionRequest, base: dict,
                                echo_prefix, prompt_tokens: int, include_usage: bool) -> AsyncIterator[str]:
        n = len(group)
        started = [False] * n
        offsets = [0] * n
        completion_tokens = [0] * n
        try:
            async for i, out in group:
                if out.error:
                    yield _sse(self.engine_error(out).body())
                    break
                text, ids, entries = out.new_text, out.new_token_ids, out.new_logprobs
                if req.echo and not started[i]:
                    ptext, pids = echo_prefix(i)
                    text = ptext + text
                    ids, entries = pids + ids, [None] * len(pids) + list(entries)
                started[i] = True
                completion_tokens[i] = len(out.token_ids)
                want_lp = req.logprobs is not None
                if not text and not out.finished and not (want_lp and ids):
                    continue
                logprobs = None
                if want_lp:
                    logprobs = self.completion_logprobs(ids, entries, offsets[i])
                offsets[i] += len(text)
                choice = {"index": i, "text": text, "logprobs": logprobs,
                          "finish_reason": out.finish_reason if out.finished else None,
                          "stop_reason": out.stop_reason if out.finished else None}
                yield _sse(dict(base, choices=[choice], **({"usage": None} if include_usage else {})))
            else:
                if include_usage:
                    yield _sse(dict(base, choices=[], usage=self.usage(prompt_tokens, sum(completion_tokens))))
        except EngineDeadError as exc:
            yield _sse(error_body(str(exc), 500, code="engine_dead"))
        yield "data: [DONE]\n\n"

    # ------------------------------------------------------------ /v1/chat/completions
    async def chat_completions(self, raw: Request) -> Response:
        arrival = time.monotonic()
        req: ChatCompletionRequest = parse_request(ChatCompletionRequest, await raw.body())
        self.check_model(req.model)
        ids = self.apply_chat_template(req.messages, req.add_generation_prompt)
        if not ids:
            raise APIError("messages: the conversation has no tokens", param="messages")
        requested = req.requested_max_tokens
        self.check_length(len(ids), requested, "messages")
        max_tokens = requested if requested is not None else self.max_model_len - len(ids)
        top = req.top_logprobs or 0
        logprobs = top if req.logprobs else None
        entries = [(ids, self.sampling_params(req, max_tokens, j, logprobs)) for j in range(req.n)]
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        group = await self.submit(entries, arrival, rid, "messages")
        echo = ""
        if req.echo and req.messages[-1].role == "assistant":
            echo = req.messages[-1].text()
        base = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": self.model_name}
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            base["object"] = "chat.completion.chunk"
            return self.stream_response(
                self.chat_stream(group, req, base, echo, len(ids), include_usage, top), group)

        finals = await self.collect(group, raw)
        choices = []
        for i, out in enumerate(finals):
            lp = {"content": self.chat_logprobs(out.token_ids, out.logprobs or [], top)} if req.logprobs else None
            choices.append({"index": i, "message": {"role": "assistant", "content": echo + out.text},
                            "logprobs": lp, "finish_reason": out.finish_reason, "stop_reason": out.stop_reason})
        body = dict(base, choices=choices, usage=self.usage(len(ids), sum(len(o.token_ids) for o in finals)))
        return JSONResponse(body)

    async def chat_stream(self, group: RequestGroup, req: ChatCompletionRequest, base: dict, echo: str,
                          prompt_tokens: int, include_usage: bool, top: int) -> AsyncIterator[str]:
        n = len(group)
        completion_tokens = [0] * n
        extra = {"usage": None} if include_usage else {}
        try:
            for i in range(n):
                first = {"index": i, "delta": {"role": "assistant", "content": echo}, "logprobs": None,
                         "finish_reason": None}
                yield _sse(dict(base, choices=[first], **extra))
            async for i, out in group:
                if out.error:
                    yield _sse(self.engine_error(out).body())
                    break
                completion_tokens[i] = len(out.token_ids)
                if not out.new_text and not out.finished and not (req.logprobs and out.new_token_ids):
                    continue
                lp = None
                if req.logprobs:
                    lp = {"content": self.chat_logprobs(out.new_token_ids, out.new_logprobs, top)}
                choice = {"index": i, "delta": {"content": out.new_text} if out.new_text else {},
                          "logprobs": lp, "finish_reason": out.finish_reason if out.finished else None,
                          "stop_reason": out.stop_reason if out.finished else None}
                yield _sse(dict(base, choices=[choice], **extra))
            else:
                if include_usage:
                    yield _sse(dict(base, choices=[], usage=self.usage(prompt_tokens, sum(completion_tokens))))
        except EngineDeadError as exc:
            yield _sse(error_body(str(exc), 500, code="engine_dead"))
        yield "data: [DONE]\n\n"

    @staticmethod
    def stream_response(gen: AsyncIterator[str], group: RequestGroup) -> Response:
        return AbortOnCloseStreamingResponse(gen, on_close=group.abort, media_type="text/event-stream",
                                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ------------------------------------------------------------ small endpoints
    def models(self) -> dict:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": self.created, "owned_by": "carpool",
             "root": self.engine.config.model, "parent": None, "max_model_len": self.max_model_len}
            for name in self.served_model_names]}

    async def tokenize(self, raw: Request) -> dict:
        req: TokenizeRequest = parse_request(TokenizeRequest, await raw.body())
        self.check_model(req.model)
        if req.messages is not None:
            ids = self.apply_chat_template(req.messages, req.add_generation_prompt)
        else:
            ids = self.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}

    async def detokenize(self, raw: Request) -> dict:
        req: DetokenizeRequest = parse_request(DetokenizeRequest, await raw.body())
        self.check_model(req.model)
        self.check_token_ids(req.tokens, "tokens")
        return {"prompt": self.tokenizer.decode(req.tokens)}


class ClientDisconnected(Exception):
    pass


def create_app(engine: LLMEngine, served_model_name: str | list[str] | None = None, api_key: str | None = None,
               max_waiting_requests: int | None = None) -> FastAPI:
    """The ASGI app. Its lifespan starts the engine thread and stops it on shutdown; the
    handlers live on `app.state.server` (an OpenAIServer) for tests and embedding."""
    if served_model_name is None:
        names = [default_model_name(None, engine.config.model)]
    elif isinstance(served_model_name, str):
        names = [served_model_name]
    else:
        names = list(served_model_name)
    server = OpenAIServer(engine, names, max_waiting_requests)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        server.async_engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(server.async_engine.stop)

    app = FastAPI(title="carpool", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = server
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail), exc.status_code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected):
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.exception("unhandled error in %s", request.url.path)
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", 500), status_code=500)

    @app.get("/health")
    async def health():
        if server.async_engine.healthy:
            return Response(status_code=200)
        return JSONResponse(error_body(server.async_engine._dead_message(), 503), status_code=503)

    @app.get("/v1/models")
    async def models():
        return server.models()

    @app.post("/v1/completions")
    async def completions(raw: Request):
        return await server.completions(raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        return await server.chat_completions(raw)

    @app.post("/tokenize")
    async def tokenize(raw: Request):
        return await server.tokenize(raw)

    @app.post("/detokenize")
    async def detokenize(raw: Request):
        return await server.detokenize(raw)

    @app.get("/metrics")
    async def metrics():
        body, content_type = server.metrics.render()
        return Response(body, media_type=content_type)

    return app


# ---------------------------------------------------------------- process entry point
def run_server(args: argparse.Namespace) -> int:
    """Load the engine, serve until SIGTERM/SIGINT, drain in-flight requests, return 0."""
    import uvicorn

    from carpool.cli import engine_config

    engine = LLMEngine(engine_config(args))
    names = args.served_model_name or [default_model_name(args.model, engine.config.model)]
    app = create_app(engine, names, api_key=args.api_key, max_waiting_requests=args.max_waiting_requests)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level,
                            access_log=not args.disable_uvicorn_access_log, lifespan="on",
                            timeout_graceful_shutdown=args.shutdown_timeout)
    server = uvicorn.Server(config)
    print(f"carpool: serving {names[0]!r} on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    # uvicorn re-raises the signal that stopped it once it has shut down, which with the default
    # handlers would end the process by signal (SIGTERM) or KeyboardInterrupt (SIGINT). A graceful
    # stop is a normal exit here, so let the re-raised signal land on a no-op.
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0 if server.started else 1


def main(argv: list[str] | None = None) -> int:
    from carpool.cli import add_engine_args
    from carpool.server import add_server_args

    parser = argparse.ArgumentParser(prog="python -m carpool.server.api_server",
                                     description="OpenAI-compatible server (same as `carpool serve`)")
    parser.add_argument("model_tag", nargs="?", default=None, help="model (same as --model)")
    add_engine_args(parser)
    add_server_args(parser)
    args = parser.parse_args(argv)
    if args.model_tag:
        args.model = args.model_tag
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    return run_server(args)


if __name__ == "__main__":
    sys.exit(main())
