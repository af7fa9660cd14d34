"""Bounded load: 64 concurrent streaming clients with mixed prompt and output lengths all
finish with exactly the tokens they asked for: on the scripted engine in process, and (slow
suite) on loopback to a real engine, whose KV cache empties again."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import openai
import pytest

MODEL_NAME = "smol"
NUM_CLIENTS = 64
WORDS = "the quick brown fox jumps over a lazy dog while seven wise owls watch the moon rise".split()


def make_jobs() -> list[tuple[str, int, bool]]:
    rng = random.Random(0)
    jobs = []
    for i in range(NUM_CLIENTS):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40)))
        jobs.append((prompt, rng.randint(2, 20), i % 4 == 0))  # every 4th is a chat stream
    return jobs


@pytest.mark.anyio
async def test_64_concurrent_streams_scripted(api, scripted):
    """Streams interleave on the event loop (a token per step each); each gets exactly its own."""
    jobs = make_jobs()

    async def one(seed: int, prompt: str, max_tokens: int, chat: bool) -> tuple[int, list, dict, str]:
        body = {"max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
                "ignore_eos": True, "seed": seed}  # the seed tells the engine requests apart
        if chat:
            r = await api.post("/v1/chat/completions", json={
                **body, "messages": [{"role": "user", "content": prompt}], "logprobs": True})
        else:
            r = await api.post("/v1/completions", json={**body, "prompt": prompt, "logprobs": 0})
        chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        streamed, finish, text = 0, [], ""
        for c in chunks[:-1]:
            [choice] = c["choices"]
            if chat:
                streamed += len(choice["logprobs"]["content"]) if choice["logprobs"] else 0
                text += choice["delta"].get("content", "")
            else:
                streamed += len(choice["logprobs"]["tokens"])
                text += choice["text"]
            if choice["finish_reason"]:
                finish.append(choice["finish_reason"])
        return streamed, finish, chunks[-1]["usage"], text

    results = await asyncio.gather(*(one(seed, *job) for seed, job in enumerate(jobs)))
    by_seed = {sp.seed: (prompt, sp) for prompt, sp in scripted.added}
    for seed, (streamed, finish, usage, text) in enumerate(results):
        max_tokens = jobs[seed][1]
        assert streamed == max_tokens and finish == ["length"] and usage["completion_tokens"] == max_tokens
        ids, sp = by_seed[seed]
        assert usage["prompt_tokens"] == len(ids)
        assert text == scripted.info.tokenizer.decode(scripted.tokens(ids, sp))
    assert scripted.idle


@pytest.mark.slow  # the HTTP side: test_64_concurrent_streams_scripted
def test_64_concurrent_streams(served):
    jobs = make_jobs()
    prompt_lens = {}
    for prompt, _, chat in jobs:
        body = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
        prompt_lens[prompt, chat] = httpx.post(served.url + "/tokenize", json=body).json()["count"]
    tokens_before = served.metric("carpool:generation_tokens_total")

    async def one(client: openai.AsyncOpenAI, prompt: str, max_tokens: int, chat: bool):
        # logprobs give one entry per generated token, so they count what streamed.
        common = dict(model=MODEL_NAME, max_tokens=max_tokens, temperature=0.8, seed=len(prompt), stream=True,
                      stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        if chat:
            stream = await client.chat.completions.create(
                messages=[{"role": "user", "content": prompt}], logprobs=True, **common)
        else:
            stream = await client.completions.create(prompt=prompt, logprobs=0, **common)
        streamed, finish, usage, text = 0, [], None, ""
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for c in chunk.choices:
                if chat:
                    streamed += len(c.logprobs.content) if c.logprobs else 0
                    text += c.delta.content or ""
                else:
                    streamed += len(c.logprobs.tokens) if c.logprobs else 0
                    text += c.text
                if c.finish_reason:
                    finish.append(c.finish_reason)
        return streamed, finish, usage, text

    async def run():
        client = openai.AsyncOpenAI(base_url=served.v1, api_key="unused", max_retries=0, timeout=180)
        try:
            return await asyncio.gather(*(one(client, *job) for job in jobs))
        finally:
            await client.close()

    results = asyncio.run(run())
    assert len(results) == NUM_CLIENTS
    for (prompt, max_tokens, chat), (streamed, finish, usage, text) in zip(jobs, results):
        assert streamed == max_tokens, (prompt, chat)
        assert finish == ["length"]
        assert usage.completion_tokens == max_tokens
        assert usage.prompt_tokens == prompt_lens[prompt, chat]
        assert text
    assert served.wait_idle(timeout=10), "the KV cache did not return to empty"
    engine = served.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert served.metric("carpool:generation_tokens_total") - tokens_before == sum(m for _, m, _ in jobs)
    assert served.metric("carpool:num_requests_running") == 0
    assert served.metric("carpool:num_requests_waiting") == 0
    assert served.metric("carpool:kv_cache_usage_perc") == 0
