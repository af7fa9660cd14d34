"""In-process servers for the API tests: uvicorn on a free loopback port in a background thread.

Model loading costs seconds, so one default server is shared by the whole session; tests that
need other settings (or that kill the engine loop) start their own.
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass

import httpx
import pytest
import uvicorn

from carpool import LLMEngine
from carpool.server.app import create_app
from carpool.server.options import ServerOptions
from carpool.server.serving import ServingContext

MODEL_NAME = "smol"
ENGINE_KWARGS = dict(dtype="float32", num_threads=2, kv_cache_memory=128 << 20, seed=0)


@dataclass
class Served:
    url: str
    engine: LLMEngine
    server: ServingContext
    uvicorn: uvicorn.Server
    thread: threading.Thread

    model_name: str = MODEL_NAME

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def wait_idle(self, timeout: float = 10.0) -> bool:
        return wait_idle(self.engine, timeout)

    def metric(self, name: str, **labels) -> float:
        return metric_value(self.url, name, **labels)

    def stop(self) -> None:
        self.uvicorn.should_exit = True
        self.thread.join(30)


def start_server(engine: LLMEngine, **app_kwargs) -> Served:
    app_kwargs.setdefault("served_model_name", [MODEL_NAME])
    app = create_app(engine, ServerOptions(**app_kwargs))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5,
                            access_log=False)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    return Served(f"http://127.0.0.1:{port}", engine, app.state.ctx, server, thread)


def wait_idle(engine: LLMEngine, timeout: float = 10.0) -> bool:
    """True once the engine holds no requests and every KV block is free again."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        bm = engine.block_manager
        if bm.num_free_blocks == bm.num_blocks and not engine.requests and not engine.has_unfinished_requests():
            return True
        time.sleep(0.02)
    return False


def metric_value(url: str, name: str, **labels) -> float:
    """One sample from /metrics (summing over label sets that match `labels`)."""
    text = httpx.get(url + "/metrics").text
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, label_text = head.partition("{")
        if metric != name:
            continue
        if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            total += float(value)
            found = True
    if not found:
        raise KeyError(f"{name} {labels} not in /metrics")
    return total


@pytest.fixture(scope="module")
def server_factory():
    """Start extra servers (own engine settings); they stop when the module ends."""
    started: list[Served] = []

    def make(engine_kwargs: dict | None = None, **app_kwargs) -> Served:
        engine = LLMEngine(**{**ENGINE_KWARGS, **(engine_kwargs or {})})
        s = start_server(engine, **app_kwargs)
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()


@pytest.fixture(scope="session")
def served():
    engine = LLMEngine(**ENGINE_KWARGS)
    s = start_server(engine)
    yield s
    s.stop()
