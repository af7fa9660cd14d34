"""Whatever one client sends, every other client keeps being served: bad numbers, bodies and
content types, slow readers, failing engines. What the server alone decides runs on the
scripted engine (`http`, `make_http`); the engine's own faults on a real one."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from carpool.outputs import CompletionOutput, Logprob, RequestOutput
from carpool.server.async_engine import AsyncLLMEngine, LoopWaker, RequestGroup
from tests.server.scripted import serve

MODEL_NAME = "smol"

pytestmark = pytest.mark.anyio


def post(served, path: str, body, **kwargs) -> httpx.Response:
    if isinstance(body, (dict, list)):
        body = json.dumps(body)
    headers = kwargs.pop("headers", {"Content-Type": "application/json"})
    return httpx.post(served.url + path, content=body, headers=headers, timeout=60, **kwargs)


async def apost(http: httpx.AsyncClient, path: str, body, **kwargs) -> httpx.Response:
    if isinstance(body, (dict, list)):
        body = json.dumps(body)
    return await http.post(path, content=body, headers={"Content-Type": "application/json"}, **kwargs)


def assert_400(r: httpx.Response, param: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"


# ------------------------------------------------------------------ bad numbers, named at the door
@pytest.mark.parametrize("raw, param", [
    ('{"prompt": "Hi", "temperature": Infinity}', "temperature"),
    ('{"prompt": "Hi", "temperature": 1e400}', "temperature"),
    ('{"prompt": "Hi", "temperature": NaN}', "temperature"),
    ('{"prompt": "Hi", "temperature": 1e30, "min_tokens": 1}', "temperature"),
    ('{"prompt": "Hi", "repetition_penalty": 1e-45}', "repetition_penalty"),
    ('{"prompt": "Hi", "top_p": -Infinity}', "top_p"),
    ('{"prompt": "Hi", "seed": 18446744073709551616}', "seed"),
    ('{"prompt": "Hi", "stop_token_ids": [49152]}', "stop_token_ids"),
    ('{"prompt": "Hi", "stop_token_ids": [-1]}', "stop_token_ids"),
    # keys str.isdigit() passes but int() refuses (or takes too long over)
    ('{"prompt": "Hi", "logit_bias": {"\u00b2": 1}}', "logit_bias"),
    ('{"prompt": "Hi", "logit_bias": {"\u0663": 1}}', "logit_bias"),
    ('{"prompt": "Hi", "logit_bias": {"' + "9" * 5000 + '": 1}}', "logit_bias"),
    ('{"prompt": "Hi", "logit_bias": {" 5": 1}}', "logit_bias"),
    ('{"prompt": "Hi", "logit_bias": {"-5": 1}}', "logit_bias"),
])
async def test_bad_numbers_are_400_naming_the_field(http, raw, param):
    assert_400(await apost(http, "/v1/completions", raw), param)
    chat = raw.replace('"prompt": "Hi"', '"messages": [{"role": "user", "content": "Hi"}]')
    assert_400(await apost(http, "/v1/chat/completions", chat), param)


async def test_stop_strings_are_limited(http):
    assert_400(await apost(http, "/v1/completions", {"prompt": "Hi", "stop": ["x" * 200] * 10_000}), "stop")
    assert_400(await apost(http, "/v1/completions", {"prompt": "Hi", "stop": ["x" * 257]}), "stop")
    assert_400(await apost(http, "/v1/completions", {"prompt": "Hi", "stop": "x" * 257}), "stop")
    ok = await apost(http, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "stop": ["zz" * 128] * 32})
    assert ok.status_code == 200, ok.text


async def test_engine_requests_per_http_request_are_capped(make_http):
    async with make_http(max_choices_per_request=4) as http:
        assert_400(await apost(http, "/v1/completions", {"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 1}), "n")
        assert_400(await apost(http, "/v1/chat/completions",
                               {"messages": [{"role": "user", "content": "a"}], "n": 5}), "n")
        r = await apost(http, "/v1/completions", {"prompt": ["a", "b"], "n": 2, "max_tokens": 1})
        assert r.status_code == 200 and len(r.json()["choices"]) == 4
        assert http.wait_idle()


# ------------------------------------------------------------------ bodies
async def test_body_past_the_limit_is_413(http):
    big = {"prompt": "word " * 700_000}  # ~3.5 MB
    r = await apost(http, "/v1/completions", big)
    assert r.status_code == 413 and r.json()["error"]["message"].startswith("the request body is larger")

    async def chunked():  # no Content-Length: counted as it arrives
        for _ in range(40):
            yield b" " * 100_000
    r = await http.post("/v1/completions", content=chunked(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
async def test_post_must_be_json(http, content_type):
    headers = {"Content-Type": content_type} if content_type else {}
    r = await http.post("/v1/completions", content=b'{"prompt": "Hi"}', headers=headers)
    assert r.status_code == 415
    ok = await http.post("/v1/completions", content=b'{"prompt": "Hi", "max_tokens": 1}',
                         headers={"Content-Type": "application/json; charset=utf-8"})
    assert ok.status_code == 200


async def test_tokenization_runs_off_the_event_loop(http, monkeypatch):
    """While one request's tokenisation is stuck, /health and other endpoints still answer."""
    release, entered = threading.Event(), threading.Event()
    real = http.ctx.encode

    def slow_encode(text, add_special_tokens=True):
        if text.startswith("SLOW"):
            entered.set()
            release.wait(30)
        return real(text, add_special_tokens)

    monkeypatch.setattr(http.ctx, "encode", slow_encode)
    stuck = asyncio.ensure_future(apost(http, "/v1/completions", {"prompt": "SLOW hello", "max_tokens": 2}))
    try:
        assert await asyncio.to_thread(entered.wait, 30)
        start = time.monotonic()
        assert (await http.get("/health", timeout=5)).status_code == 200
        assert (await http.get("/v1/models", timeout=5)).status_code == 200
        assert time.monotonic() - start < 5
    finally:
        release.set()
    assert (await stuck).status_code == 200


