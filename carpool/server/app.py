"""The ASGI app: routes, the guards in front of them, error bodies, and the engine's lifespan.

Guards, outermost first: the API key (401), then `RequestGuard`: a POST must say
`Content-Type: application/json` (415; a cross-site HTML form cannot send that without a CORS
preflight) and its body must fit `max_request_body_bytes` (413, counted while it arrives, before
anything parses it). Errors never carry exception text or local paths: a 500 says where to look
(the server log, under an error id) and the log has the details.

The request bodies are parsed by carpool's own models (protocol.py) so that errors come back in
OpenAI's shape; the OpenAPI schema at /openapi.json publishes those same models, so a schema
fuzzer (tests/server/test_server_fuzz.py) generates what the server really accepts.
"""

from __future__ import annotations

import asyncio
import hmac
import importlib.metadata
import logging
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException

from carpool.server import chat, completions
from carpool.server.engine_client import EngineClient, EngineDeadError
from carpool.server.options import ServerOptions
from carpool.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ErrorResponse,
    TokenizeRequest,
    error_body,
    parse_request,
)
from carpool.tokenizer_export import tokenizer_config
from carpool.server.serving import RETRY_AFTER_SECONDS, ClientDisconnected, ServingContext

log = logging.getLogger("carpool.server")

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
BODY_MODELS = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
               "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}


def route_path(scope) -> str:
    """The path the routes see: behind --root-path a proxy may pass "/api/v1/models" on
    unchanged, and the guards must protect it as "/v1/models" (as Starlette's routing matches it)."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("/", ""):
        return path[len(root):]
    return path


async def _send_error(scope, receive, send, status: int, message: str,
                      headers: dict[str, str] | None = None, code: str | None = None) -> None:
    await JSONResponse(error_body(message, status, code=code), status_code=status, headers=headers)(
        scope, receive, send)


class OverloadGuard:
    """--max-waiting-requests, checked before the body is read: a full queue answers 503 at once
    instead of after receiving, parsing and tokenising a request it cannot take. A request let
    through counts as waiting (`ctx.admitting`) until the handler has submitted it
    (`scope["state"]["release_admission"]`, called by ServingContext.submit) or has ended."""

    def __init__(self, app, ctx: ServingContext, paths: frozenset[str]):
        self.app = app
        self.ctx = ctx
        self.paths = paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or route_path(scope) not in self.paths:
            await self.app(scope, receive, send)
            return
        reason = self.ctx.overloaded()
        if reason is not None:
            await _send_error(scope, receive, send, 503, reason, {"Retry-After": str(RETRY_AFTER_SECONDS)},
                              code="overloaded")
            return
        held = True
        self.ctx.admitting += 1

        def release() -> None:
            nonlocal held
            if held:
                held = False
                self.ctx.admitting -= 1

        scope.setdefault("state", {})["release_admission"] = release
        try:
            await self.app(scope, receive, send)
        finally:
            release()


class ApiKeyMiddleware:
    """Pure ASGI (streams and disconnects pass straight through): Bearer key on API routes."""

    PROTECTED = ("/v1/", "/tokenize", "/detokenize", "/tokenizer_info")

    def __init__(self, app, api_key: str | list[str]):
        self.app = app
        self.expected = [k.encode() for k in ([api_key] if isinstance(api_key, str) else api_key)]

    def authorized(self, auth: bytes) -> bool:
        """`Bearer KEY`, KEY any of the keys; the scheme's name is case-insensitive (RFC 7235),
        the key is not. Every key is compared, in constant time each."""
        scheme, _, key = auth.partition(b" ")
        matches = [hmac.compare_digest(key, expected) for expected in self.expected]
        return any(matches) and scheme.lower() == b"bearer"

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and route_path(scope).startswith(self.PROTECTED):
            if not self.authorized(dict(scope["headers"]).get(b"authorization", b"")):
                await _send_error(scope, receive, send, 401,
                                  "invalid or missing API key (send 'Authorization: Bearer KEY')",
                                  {"WWW-Authenticate": "Bearer"})
                return
        await self.app(scope, receive, send)


class RequestGuard:
    """POST bodies of the API routes: JSON only (415), and at most `max_body` bytes (413). The body is read here,
    chunk by chunk, and replayed to the app; later `receive` calls (disconnect detection) go
    straight to the server."""

    def __init__(self, app, max_body: int, paths: frozenset[str]):
        self.app = app
        self.max_body = max_body
        self.paths = paths

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or route_path(scope) not in self.paths:
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        media_type = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if media_type != b"application/json":
            await _send_error(scope, receive, send, 415, "Content-Type must be application/json")
            return
        too_large = f"the request body is larger than {self.max_body} bytes"
        try:
            declared = int(headers.get(b"content-length", b"0"))
        except ValueError:
            declared = 0
        if declared > self.max_body:
            await _send_error(scope, receive, send, 413, too_large)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                await _send_error(scope, receive, send, 413, too_large)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def _openapi(app: FastAPI) -> dict:
    """FastAPI's schema plus carpool's request models, referenced from each POST route."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        _, defs = models_json_schema([(m, "validation") for m in BODY_MODELS.values()],
                                     ref_template="#/components/schemas/{model}")
        schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
        app.openapi_schema = schema
    return app.openapi_schema


