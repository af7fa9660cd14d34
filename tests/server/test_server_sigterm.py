"""`carpool serve` as a real process: CLI flags, --api-key, the engine in a process of its own
(its metrics served by the frontend), and graceful SIGTERM, after which both processes are gone."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import openai
import psutil
import pytest

from tests.server.conftest import metric_sample
from tests.server.serve_process import start_serve
from tests.server.test_engine_process import engine_pid

KEY = "sekret"
SHUTDOWN_TIMEOUT = 4.0


@pytest.fixture(scope="module")
def proc():
    p, url = start_serve(
        "--api-key", KEY, "--served-model-name", "tiny", "alias", "--dtype", "float32", "--num-threads", "1",
        "--kv-cache-memory", "64MiB", "--shutdown-timeout", str(SHUTDOWN_TIMEOUT),
        "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log",
        # a typical `vllm serve` command line's flags: honoured, mapped or ignored with a warning
        "--gpu-memory-utilization", "0.9", "--enforce-eager", "--trust-remote-code",
        "--disable-log-requests", "--enable-chunked-prefill", "--generation-config", "auto",
        "--allowed-origins", '["http://localhost:3000"]', "--max-log-len", "100", "--disable-log-stats")
    yield p, url
    if p.poll() is None:
        p.kill()
        p.wait()


def test_api_key(proc):
    _, url = proc
    r = httpx.get(url + "/v1/models")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.post(url + "/tokenize", json={"prompt": "x"}).status_code == 401
    assert httpx.get(url + "/health").status_code == 200  # probes need no key
    assert httpx.get(url + "/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["tiny", "alias"]
    out = client.completions.create(model="alias", prompt="Hi", max_tokens=3, extra_body={"ignore_eos": True})
    assert out.model == "tiny" and out.usage.completion_tokens == 3
    # recorded in the engine process, served by the frontend
    assert metric_sample(httpx.get(url + "/metrics").text, "carpool:generation_tokens_total") >= 3


class StreamReader(threading.Thread):
    def __init__(self, url: str, max_tokens: int):
        super().__init__(daemon=True)
        self.url, self.max_tokens = url, max_tokens
        self.chunks: list[dict] = []
        self.done = False
        self.error: Exception | None = None
        self.started = threading.Event()

    def run(self):
        body = {"prompt": "Once upon a time", "max_tokens": self.max_tokens, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        try:
            with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as http:
                with http.stream("POST", self.url + "/v1/completions", json=body) as r:
                    r.raise_for_status()
                    for line in r.iter_lines():
                        if line == "data: [DONE]":
                            self.done = True
                        elif line.startswith("data:"):
                            self.chunks.append(json.loads(line[5:]))
                            self.started.set()
        except Exception as exc:  # the long stream gets cut off at the shutdown timeout
            self.error = exc
        finally:
            self.started.set()


def test_sigterm_drains_in_flight_requests_then_exits_0(proc):
    p, url = proc
    engine = engine_pid(p)
    short, long = StreamReader(url, 12), StreamReader(url, 1000)
    short.start()
    long.start()
    assert short.started.wait(30) and long.started.wait(30)
    assert short.chunks and long.chunks
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    with pytest.raises(httpx.TransportError):  # no longer accepting connections
        httpx.get(url + "/health", timeout=2)
    short.join(30)
    assert short.error is None and short.done, short.error
    assert short.chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert short.chunks[-1]["usage"]["completion_tokens"] == 12  # finished in full
    assert p.wait(timeout=60) == 0
    assert not psutil.pid_exists(engine) or psutil.Process(engine).status() == psutil.STATUS_ZOMBIE
    elapsed = time.monotonic() - t0
    assert elapsed < SHUTDOWN_TIMEOUT + 10
    long.join(10)
    assert not long.done  # 1000 tokens do not fit in the shutdown timeout: cut off, not awaited forever
    assert len(long.chunks) < 1000
