"""POST /v1/chat/completions: messages through the model's chat template, n choices."""

from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from carpool.outputs import Logprob
from carpool.server.async_engine import Delta
from carpool.server.protocol import APIError, ChatCompletionRequest, parse_request
from carpool.server.serving import Prepared, ServingContext, finite, usage


def prepare(ctx: ServingContext, body: bytes) -> Prepared:
    """On the prepare thread: parse, apply the chat template, check, build the choices."""
    req: ChatCompletionRequest = parse_request(ChatCompletionRequest, body)
    ctx.warn_unknown_fields(req)
    ctx.check_model(req.model)
    ctx.check_num_choices(1, req.n)
    ids = ctx.apply_chat_template(req.messages, req.add_generation_prompt)
    if not ids:
        raise APIError("messages: the conversation has no tokens", param="messages")
    if req.truncate_prompt_tokens:
        ids = ids[-req.truncate_prompt_tokens:]
    requested = req.requested_max_tokens
    ctx.check_length(len(ids), requested, "messages")
    max_tokens = requested if requested is not None else ctx.max_model_len - len(ids)
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    entries = [(ids, ctx.sampling_params(req, max_tokens, j, logprobs)) for j in range(req.n)]
    return Prepared(req, [(None, ids)], entries, request_id=f"chatcmpl-{uuid.uuid4().hex}")


def logprobs_content(ctx: ServingContext, token_ids: list[int], entries: list[dict[int, Logprob]],
                     top: int) -> list[dict]:
    content = []
    for t, d in zip(token_ids, entries):
        s = ctx.token_str(t)
        best = sorted(d.items(), key=lambda kv: -kv[1].logprob)[:top]
        content.append({"token": s, "logprob": finite(d[t].logprob), "bytes": list(s.encode()),
                        "top_logprobs": [{"token": ctx.token_str(k), "logprob": finite(v.logprob),
                                          "bytes": list(ctx.token_str(k).encode())} for k, v in best]})
    return content


async def create_chat_completion(ctx: ServingContext, raw: Request) -> Response:
    arrival = time.monotonic()
    p = await ctx.off_loop(prepare, ctx, await raw.body())
    req: ChatCompletionRequest = p.req
    group = await ctx.submit(p, arrival, "messages")
    top = req.top_logprobs or 0
    # With echo, an assistant message at the end is continued: its text leads the answer.
    echo = req.messages[-1].text() if req.echo and req.messages[-1].role == "assistant" else ""
    created = int(time.time())

    if req.stream:
        base = {"id": p.request_id, "object": "chat.completion.chunk", "created": created, "model": ctx.model_name}
        extra = {"usage": None} if req.stream_options and req.stream_options.include_usage else {}
        first = [dict(base, choices=[{"index": i, "delta": {"role": "assistant", "content": echo},
                                      "logprobs": None, "finish_reason": None}], **extra)
                 for i in range(len(group))]

        def chunk(i: int, d: Delta) -> dict | None:
            if not d.text and not d.finished and not (req.logprobs and d.token_ids):
                return None
            lp = {"content": logprobs_content(ctx, d.token_ids, d.logprobs, top)} if req.logprobs else None
            choice = {"index": i, "delta": {"content": d.text} if d.text else {}, "logprobs": lp,
                      "finish_reason": d.finish_reason if d.finished else None,
                      "stop_reason": d.stop_reason if d.finished else None}
            return dict(base, choices=[choice], **extra)

        def usage_chunk(n: int, cached: dict[int, int]) -> dict:
            return dict(base, choices=[], usage=usage(p.prompt_tokens, n, p.cached_tokens(cached)))

        return ctx.stream(group, p.request_id, first, chunk, usage_chunk if extra else None)

    finals = await ctx.collect(group, raw, p.request_id)
    choices = [{"index": i, "message": {"role": "assistant", "content": echo + c.text},
                "logprobs": {"content": logprobs_content(ctx, c.token_ids, c.logprobs, top)} if req.logprobs else None,
                "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
               for i, c in enumerate(finals)]
    return JSONResponse({"id": p.request_id, "object": "chat.completion", "created": created, "model": ctx.model_name,
                         "choices": choices,
                         "usage": usage(p.prompt_tokens, sum(len(c.token_ids) for c in finals),
                                        p.cached_tokens({i: c.num_cached_tokens for i, c in enumerate(finals)}))})
