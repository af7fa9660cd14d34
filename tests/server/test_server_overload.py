"""--max-waiting-requests: overload answers 503 at once, with Retry-After (on the scripted
engine, whose requests wait while it is paused). On a real server with one running slot (slow
suite): the same, and a dead engine loop turning /health to 503 (that server ends dead, so it is
its own)."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.server.scripted import serve

MODEL_NAME = "smol"
LONG = {"prompt": "Tell me a story.", "max_tokens": 400, "ignore_eos": True}


@pytest.mark.anyio
async def test_overload_gets_503_with_retry_after_scripted(scripted):
    scripted.max_waiting_requests = 1
    scripted.paused = True  # nothing runs: every request accepted waits
    async with serve(scripted) as http:
        waiting = asyncio.ensure_future(http.post("/v1/completions", json={**LONG, "stream": True}))
        while scripted.num_waiting < 1:
            await asyncio.sleep(0.001)
        for path, body in (("/v1/completions", {"prompt": "Hi", "max_tokens": 2}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "stream": True})):
            r = await http.post(path, json=body)
            assert r.status_code == 503 and r.headers["Retry-After"] == "1"
            assert r.json()["error"]["code"] == "overloaded" and "--max-waiting-requests 1" in r.json()["error"]["message"]
        assert len(scripted.added) == 1  # the refused ones never reached the engine
        scripted.paused = False
        assert (await waiting).status_code == 200
        r = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.fixture(scope="module")
def limited(server_factory):
    return server_factory({"max_num_seqs": 1}, max_waiting_requests=1)


def read_first_data_line(response: httpx.Response):
    """Read up to the first SSE data line; return the line iterator, which must stay referenced:
    closing it (e.g. garbage collection) closes the connection, i.e. the client disconnects."""
    lines = response.iter_lines()
    for line in lines:
        if line.startswith("data:"):
            return lines
    raise AssertionError("the stream ended without data")


def wait_for(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


@pytest.mark.slow  # the answer's shape: test_overload_gets_503_with_retry_after_scripted
def test_overload_gets_503_with_retry_after_immediately(limited):
    url = limited.v1 + "/completions"
    with httpx.Client(timeout=30) as a_http, httpx.Client(timeout=30) as b_http:
        with a_http.stream("POST", url, json={**LONG, "stream": True}) as a:
            assert a.status_code == 200
            a_lines = read_first_data_line(a)  # A is running and holds the only slot
            with b_http.stream("POST", url, json={**LONG, "stream": True}) as b:
                assert b.status_code == 200  # B is accepted and waits
                assert wait_for(lambda: limited.metric("carpool:num_requests_waiting") == 1)
                start = time.monotonic()
                r = httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
                assert time.monotonic() - start < 2.0  # refused at once, not queued
                assert r.status_code == 503
                assert r.headers["Retry-After"] == "1"
                assert r.json()["error"]["code"] == "overloaded"
                client = openai.OpenAI(base_url=limited.v1, api_key="x", max_retries=0)
                with pytest.raises(openai.InternalServerError) as e:
                    client.chat.completions.create(model=MODEL_NAME, stream=True, max_tokens=2,
                                                   messages=[{"role": "user", "content": "Hi"}])
                assert e.value.status_code == 503
                assert limited.engine.num_unfinished_requests == 2  # A and B still being served
            del a_lines    # Both clients left: their requests are aborted and the server takes work again.
    assert limited.wait_idle()
    r = httpx.post(url, json={"prompt": "Hi", "max_tokens": 2, "ignore_eos": True}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


@pytest.mark.slow  # the loop's death: test_async_engine.py; its answers: test_server_hardening.py
def test_dead_engine_loop(limited, monkeypatch):
    url = limited.v1 + "/completions"
    client = openai.OpenAI(base_url=limited.v1, api_key="x", max_retries=0, timeout=30)
    assert httpx.get(limited.url + "/health").status_code == 200
    with ThreadPoolExecutor(1) as pool:
        stream = iter(client.completions.create(model=MODEL_NAME, stream=True, prompt=LONG["prompt"],
                                                max_tokens=LONG["max_tokens"], extra_body={"ignore_eos": True}))
        next(stream)  # running
        waiting = pool.submit(httpx.post, url, json={"prompt": "Hi", "max_tokens": 4}, timeout=30)
        assert wait_for(lambda: limited.server.client.num_waiting == 1)

        def boom():
            raise RuntimeError("scheduler exploded")

        monkeypatch.setattr(limited.engine.scheduler, "schedule", boom)
        with pytest.raises(openai.APIError) as e:
            for _ in stream:
                pass
        assert "the engine has stopped" in str(e.value) and "scheduler exploded" not in str(e.value)
        r = waiting.result()
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_dead"
    health = httpx.get(limited.url + "/health")
    assert health.status_code == 503 and "the engine has stopped" in health.json()["error"]["message"]
    r = httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}, timeout=10)
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"


@pytest.mark.anyio
async def test_a_full_queue_refuses_before_reading_the_body(scripted):
    """The 503 comes back while the client is still sending: the body is never waited for."""
    scripted.max_waiting_requests = 1
    scripted.paused = True
    async with serve(scripted, max_waiting_requests=1) as http:
        waiting = asyncio.ensure_future(http.post("/v1/completions", json={**LONG, "stream": True}))
        while scripted.num_waiting < 1:
            await asyncio.sleep(0.001)
        app = http._transport.app
        never_sent = asyncio.Event()
        sent: list[dict] = []

        async def receive():  # a client that never finishes its body
            await never_sent.wait()

        async def send(message):
            sent.append(message)

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions",
                 "root_path": "", "query_string": b"", "scheme": "http", "server": ("scripted", 80),
                 "client": ("127.0.0.1", 1), "http_version": "1.1", "asgi": {"version": "3.0"},
                 "headers": [(b"content-type", b"application/json"), (b"content-length", b"1000000")]}
        await asyncio.wait_for(app(scope, receive, send), timeout=5)
        assert sent[0]["status"] == 503 and (b"retry-after", b"1") in sent[0]["headers"]
        assert b'"overloaded"' in sent[1]["body"]
        scripted.paused = False
        assert (await waiting).status_code == 200


@pytest.mark.anyio
async def test_a_burst_past_the_limit_is_refused_at_once(scripted):
    """300 requests at once with room for 50: the other 250 get 503 while the 50 are still held
    (released only once every 503 is back, and at least 2 s after the burst). Bound: the 503s'
    median latency under 0.2 s. Measured on 2 cores: 0.2 ms; refused only once parsed and
    tokenised (the engine's own check), the same burst's median was 0.53 s."""
    limit, total = 50, 300
    scripted.max_waiting_requests = limit
    scripted.paused = True
    body = {"prompt": "word " * 1500, "max_tokens": 2}
    async with serve(scripted, max_waiting_requests=limit) as http:
        async def one() -> tuple[int, float]:
            start = time.monotonic()
            r = await http.post("/v1/completions", json=body)
            return r.status_code, time.monotonic() - start

        start = time.monotonic()
        tasks = [asyncio.ensure_future(one()) for _ in range(total)]
        refused = []
        while len(refused) < total - limit:
            done = [t for t in tasks if t.done()]
            refused = [t.result() for t in done if t.result()[0] == 503]
            assert len(done) == len(refused), [t.result() for t in done]  # nothing else finished
            await asyncio.sleep(0.01)
        await asyncio.sleep(max(0.0, 2.0 - (time.monotonic() - start)))
        held = time.monotonic() - start
        assert scripted.num_waiting == limit
        scripted.paused = False
        results = await asyncio.gather(*tasks)
        assert sum(status == 200 for status, _ in results) == limit
        latencies = sorted(latency for status, latency in results if status == 503)
        p50 = latencies[len(latencies) // 2]
        assert p50 < 0.2 and p50 < held / 10, (p50, held)
        assert http.ctx.admitting == 0


@pytest.mark.anyio
async def test_a_small_request_is_not_held_up_by_large_tokenize_calls(api):
    """Four /tokenize calls of ~0.75 MB (about a second of tokenising each, two at a time) are
    still running when a small completion, sent after them, has its whole answer."""
    big = {"prompt": "The quick brown fox jumps over the lazy dog 12345. " * 15000}
    large = [asyncio.ensure_future(api.post("/tokenize", json=big)) for _ in range(4)]
    await asyncio.sleep(0.2)  # the large ones are being tokenised
    r = await api.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert not all(t.done() for t in large)
    for response in await asyncio.gather(*large):
        assert response.status_code == 200 and response.json()["count"] > 200_000
