"""POST /v1/completions: prompts (strings or token ids) x n choices, with echo and logprobs."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from carpool.outputs import Logprob
from carpool.server.async_engine import Delta
from carpool.server.protocol import APIError, CompletionRequest, parse_request
from carpool.server.serving import Prepared, ServingContext, finite, prompt_logprobs_body, usage

DEFAULT_MAX_TOKENS = 16  # as in OpenAI's legacy completions API


def prepare(ctx: ServingContext, body: bytes) -> Prepared:
    """On a prepare thread: parse, tokenize, check, build one SamplingParams per choice."""
    req: CompletionRequest = parse_request(CompletionRequest, body)
    ctx.warn_unknown_fields(req)
    ctx.check_model(req.model)
    raw_prompts = req.prompts()
    ctx.check_num_choices(len(raw_prompts), req.n)
    ctx.check_logprobs(req.logprobs, "logprobs")
    ctx.check_logprobs(req.prompt_logprobs, "prompt_logprobs")
    max_tokens = req.max_tokens if req.max_tokens is not None else DEFAULT_MAX_TOKENS
    prompts = []
    for p in raw_prompts:
        if isinstance(p, str):
            ids = ctx.encode(p)
        else:
            ctx.check_token_ids(p, "prompt")
            ids = p
        if not ids:
            raise APIError("prompt: the prompt has no tokens", param="prompt")
        if req.truncate_prompt_tokens:
            ids = ids[-req.truncate_prompt_tokens:]
        ctx.check_length(len(ids), max_tokens, "prompt")
        prompts.append((p if isinstance(p, str) else None, ids))
    # echo + logprobs scores the echoed prompt as well (lm-evaluation-harness' loglikelihood).
    prompt_logprobs = max(req.logprobs, req.prompt_logprobs or 0) if req.echo and req.logprobs is not None else None
    entries = [(ids, ctx.sampling_params(req, max_tokens, j, req.logprobs, prompt_logprobs))
               for _, ids in prompts for j in range(req.n)]
    return Prepared(req, prompts, entries, request_id=f"cmpl-{uuid.uuid4().hex}")


def logprobs_body(ctx: ServingContext, name: Callable[[int], str], token_ids: list[int],
                  entries: list[dict[int, Logprob] | None], text_offset: int) -> dict[str, list]:
    """`name`: a token as the request wants it written (ServingContext.token_namer); the
    offsets are into the text whatever the names."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for t, d in zip(token_ids, entries):
        out["tokens"].append(name(t))
        out["text_offset"].append(text_offset)
        text_offset += len(ctx.token_str(t))
        if d is None:  # the first prompt token under echo: nothing precedes it
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
        else:
            out["token_logprobs"].append(finite(d[t].logprob))
            out["top_logprobs"].append({name(k): finite(v.logprob) for k, v in d.items()})
    return out


async def create_completion(ctx: ServingContext, raw: Request) -> Response:
    arrival = time.monotonic()
    p = await ctx.off_loop(prepare, await raw.body(), ctx)
    req = p.req
    group = await ctx.submit(p, arrival, "prompt", raw)
    base = {"id": p.request_id, "object": "text_completion", "created": int(time.time()), "model": ctx.model_name}
    want_lp = req.logprobs is not None
    name = ctx.token_namer(req)

    def echoed(choice: int, text: str, ids: list[int], lps: list, prompt_lps: list | None
               ) -> tuple[str, list[int], list]:
        """Prefix the prompt (text, ids, and its logprobs when they were asked for)."""
        ptext, pids = p.prompt_of(choice)
        ptext = ptext if ptext is not None else ctx.tokenizer.decode(pids)
        return ptext + text, pids + ids, (prompt_lps or [None] * len(pids)) + lps

    def scored_prompt(lps: list | None) -> dict:
        return {"prompt_logprobs": prompt_logprobs_body(lps)} if req.prompt_logprobs is not None else {}

    if req.stream:
        started, offsets = [False] * len(group), [0] * len(group)
        extra = {"usage": None} if req.stream_options and req.stream_options.include_usage else {}

        def chunk(i: int, d: Delta) -> dict | None:
            text, ids, lps = d.text, d.token_ids, d.logprobs
            first = not started[i]
            if req.echo and first:
                text, ids, lps = echoed(i, text, ids, lps, d.prompt_logprobs)
            started[i] = True
            if not text and not d.finished and not ids:  # a token with held text still gets its chunk
                return None
            logprobs = logprobs_body(ctx, name, ids, lps, offsets[i]) if want_lp else None
            offsets[i] += len(text)
            choice = {"index": i, "text": text, "logprobs": logprobs,
                      "finish_reason": d.finish_reason if d.finished else None,
                      "stop_reason": d.stop_reason if d.finished else None,
                      **(scored_prompt(d.prompt_logprobs) if first else {})}
            return dict(base, choices=[choice], **extra)

        def usage_chunk(n: int, cached: dict[int, int]) -> dict:
            return dict(base, choices=[], usage=usage(p.prompt_tokens, n, p.cached_tokens(cached)))

        return ctx.stream(group, p.request_id, [], chunk, usage_chunk if extra else None)

    finals = await ctx.collect(group, raw, p.request_id)
    choices = []
    for i, c in enumerate(finals):
        text, ids, lps = c.text, c.token_ids, c.logprobs
        if req.echo:
            text, ids, lps = echoed(i, text, ids, lps, c.prompt_logprobs)
        choices.append({"index": i, "text": text,
                        "logprobs": logprobs_body(ctx, name, ids, lps, 0) if want_lp else None,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                        **scored_prompt(c.prompt_logprobs)})
    return JSONResponse(dict(base, choices=choices,
                             usage=usage(p.prompt_tokens, sum(len(c.token_ids) for c in finals),
                                         p.cached_tokens({i: c.num_cached_tokens for i, c in enumerate(finals)}))))