# ------------------------------------------------------------------ slow readers
def _output(rid: str, new: list[int], finished: bool = False) -> RequestOutput:
    choice = CompletionOutput(0, "", [], None, None, "length" if finished else None)
    return RequestOutput(rid, None, [1], [choice], finished, new_text="".join(f"<{t}>" for t in new),
                         new_token_ids=new, new_logprobs=[{t: Logprob(-1.0)} for t in new])


def test_a_reader_that_stops_reading_holds_merged_deltas_not_a_queue():
    async def main():
        loop = asyncio.get_running_loop()
        group = RequestGroup(AsyncLLMEngine.__new__(AsyncLLMEngine), loop, ["a", "b"], LoopWaker(loop))
        for step in range(1000):
            group.deliver([(0, _output("a", [step])), (1, _output("b", [step, step]))])
        # Nothing was read: one merged delta per choice, whatever the number of steps.
        assert sorted(group._pending) == [0, 1]
        assert len(group._pending[0]._parts) == 1000  # pieces of one string, joined once when read
        group.deliver([(0, _output("a", [7], finished=True)), (1, _output("b", [], finished=True))])
        got = [(i, d) async for i, d in group]
        assert [i for i, _ in got] == [0, 1]
        a, b = got[0][1], got[1][1]
        assert a.token_ids == list(range(1000)) + [7] and a.finished and a.finish_reason == "length"
        assert a.text == "".join(f"<{t}>" for t in range(1000)) + "<7>"
        assert len(a.logprobs) == 1001
        assert len(b.token_ids) == 2000 and not group._pending

    asyncio.run(main())


def test_a_slow_streaming_client_does_not_slow_or_lose_others(served):
    """A stream nobody reads, beside one that is read: the read one finishes in full."""
    body = {"prompt": "Count: 1, 2,", "max_tokens": 24, "ignore_eos": True, "stream": True, "temperature": 0}
    with httpx.Client(timeout=60) as slow_http, httpx.Client(timeout=60) as http:
        with slow_http.stream("POST", served.v1 + "/completions", json=body) as stalled:
            assert stalled.status_code == 200
            r = http.post(served.v1 + "/completions", json=dict(body, stream=False))
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 24
            # The stalled stream still has all its text, merged, when it reads at last.
            text = ""
            for line in stalled.iter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
            assert text == r.json()["choices"][0]["text"]
    assert served.wait_idle()


