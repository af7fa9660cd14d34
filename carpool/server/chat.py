"""POST /v1/chat/completions: messages through the model's chat template, n choices.

With tools, each choice's text goes through a tool parser (carpool/tools): the parser the server
was started with for tool_choice "auto", the forced-call parser for "required" or a named
function, whose output is held to the call's JSON schema while it is decoded."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import replace

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from carpool.outputs import Logprob
from carpool.sampling_params import SamplingParams, StructuredOutputsParams
from carpool.server.async_engine import Delta
from carpool.server.protocol import APIError, ChatCompletionRequest, parse_request
from carpool.server.serving import Prepared, ServingContext, finite, prompt_logprobs_body, usage
from carpool.tools.forced import forced_output_parser, forced_schema
from carpool.tools.parsers import ToolCallDelta, ToolParser, get_tool_parser


AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


def prepare(ctx: ServingContext, body: bytes) -> Prepared:
    """On a prepare thread: parse, apply the chat template, check, build the choices."""
    req: ChatCompletionRequest = parse_request(ChatCompletionRequest, body)
    ctx.warn_unknown_fields(req)
    ctx.check_model(req.model)
    ctx.check_num_choices(1, req.n)
    ctx.check_logprobs(req.top_logprobs, "top_logprobs")
    ctx.check_logprobs(req.prompt_logprobs, "prompt_logprobs")
    tools = req.tool_dicts
    if tools and req.effective_tool_choice == "auto" and not ctx.options.enable_auto_tool_choice:
        raise APIError(AUTO_NEEDS_FLAGS, param="tool_choice")
    ids = ctx.apply_chat_template(req.messages, req.add_generation_prompt, tools, req.chat_template_kwargs)
    if not ids:
        raise APIError("messages: the conversation has no tokens", param="messages")
    if req.truncate_prompt_tokens:
        ids = ids[-req.truncate_prompt_tokens:]
    requested = req.requested_max_tokens
    ctx.check_length(len(ids), requested, "messages")
    max_tokens = requested if requested is not None else ctx.max_model_len - len(ids)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    entries = [(ids, forced_call(req, ctx.sampling_params(req, max_tokens, j, logprobs))) for j in range(req.n)]
    return Prepared(req, [(None, ids)], entries, request_id=f"chatcmpl-{uuid.uuid4().hex}")


def forced_call(req: ChatCompletionRequest, params: SamplingParams) -> SamplingParams:
    """tool_choice "required" or a named function: decode under the call's JSON schema."""
    choice = req.effective_tool_choice
    if choice in ("none", "auto") or not req.tools:
        return params
    if params.structured_outputs is not None:
        raise APIError(f"tool_choice: {choice!r} cannot be combined with another structured output",
                       param="tool_choice")
    schema = forced_schema(req.tool_dicts, choice, req.parallel_tool_calls)
    return replace(params, structured_outputs=StructuredOutputsParams(json=schema))


def tool_parser(ctx: ServingContext, req: ChatCompletionRequest) -> ToolParser | None:
    """A fresh parser for one choice's text, or None when the text is only content."""
    choice = req.effective_tool_choice
    if not req.tools or choice == "none":
        return None
    if choice == "auto":
        return get_tool_parser(ctx.options.tool_call_parser)()
    return forced_output_parser(choice)


def tool_calls_delta(calls: list[ToolCallDelta], parallel: bool) -> list[dict]:
    return [c.to_openai() for c in calls if parallel or c.index == 0]


def logprobs_content(name: Callable[[int], str], token_ids: list[int], entries: list[dict[int, Logprob]],
                     top: int) -> list[dict]:
    """`name`: a token's text as the request wants it (ServingContext.token_namer)."""
    content = []
    for t, d in zip(token_ids, entries):
        s = name(t)
        best = sorted(d.items(), key=lambda kv: -kv[1].logprob)[:top]
        content.append({"token": s, "logprob": finite(d[t].logprob), "bytes": list(s.encode()),
                        "top_logprobs": [{"token": name(k), "logprob": finite(v.logprob),
                                          "bytes": list(name(k).encode())} for k, v in best]})
    return content


