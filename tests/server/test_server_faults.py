"""Faults that the server survives: a request failing while it generates (its error body and
stream event, on the scripted engine), and on the real engine a failing step and clients that
vanish mid-request (their KV blocks come back)."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

MODEL_NAME = "smol"


@pytest.mark.anyio
async def test_a_failed_request_is_a_500_naming_the_request_not_the_fault(api, scripted):
    scripted.fail_after = (3, "RuntimeError: injected fault")
    r = await api.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 8, "n": 2})
    error = r.json()["error"]
    assert r.status_code == 500 and error["code"] == "engine_error" and error["type"] == "server_error"
    assert "injected" not in error["message"] and "RuntimeError" not in error["message"]
    request_id = error["message"].rsplit("request id ", 1)[1].rstrip(")")
    assert request_id.startswith("cmpl-")
    r = await api.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Tell me a story"}],
                                                      "max_tokens": 50, "stream": True})
    lines = [line for line in r.text.splitlines() if line.startswith("data: ")]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]" and len(lines) == 1 + 3 + 2  # role, 3 tokens
    error = json.loads(lines[-2][6:])["error"]
    assert error["code"] == "engine_error" and "the engine failed while generating this request" in error["message"]
    scripted.fail_after = None
    r = await api.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "ignore_eos": True})
    assert r.json()["usage"]["completion_tokens"] == 4 and (await api.get("/health")).status_code == 200


@pytest.fixture
def client(served):
    return openai.OpenAI(base_url=served.v1, api_key="unused", max_retries=0, timeout=60)


def fail_next_steps(monkeypatch, engine, times: int = 1) -> list[int]:
    """Make the next `times` model executions raise; returns a counter of failures."""
    original = engine.runner.execute
    failures = []

    def execute(batch):
        if len(failures) < times:
            failures.append(len(batch))
            raise RuntimeError("injected fault")
        return original(batch)

    monkeypatch.setattr(engine.runner, "execute", execute)
    return failures


def test_step_exception_fails_the_batch_with_500_and_server_goes_on(served, client, monkeypatch, caplog):
    failures = fail_next_steps(monkeypatch, served.engine)
    r = httpx.post(served.v1 + "/completions", json={"prompt": "Hello", "max_tokens": 8, "n": 2}, timeout=30)
    assert r.status_code == 500
    err = r.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "engine_error"
    # The response names no internals; the log has them, under the request id it gives.
    assert "injected fault" not in err["message"] and "RuntimeError" not in err["message"]
    request_id = err["message"].rsplit("request id ", 1)[1].rstrip(")")
    assert any(request_id in rec.getMessage() and "injected fault" in rec.getMessage() for rec in caplog.records)
    assert failures == [2]  # both choices were in the failing batch
    assert served.wait_idle()
    # The server goes on with new requests, and stays healthy.
    out = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 4
    assert httpx.get(served.url + "/health").status_code == 200


@pytest.mark.slow  # the event's shape: test_a_failed_request_is_a_500_naming_the_request_not_the_fault
def test_step_exception_mid_stream_sends_an_error_event(served, client, monkeypatch):
    stream = client.chat.completions.create(model=MODEL_NAME, stream=True, max_tokens=50,
                                            messages=[{"role": "user", "content": "Tell me a story"}],
                                            extra_body={"ignore_eos": True})
    got = []
    with pytest.raises(openai.APIError) as e:
        for chunk in stream:
            got.append(chunk)
            if len(got) == 3:  # a few tokens in, the next step blows up
                fail_next_steps(monkeypatch, served.engine)
    assert "the engine failed while generating this request" in str(e.value)
    assert 3 <= len(got) < 50
    assert served.wait_idle()
    out = client.chat.completions.create(model=MODEL_NAME, max_tokens=3,
                                         messages=[{"role": "user", "content": "Hi"}],
                                         extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 3


def test_client_disconnect_mid_stream_frees_kv_blocks(served):
    engine = served.engine
    idle_free = engine.block_manager.num_free_blocks
    assert idle_free == engine.block_manager.num_blocks
    aborted = served.server.client.num_aborted
    body = {"prompt": "Write a long essay about the sea. " * 20, "max_tokens": 1000, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", served.v1 + "/completions", json=body) as r:
            assert r.status_code == 200
            chunks = []
            for line in r.iter_lines():
                if line.startswith("data:"):
                    chunks.append(line)
                    if len(chunks) == 3:
                        break
            assert engine.block_manager.num_free_blocks < idle_free  # it holds KV blocks now
    # 1000 tokens would take far longer than this: the blocks come back because of the abort.
    assert served.wait_idle(timeout=10)
    assert engine.block_manager.num_free_blocks == idle_free
    assert served.server.client.num_aborted == aborted + 1
    assert served.metric("carpool:num_requests_running") == 0


def test_client_disconnect_while_waiting_for_a_full_response(served):
    engine = served.engine
    aborted = served.server.client.num_aborted
    start = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.v1 + "/completions", json={"prompt": "Hello", "max_tokens": 1000, "ignore_eos": True},
                   timeout=1.0)
    assert served.wait_idle(timeout=10)
    assert time.monotonic() - start < 10
    assert served.server.client.num_aborted == aborted + 1
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
