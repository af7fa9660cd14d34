"""Bounded load on loopback: 64 concurrent streaming clients with mixed prompt and output
lengths all finish with exactly the tokens they asked for, and the KV cache empties again."""

from __future__ import annotations

import asyncio
import random

import httpx
import openai

MODEL_NAME = "smol"
NUM_CLIENTS = 64
WORDS = "the quick brown fox jumps over a lazy dog while seven wise owls watch the moon rise".split()


def test_64_concurrent_streams(served):
    rng = random.Random(0)
    jobs = []
    for i in range(NUM_CLIENTS):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40)))
        jobs.append((prompt, rng.randint(2, 20), i % 4 == 0))  # every 4th is a chat stream
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