# ------------------------------------------------------------------ engine faults
def test_add_request_failing_unexpectedly_fails_that_request_only(served, monkeypatch, caplog):
    engine = served.engine
    real = engine.add_request
    calls = []

    def broken(*args, **kwargs):
        if not calls:
            calls.append(1)
            raise KeyError("internal detail")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine, "add_request", broken)
    r = post(served, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 500 and "internal detail" not in r.text
    assert any("internal detail" in rec.getMessage() or (rec.exc_text and "internal detail" in rec.exc_text)
               for rec in caplog.records)
    ok = post(served, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert ok.status_code == 200
    assert httpx.get(served.url + "/health").status_code == 200


@pytest.mark.slow  # the HTTP side of a dead engine: test_a_dead_engine_is_503_and_says_nothing_of_why
def test_steps_failing_in_a_row_mark_the_engine_dead(server_factory, monkeypatch):
    s = server_factory()
    monkeypatch.setattr(s.engine.runner, "execute", lambda batch: (_ for _ in ()).throw(RuntimeError("sticky")))
    for _ in range(3):
        r = post(s, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert r.status_code in (500, 503), r.text
    deadline = time.monotonic() + 10
    while httpx.get(s.url + "/health").status_code != 503:
        assert time.monotonic() < deadline, "/health stayed 200 after every step failed"
        time.sleep(0.05)
    r = post(s, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    assert "sticky" not in r.text and "sticky" not in httpx.get(s.url + "/health").text
    assert s.engine.block_manager.num_free_blocks == s.engine.block_manager.num_blocks


async def test_a_dead_engine_is_503_and_says_nothing_of_why(api, scripted):
    scripted.paused = True  # neither request may finish before the engine dies
    stream = asyncio.ensure_future(api.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1000,
                                                                      "ignore_eos": True, "stream": True}))
    whole = asyncio.ensure_future(api.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1000,
                                                                     "ignore_eos": True}))
    while len(scripted.added) < 2:
        await asyncio.sleep(0.001)
    scripted.kill()
    r = await whole
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_dead"
    r = await stream
    error, done = r.text.split("\n\n")[-3:-1]
    assert json.loads(error[6:])["error"]["code"] == "engine_dead" and done == "data: [DONE]"
    r = await apost(api, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    health = await api.get("/health")
    assert health.status_code == 503 and "the engine has stopped" in health.json()["error"]["message"]
    assert "scripted death" not in r.text + health.text
    metrics = await api.get("/metrics")  # a failed scrape, never a 500
    assert metrics.status_code == 503 and metrics.json()["error"]["code"] == "engine_dead"


# ------------------------------------------------------------------ no internals in responses
async def test_models_reveal_no_local_path(http):
    data = (await http.get("/v1/models")).json()["data"]
    assert data[0]["root"] == MODEL_NAME
    assert "/" not in json.dumps(data).replace("\\/", "")


async def test_unexpected_errors_say_where_to_look_not_what_broke(http, monkeypatch, caplog):
    monkeypatch.setattr(http.ctx, "check_model", lambda name: 1 / 0)
    r = await apost(http, "/v1/completions", {"prompt": "Hi"})
    assert r.status_code == 500
    message = r.json()["error"]["message"]
    assert "ZeroDivision" not in message and "division" not in message and "error id" in message
    error_id = message.rsplit("error id ", 1)[1].rstrip(")")
    assert any(error_id in rec.getMessage() for rec in caplog.records)


async def test_the_lifespan_stops_the_client_then_releases_its_engine(scripted, monkeypatch):
    calls = []
    monkeypatch.setattr(scripted, "stop", lambda timeout=10.0: calls.append("stop"))
    monkeypatch.setattr(scripted, "shutdown", lambda: calls.append("shutdown"))
    async with serve(scripted):
        assert calls == []
    assert calls == ["stop", "shutdown"]


@pytest.mark.slow  # the lifespan's order: test_the_lifespan_stops_the_client_then_releases_its_engine
def test_shutdown_stops_the_engine_workers(server_factory, monkeypatch):
    s = server_factory()
    calls = []
    monkeypatch.setattr(s.engine, "shutdown", lambda: calls.append(s.server.client.healthy))
    s.stop()
    assert calls == [False]  # once, after the engine loop had stopped