ERRORS = {
    400: "an invalid request; `param` names the field",
    401: "a missing or wrong API key (--api-key)",
    404: "a model this server does not serve (code model_not_found)",
    413: "a body larger than --max-request-body-bytes",
    415: "a body that is not application/json",
    500: "a server fault; the message gives an error id to look up in the server log",
    503: "overloaded (code overloaded, with Retry-After; --max-waiting-requests) or the engine is not "
         "running (code engine_dead)",
}


NOT_RUNNING_503 = {503: "the engine is not running (code engine_dead)"}


def _errors(*statuses: int, descriptions: dict[int, str] | None = None) -> dict:
    """OpenAPI `responses` for these error statuses, each with the error body's schema."""
    described = {**ERRORS, **(descriptions or {})}
    return {s: {"model": ErrorResponse, "description": described[s]} for s in statuses}


def _body(model) -> dict:
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def create_app(client: EngineClient, options: ServerOptions | None = None) -> FastAPI:
    """The ASGI app over `client`: `AsyncLLMEngine.for_server(engine, options)` for an engine
    of this process (embedding, tests), `EngineProcess` for `carpool serve` (server/launch.py
    starts it). The lifespan starts the client and, at its end, stops it and releases the engine."""
    options = options or ServerOptions()
    ctx = ServingContext(client, options)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client.start()
        try:
            yield
        finally:
            await asyncio.to_thread(client.stop)
            ctx.close()
            await asyncio.to_thread(client.shutdown)

    # No /docs or /redoc page (they load their scripts from a CDN); the schema at /openapi.json
    # unless --disable-fastapi-docs.
    app = FastAPI(title="carpool", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None if options.disable_fastapi_docs else "/openapi.json")
    app.root_path = options.root_path  # set on every request's scope, so any server (or test transport) gets it
    app.openapi = lambda: _openapi(app)
    app.state.ctx = ctx
    app.add_middleware(RequestGuard, max_body=options.max_request_body_bytes, paths=frozenset(BODY_MODELS))
    app.add_middleware(OverloadGuard, ctx=ctx, paths=GENERATION_PATHS)
    if options.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=options.api_key)
    if options.allowed_origins:  # outermost, so that preflights and errors carry the CORS headers
        app.add_middleware(CORSMiddleware, allow_origins=options.allowed_origins,
                           allow_credentials=options.allow_credentials,
                           allow_methods=options.allowed_methods or ["*"],
                           allow_headers=options.allowed_headers or ["*"])

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
        error_id = uuid.uuid4().hex[:12]
        log.exception("unhandled error %s in %s", error_id, request.url.path)
        return JSONResponse(error_body(f"internal server error; see the server log (error id {error_id})", 500),
                            status_code=500)

    key = (401,) if options.api_key else ()  # the API key guards /v1/*, /tokenize, /detokenize
    generating = {**_errors(400, *key, 404, 413, 415, 500, 503),
                  200: {"description": "the response, or server-sent events with stream=true",
                        "content": {"application/json": {}, "text/event-stream": {}}}}
    health_responses = {**_errors(503, descriptions=NOT_RUNNING_503), 200: {"description": "the engine is serving", "content": {
        "application/json": {"schema": {"type": "object", "required": ["status"],
                                        "properties": {"status": {"type": "string", "enum": ["ok"]}}}}}}}

    @app.get("/health", responses=health_responses)
    async def health():
        if client.healthy:
            return {"status": "ok"}
        return JSONResponse(error_body(client.dead_message(), 503), status_code=503)

    @app.get("/version")
    async def version():
        return {"version": importlib.metadata.version("carpool")}

    @app.get("/ping", responses=health_responses)
    async def ping():  # SageMaker's and vLLM's liveness probe: /health's answer
        return await health()

    @app.post("/ping", responses=health_responses)
    async def ping_post():
        return await health()

    @app.get("/v1/models", responses=_errors(*key))
    async def models():
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": ctx.created, "owned_by": "carpool", "root": name,
             "parent": None, "max_model_len": ctx.max_model_len} for name in ctx.served_model_names]}

    @app.post("/v1/completions", openapi_extra=_body(CompletionRequest), responses=generating)
    async def create_completion(raw: Request):
        return await completions.create_completion(ctx, raw)

    @app.post("/v1/chat/completions", openapi_extra=_body(ChatCompletionRequest), responses=generating)
    async def create_chat_completion(raw: Request):
        return await chat.create_chat_completion(ctx, raw)

    def _tokenize(body: bytes) -> dict:
        req: TokenizeRequest = parse_request(TokenizeRequest, body)
        ctx.check_model(req.model)
        if req.messages is not None:
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            ids = ctx.apply_chat_template(req.messages, req.add_generation_prompt, tools, req.chat_template_kwargs)
        else:
            ids = ctx.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids}

    def _detokenize(body: bytes) -> dict:
        req: DetokenizeRequest = parse_request(DetokenizeRequest, body)
        ctx.check_model(req.model)
        ctx.check_token_ids(req.tokens, "tokens")
        return {"prompt": ctx.tokenizer.decode(req.tokens)}

    @app.post("/tokenize", openapi_extra=_body(TokenizeRequest), responses=_errors(400, *key, 404, 413, 415, 500))
    async def tokenize(raw: Request):
        return await ctx.off_loop(_tokenize, await raw.body())

    @app.post("/detokenize", openapi_extra=_body(DetokenizeRequest), responses=_errors(400, *key, 404, 413, 415, 500))
    async def detokenize(raw: Request):
        return await ctx.off_loop(_detokenize, await raw.body())

    if options.enable_tokenizer_info_endpoint:  # off by default: it shows the chat template
        tokenizer_info_cache: list[dict] = []

        @app.get("/tokenizer_info", responses=_errors(*key))
        async def tokenizer_info():
            """The tokenizer's tokenizer_config.json (as `carpool export-tokenizer` writes it),
            with its class, the chat template and the context served, as vLLM answers it."""
            if not tokenizer_info_cache:
                tokenizer_info_cache.append(await asyncio.to_thread(
                    tokenizer_config, ctx.tokenizer, ctx.max_model_len, ctx.chat_template))
            return tokenizer_info_cache[0]

    @app.get("/metrics", response_class=PlainTextResponse, responses={
        **_errors(503, descriptions=NOT_RUNNING_503), 200: {"description": "the Prometheus exposition"}})
    async def metrics():
        """The engine's exposition; 503 (a failed scrape) while the engine cannot answer."""
        try:
            body, content_type = await client.render_metrics()
        except EngineDeadError as exc:
            return JSONResponse(error_body(str(exc), 503, code="engine_dead"), status_code=503)
        except TimeoutError:
            return JSONResponse(error_body("the engine did not answer in time", 503), status_code=503)
        return Response(body, media_type=content_type)

    return app