async def create_chat_completion(ctx: ServingContext, raw: Request) -> Response:
    arrival = time.monotonic()
    p = await ctx.off_loop(prepare, await raw.body(), ctx)
    req: ChatCompletionRequest = p.req
    try:
        group = await ctx.submit(p, arrival, "messages", raw)
    except APIError as e:  # the engine compiles a forced call's schema: a bad one is the tools' fault
        if e.status != 400 or "structured_outputs" not in e.message or req.effective_tool_choice in ("none", "auto"):
            raise
        detail = e.message.split("structured_outputs.json", 1)[-1].lstrip(" :").removeprefix("is invalid: ")
        raise APIError(f"tools: the function parameters are not a JSON schema that can be enforced: {detail}",
                       param="tools") from None
    top = req.top_logprobs or 0
    name, role = ctx.token_namer(req), ctx.options.response_role
    # With echo, an assistant message at the end is continued: its text leads the answer.
    echo = req.messages[-1].text() if req.echo and req.messages[-1].role == "assistant" else ""
    created = int(time.time())

    if req.stream:
        base = {"id": p.request_id, "object": "chat.completion.chunk", "created": created, "model": ctx.model_name}
        extra = {"usage": None} if req.stream_options and req.stream_options.include_usage else {}
        first = [dict(base, choices=[{"index": i, "delta": {"role": role, "content": echo},
                                      "logprobs": None, "finish_reason": None}], **extra)
                 for i in range(len(group))]

        parsers = [tool_parser(ctx, req) for _ in range(len(group))]
        called = [False] * len(group)

        def chunk(i: int, d: Delta) -> dict | None:
            # One chunk per token, as vLLM sends: a token whose text is held (a partial character, a
            # possible stop string) still arrives, with empty content.
            delta: dict = {"content": d.text} if d.text or d.token_ids else {}
            parser = parsers[i]
            if parser is not None:  # text goes through the parser: content and call pieces
                parsed = parser.feed(d.text)
                if d.finished:
                    parsed.add(parser.finish())
                calls = tool_calls_delta(parsed.tool_calls, req.parallel_tool_calls)
                called[i] = called[i] or bool(calls)
                delta = ({"content": parsed.content} if parsed.content else {}) | (
                    {"tool_calls": calls} if calls else {})
            scored = ({"prompt_logprobs": prompt_logprobs_body(d.prompt_logprobs)}
                      if req.prompt_logprobs is not None and d.prompt_logprobs is not None else {})
            if not delta and not d.finished and not (req.logprobs and d.token_ids) and not scored:
                return None
            lp = {"content": logprobs_content(name, d.token_ids, d.logprobs, top)} if req.logprobs else None
            choice = {"index": i, "delta": delta, "logprobs": lp,
                      "finish_reason": finish_reason(d.finish_reason, called[i]) if d.finished else None,
                      "stop_reason": d.stop_reason if d.finished else None}
            return dict(base, choices=[choice], **extra, **scored)

        def usage_chunk(n: int, cached: dict[int, int]) -> dict:
            return dict(base, choices=[], usage=usage(p.prompt_tokens, n, p.cached_tokens(cached)))

        return ctx.stream(group, p.request_id, first, chunk, usage_chunk if extra else None)

    finals = await ctx.collect(group, raw, p.request_id)
    choices = []
    for i, c in enumerate(finals):
        message, called = {"role": role, "content": echo + c.text}, False
        parser = tool_parser(ctx, req)
        if parser is not None:
            parsed = parser.parse(c.text)
            calls = parsed.tool_calls if req.parallel_tool_calls else parsed.tool_calls[:1]
            if calls:
                called = True
                message = {"role": role, "content": (echo + (parsed.content or "")) or None,
                           "tool_calls": [call.to_openai() for call in calls]}
        choices.append({"index": i, "message": message,
                        "logprobs": {"content": logprobs_content(name, c.token_ids, c.logprobs, top)}
                        if req.logprobs else None,
                        "finish_reason": finish_reason(c.finish_reason, called), "stop_reason": c.stop_reason})
    return JSONResponse({"id": p.request_id, "object": "chat.completion", "created": created, "model": ctx.model_name,
                         "choices": choices,
                         **({"prompt_logprobs": prompt_logprobs_body(finals[0].prompt_logprobs)}
                            if req.prompt_logprobs is not None else {}),
                         "usage": usage(p.prompt_tokens, sum(len(c.token_ids) for c in finals),
                                        p.cached_tokens({i: c.num_cached_tokens for i, c in enumerate(finals)}))})


def finish_reason(reason: str | None, called: bool) -> str | None:
    """A choice that ended by itself after calling tools ends with "tool_calls", as OpenAI's do."""
    return "tool_calls" if called and reason == "stop" else reason
