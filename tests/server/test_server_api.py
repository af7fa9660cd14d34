"""The OpenAI-compatible surface. Response and chunk shapes, validation and the small
endpoints run against the scripted engine (`api`, `http`); what the tokens must be (greedy,
seeds, stops, logprobs, the prefix cache) against the real engine, with the official `openai`
client (sync and async)."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tests.server.scripted import REPLY

pytestmark = pytest.mark.anyio

PROMPT = "The capital of France is"


MODEL_NAME = "smol"  # conftest.MODEL_NAME


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.v1, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def greedy(client):
    """A reference greedy completion (ignore_eos so its length is known)."""
    return client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})


def tokenize(served, **body) -> list[int]:
    return httpx.post(served.url + "/tokenize", json=body).json()["tokens"]


def events(r: httpx.Response) -> list[dict]:
    """The JSON events of a server-sent event stream, after checking its framing."""
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    blocks = r.text.split("\n\n")
    assert blocks[-2:] == ["data: [DONE]", ""]
    assert all(b.startswith("data: ") for b in blocks[:-1])
    return [json.loads(b[6:]) for b in blocks[:-2]]


# ------------------------------------------------------------------ shapes, on the scripted engine

async def test_models_and_health(http):
    r = await http.get("/v1/models")
    [model] = r.json()["data"]
    assert r.json()["object"] == "list"
    assert model["id"] == MODEL_NAME and model["object"] == "model" and model["owned_by"] == "carpool"
    assert model["max_model_len"] == http.ctx.max_model_len
    assert (await http.get("/health")).status_code == 200


async def test_completion_body(api, scripted):
    r = await api.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "n": 2})
    body = r.json()
    Completion.model_validate(body)
    [(prompt, params)] = scripted.added[:1]
    tokens = scripted.tokens(prompt, params)
    text = scripted.info.tokenizer.decode(tokens)
    assert body["id"].startswith("cmpl-") and body["object"] == "text_completion" and body["model"] == MODEL_NAME
    assert [(c["index"], c["text"], c["finish_reason"], c["logprobs"]) for c in body["choices"]] == [
        (0, text, "length", None), (1, text, "length", None)]
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 8, "total_tokens": len(prompt) + 8,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    short = (await api.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 100})).json()
    assert short["choices"][0]["text"] == REPLY and short["choices"][0]["finish_reason"] == "stop"


async def test_completion_stream_chunks(api, scripted):
    r = await api.post("/v1/completions", json={"prompt": [PROMPT, "1, 2, 3,"], "max_tokens": 3, "stream": True,
                                                 "stream_options": {"include_usage": True}})
    chunks = events(r)
    *pieces, last = chunks
    assert len({c["id"] for c in chunks}) == 1 and all(c["object"] == "text_completion" for c in chunks)
    assert all(len(c["choices"]) == 1 and c["usage"] is None for c in pieces)
    for index in (0, 1):
        mine = [c["choices"][0] for c in pieces if c["choices"][0]["index"] == index]
        assert len(mine) == 3  # a chunk per token
        assert [c["finish_reason"] for c in mine] == [None, None, "length"]
        assert "".join(c["text"] for c in mine) == scripted.info.tokenizer.decode(scripted.tokens(*scripted.added[index]))
    prompt_tokens = sum(len(p) for p, _ in scripted.added)
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 6
    assert last["usage"]["prompt_tokens"] == prompt_tokens
    plain = events(await api.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "stream": True}))
    assert all("usage" not in c for c in plain)  # no usage key unless asked


async def test_completion_echo_and_logprobs_shape(api, scripted):
    body = (await api.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "echo": True,
                                                     "logprobs": 2})).json()
    choice = body["choices"][0]
    prompt, _ = scripted.added[0]
    lp = choice["logprobs"]
    assert choice["text"].startswith(PROMPT) and "".join(lp["tokens"]) == choice["text"]
    assert len(lp["tokens"]) == len(prompt) + 3 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    for value, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert len(top) == 2 and value == max(top.values())


async def test_chat_body_and_stream_chunks(api, scripted):
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    body = (await api.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 5, "logprobs": True,
                                                          "top_logprobs": 2})).json()
    ChatCompletion.model_validate(body)
    choice = body["choices"][0]
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    content = choice["logprobs"]["content"]
    assert "".join(c["token"] for c in content) == choice["message"]["content"] and len(content) == 5
    assert all(len(c["top_logprobs"]) == 2 and c["logprob"] == c["top_logprobs"][0]["logprob"] for c in content)
    assert body["usage"]["prompt_tokens"] == len(scripted.added[0][0])
    chunks = events(await api.post("/v1/chat/completions", json={
        "messages": messages, "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}))
    for c in chunks:
        ChatCompletionChunk.model_validate(c)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == \
        choice["message"]["content"]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == body["usage"]


async def test_what_the_engine_is_asked(api, scripted):
    """Prompts (text or ids, one engine request per prompt x choice, prompt-major), choice j's
    seed (seed + j), and the sampling fields, as the engine gets them."""
    ids = (await api.post("/tokenize", json={"prompt": PROMPT})).json()["tokens"]
    body = (await api.post("/v1/completions", json={"prompt": [ids, ids[:2]], "n": 3, "seed": 5, "max_tokens": 4,
                                                     "ignore_eos": True})).json()
    assert [c["index"] for c in body["choices"]] == list(range(6))
    assert body["usage"]["prompt_tokens"] == len(ids) + 2  # each prompt once, not n times
    assert body["usage"]["completion_tokens"] == 24
    assert [(p, sp.seed) for p, sp in scripted.added] == [(ids, 5), (ids, 6), (ids, 7),
                                                          (ids[:2], 5), (ids[:2], 6), (ids[:2], 7)]
    await api.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1})
    assert scripted.added[-1][0] == ids  # text, tokenized by the server
    await api.post("/v1/completions", json={
        "prompt": PROMPT, "max_tokens": 6, "temperature": 0.7, "top_p": 0.9, "presence_penalty": 0.5,
        "frequency_penalty": 0.25, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2, "stop": [" the"],
        "stop_token_ids": [7], "min_tokens": 2, "ignore_eos": True, "logit_bias": {"11": 3}})
    sp = scripted.added[-1][1]
    assert (sp.max_tokens, sp.temperature, sp.top_p, sp.presence_penalty, sp.frequency_penalty, sp.top_k,
            sp.min_p, sp.repetition_penalty) == (6, 0.7, 0.9, 0.5, 0.25, 20, 0.05, 1.2)
    assert (sp.stop, sp.stop_token_ids, sp.min_tokens, sp.ignore_eos, sp.logit_bias) == (
        [" the"], [7], 2, True, {11: 3})
    assert sp.output_kind == "delta" and sp.seed is None


# ------------------------------------------------------------------ the tokens, on the real engine


def test_completion_usage_and_length(served, greedy):
    choice = greedy.choices[0]
    assert choice.text and choice.finish_reason == "length"
    assert greedy.model == MODEL_NAME and greedy.object == "text_completion"
    assert greedy.usage.prompt_tokens == len(tokenize(served, prompt=PROMPT))
    assert greedy.usage.completion_tokens == 12
    assert greedy.usage.total_tokens == greedy.usage.prompt_tokens + 12


def test_greedy_is_deterministic_and_streaming_matches(client, greedy):
    again = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert again.choices[0].text == greedy.choices[0].text
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == greedy.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == greedy.usage.prompt_tokens


def test_a_token_whose_text_is_held_still_streams_a_chunk(served, client):
    """As vLLM does: every token gets a chunk, so a client can time tokens, not characters. The
    byte 0xE2 alone starts a UTF-8 character that never completes, so all its text is held."""
    lead_byte = served.engine.tokenizer.convert_tokens_to_ids("\u00e2")  # byte-level BPE's 0xE2
    for stream in (client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0,
                                             stream=True, logit_bias={str(lead_byte): 100},
                                             stream_options={"include_usage": True}, extra_body={"ignore_eos": True}),
                   client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": PROMPT}],
                                                  max_tokens=4, temperature=0, stream=True,
                                                  logit_bias={str(lead_byte): 100},
                                                  stream_options={"include_usage": True})):
        chunks = list(stream)
        choices = [c.choices[0] for c in chunks if c.choices]
        texts = [ch.text if hasattr(ch, "text") else ch.delta.content for ch in choices]
        assert chunks[-1].usage.completion_tokens == 4
        assert texts[-4:] == [""] * 4  # the chat stream's first chunk is the role's
        assert choices[-1].finish_reason == "length"


@pytest.mark.slow  # the request's side: test_what_the_engine_is_asked
def test_prompt_forms(served, client, greedy):
    ids = tokenize(served, prompt=PROMPT)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert by_ids.choices[0].text == greedy.choices[0].text
    batch = client.completions.create(model=MODEL_NAME, prompt=[PROMPT, "1, 2, 3,"], max_tokens=5,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.choices[0].text == greedy.choices[0].text[:len(batch.choices[0].text)]
    assert batch.usage.completion_tokens == 10
    assert batch.usage.prompt_tokens == len(ids) + len(tokenize(served, prompt="1, 2, 3,"))
    ids_batch = client.completions.create(model=MODEL_NAME, prompt=[ids, ids[:2]], max_tokens=3, temperature=0)
    assert len(ids_batch.choices) == 2


def test_echo(client, greedy):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0, echo=True,
                                    extra_body={"ignore_eos": True})
    assert out.choices[0].text == PROMPT + greedy.choices[0].text


@pytest.mark.slow  # the request's side: test_what_the_engine_is_asked
def test_n_choices_use_seed_plus_index(served, client):
    kw = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=8, temperature=1.0,
              extra_body={"ignore_eos": True})
    multi = client.completions.create(n=3, seed=5, **kw)
    assert [c.index for c in multi.choices] == [0, 1, 2]
    assert multi.usage.completion_tokens == 24
    assert multi.usage.prompt_tokens == len(tokenize(served, prompt="Once upon a time"))  # once, not n times
    singles = [client.completions.create(seed=5 + i, **kw).choices[0].text for i in range(3)]
    assert [c.text for c in multi.choices] == singles
    texts = ["", "", ""]
    finishes = []
    for chunk in client.completions.create(n=3, seed=5, stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finishes.append(c.index)
    assert texts == singles and sorted(finishes) == [0, 1, 2]


@pytest.mark.slow  # the request's side: test_what_the_engine_is_asked
def test_seed_reproducibility(client):
    kw = dict(model=MODEL_NAME, prompt="My favourite food is", max_tokens=10, temperature=1.0)
    a = client.completions.create(seed=123, **kw).choices[0].text
    b = client.completions.create(seed=123, **kw).choices[0].text
    assert a == b
    others = {client.completions.create(seed=s, **kw).choices[0].text for s in (1, 2, 3)}
    assert others - {a}, "different seeds should not all give the seed-123 text"


def test_stop_string(client, greedy):
    text = greedy.choices[0].text
    words = text.split()
    assert len(words) >= 3
    stop = " " + words[2]
    assert stop in text
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[:text.index(stop)]
    streamed = list(client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0,
                                              stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == text[:text.index(stop)]
    assert streamed[-1].choices[0].finish_reason == "stop"


@pytest.mark.slow  # the request's side: test_what_the_engine_is_asked
def test_stop_token_ids_and_min_tokens(client, greedy, served):
    first = tokenize(served, prompt=greedy.choices[0].text)[0]
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0,
                                    extra_body={"stop_token_ids": [first]})
    assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == 1
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0,
                                    extra_body={"stop_token_ids": [first], "min_tokens": 4})
    assert out.usage.completion_tokens >= 4


def test_completion_logprobs(client, greedy):
    out = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert out.choices[0].text == greedy.choices[0].text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and 2 <= len(top) <= 3
        assert value == pytest.approx(max(top.values()))  # greedy picks the most likely token


@pytest.mark.slow  # the request's side: test_what_the_engine_is_asked
def test_sampling_fields_accepted(client):
    out = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0.7, top_p=0.9, presence_penalty=0.5,
        frequency_penalty=0.5, seed=1,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2, "ignore_eos": True})
    assert out.usage.completion_tokens == 6


# ------------------------------------------------------------------ chat
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


def test_chat_usage_and_streaming(served, client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=10, temperature=0)
    msg = out.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert out.object == "chat.completion"
    assert out.usage.prompt_tokens == len(tokenize(served, messages=MESSAGES))
    assert out.usage.completion_tokens <= 10
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=10,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == out.usage.prompt_tokens


def test_chat_echo_of_a_partial_assistant_turn(client):
    messages = MESSAGES + [{"role": "assistant", "content": "The answer is"}]
    out = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0,
                                         extra_body={"echo": True})
    assert out.choices[0].message.content.startswith("The answer is")
    assert len(out.choices[0].message.content) > len("The answer is")


async def test_chat_template_is_applied(http):
    ids = (await http.post("/tokenize", json={"messages": MESSAGES})).json()["tokens"]
    text = (await http.post("/detokenize", json={"tokens": ids})).json()["prompt"]
    assert "<|im_start|>user\nWhat is 2 + 2?<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_chat_logprobs_and_n(client):
    out = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=6, temperature=0,
                                         logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = out.choices[0].logprobs.content
    assert len(content) == 6
    assert "".join(c.token for c in content) == out.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs),
                                                               reverse=True)
    multi = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, n=2, seed=9,
                                           extra_body={"ignore_eos": True})
    assert [c.index for c in multi.choices] == [0, 1]
    assert multi.usage.completion_tokens == 10


def test_async_client_concurrent(served):
    async def run():
        client = openai.AsyncOpenAI(base_url=served.v1, api_key="unused", max_retries=0, timeout=60)
        chats = [client.chat.completions.create(model=MODEL_NAME, max_tokens=6, temperature=0,
                                                messages=[{"role": "user", "content": f"Count to {i}"}],
                                                extra_body={"ignore_eos": True}) for i in range(3)]

        async def stream_one():
            stream = await client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=12,
                                                     temperature=0, stream=True,
                                                     extra_body={"ignore_eos": True})
            return "".join([c.choices[0].text async for c in stream])

        results = await asyncio.gather(*chats, stream_one())
        await client.close()
        return results

    *chats, streamed = asyncio.run(run())
    assert all(c.usage.completion_tokens == 6 for c in chats)
    assert streamed  # same greedy text as the sync path is checked elsewhere
    assert served.wait_idle()


# ------------------------------------------------------------------ small endpoints
async def test_tokenize_detokenize(http):
    r = (await http.post("/tokenize", json={"prompt": "hello world", "add_special_tokens": False})).json()
    assert r["count"] == len(r["tokens"]) > 0 and r["max_model_len"] == http.ctx.max_model_len
    back = (await http.post("/detokenize", json={"tokens": r["tokens"]})).json()
    assert back["prompt"] == "hello world"
    bad = await http.post("/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_metrics(served, client):
    before = served.metric("carpool:generation_tokens_total", model_name=MODEL_NAME)
    ttft_before = served.metric("carpool:time_to_first_token_seconds_count")
    ok_before = served.metric("carpool:request_success_total", finished_reason="length")
    client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=7, temperature=0,
                              extra_body={"ignore_eos": True})
    assert served.metric("carpool:generation_tokens_total") == before + 7
    assert served.metric("carpool:time_to_first_token_seconds_count") == ttft_before + 1
    assert served.metric("carpool:request_success_total", finished_reason="length") == ok_before + 1
    assert served.metric("carpool:inter_token_latency_seconds_count") > 0
    assert served.metric("carpool:iteration_tokens_total_count") > 0
    assert served.metric("carpool:prompt_tokens_total") > 0
    for name in ("carpool:e2e_request_latency_seconds_count", "carpool:request_queue_time_seconds_count"):
        assert served.metric(name) > 0
    for name in ("carpool:num_requests_running", "carpool:num_requests_waiting", "carpool:kv_cache_usage_perc",
                 "carpool:num_preemptions_total", "carpool:generation_stalls_total"):
        assert served.metric(name) >= 0
    assert served.metric("carpool:num_requests_running") == 0  # idle again
    assert "text/plain" in httpx.get(served.url + "/metrics").headers["content-type"]


def test_prefix_cache_in_usage_and_metrics(served, client):
    """A repeated prompt prefix shows in usage.prompt_tokens_details.cached_tokens (streamed or
    not, completions and chat) and in the prefix-cache counters."""
    queries = served.metric("carpool:prefix_cache_queries_total")
    hits = served.metric("carpool:prefix_cache_hits_total")
    ids = [1000 + (i * 37) % 5000 for i in range(70)]  # 70 tokens: 4 full blocks before the last token
    first = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    again = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == 64
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=ids + [7, 8], max_tokens=2, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 64
    assert served.metric("carpool:prefix_cache_queries_total") - queries == 70 + 70 + 72
    assert served.metric("carpool:prefix_cache_hits_total") - hits == 128
    system = {"role": "system", "content": "You answer in one word. " + "Carpools share rides. " * 12}
    chat = [client.chat.completions.create(model=MODEL_NAME, messages=[system, {"role": "user", "content": q}],
                                           max_tokens=2, temperature=0) for q in ("Cars?", "Bikes?")]
    assert chat[0].usage.prompt_tokens_details.cached_tokens == 0
    assert chat[1].usage.prompt_tokens_details.cached_tokens >= 48
    streamed = list(client.chat.completions.create(model=MODEL_NAME,
                                                   messages=[system, {"role": "user", "content": "Go?"}],
                                                   max_tokens=2, temperature=0, stream=True,
                                                   stream_options={"include_usage": True}))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == chat[1].usage.prompt_tokens_details.cached_tokens


# ------------------------------------------------------------------ bad input
BAD = [
    ("completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("completions", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("completions", {"prompt": "hi", "n": 0}, "n"),
    ("completions", {"prompt": "hi", "top_p": 1.5}, "top_p"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ("completions", {"prompt": "hi", "logprobs": 99}, "logprobs"),
    ("completions", {"prompt": "hi", "stop": [""]}, "stop"),
    ("completions", {"prompt": ""}, "prompt"),
    ("completions", {"prompt": [5, 10**9]}, "prompt"),
    ("completions", {}, "prompt"),
    ("completions", {"prompt": "hi", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ("completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"messages": MESSAGES, "n": -3}, "n"),
]


async def test_unknown_model_is_404(http):
    """As vLLM answers it; the openai client raises NotFoundError on the status."""
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": MESSAGES}),
                       ("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        r = await http.post(path, json=dict(body, model="gpt-4"))
        assert r.status_code == 404, (path, r.text)
        err = r.json()["error"]
        assert err["code"] == "model_not_found" and err["param"] == "model" and "`gpt-4` does not exist" in err["message"]
    r = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "model": MODEL_NAME})
    assert r.status_code == 200


@pytest.mark.parametrize("route,body,param", BAD, ids=[f"{r}-{p}" for r, _, p in BAD])
async def test_bad_request_names_the_field(http, route, body, param):
    r = await http.post(f"/v1/{route}", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert param in err["message"]


async def test_bad_json_and_context_overflow(http):
    for raw in (b"{not json", b"[1, 2]", b""):
        r = await http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and "error" in r.json()
    limit = http.ctx.max_model_len
    r = await http.post("/v1/completions", json={"prompt": [100] * limit, "max_tokens": 4})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "prompt" and r.json()["error"]["code"] == "context_length_exceeded"
    r = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": limit})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    # ...and the server keeps serving.
    r = await http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 3
    assert http.wait_idle()


async def test_role_chunk_waits_for_the_first_token(scripted, anyio_backend):
    """The stream's first event (the role chunk) goes out with the first token, not when the
    request is accepted: a waiting request has sent its headers and no event yet."""
    from carpool.server.app import create_app
    from carpool.server.options import ServerOptions

    app = create_app(scripted, ServerOptions(served_model_name=[MODEL_NAME]))
    body = json.dumps({"messages": MESSAGES, "max_tokens": 2, "stream": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
             "root_path": "", "scheme": "http", "client": ("127.0.0.1", 1), "server": ("scripted", 80),
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}
    requests = [{"type": "http.request", "body": body, "more_body": False}]
    sent: list[dict] = []

    async def receive():
        if requests:
            return requests.pop()
        await asyncio.Event().wait()  # the client stays

    async def send(message):
        sent.append(message)

    async with app.router.lifespan_context(app):
        scripted.paused = True
        task = asyncio.ensure_future(app(scope, receive, send))
        for _ in range(200):
            if scripted.num_waiting and sent:
                break
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        assert scripted.num_waiting == 1 and sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
        assert not any(m.get("body") for m in sent), sent  # accepted, waiting: no event yet
        scripted.paused = False
        await asyncio.wait_for(task, 10)
    text = b"".join(m.get("body", b"") for m in sent).decode()
    chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"].get("content") for c in chunks[1:]] == [" Paris", " is"]
