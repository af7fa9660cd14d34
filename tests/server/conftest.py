"""Servers for the API tests.

The HTTP contract (validation, response and chunk shapes, error bodies) is checked against a
scripted engine in process (`api`, scripted.py): no model, no sockets. What needs the model (the
tokens themselves, the KV cache, real faults) runs on real servers: uvicorn on a free loopback
port in a background thread over a real engine. Model loading costs seconds, so one default
server is shared by the whole session; tests that need other settings (or that kill the engine
loop) start their own.
"""

from __future__ import annotations

import gc
import socket
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import fastapi.dependencies.models
import httpx
import pytest
import uvicorn
from prometheus_client.parser import text_string_to_metric_families

from carpool import LLMEngine
from carpool.config import default_model_path
from carpool.server.app import create_app
from carpool.server.async_engine import AsyncLLMEngine
from carpool.server.options import ServerOptions
from carpool.server.serving import ServingContext
from carpool.structured import StructuredOutputs
from carpool.tokenizer import load_tokenizer
from tests.server.scripted import ScriptedEngine, serve

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
        """Stop serving and let go of the engine (a few hundred MB each)."""
        self.uvicorn.should_exit = True
        self.thread.join(30)
        forget_endpoints()


def forget_endpoints() -> None:
    """FastAPI keeps every endpoint function it has classified in module-level lru_caches, and an
    app's endpoints close over its engine: a stopped test server's engine (model, KV cache) would
    stay in memory for the rest of the session (about 19 GB by the end of a CI run)."""
    for name in ("_is_gen_callable_cached", "_is_async_gen_callable_cached", "_is_coroutine_callable_cached"):
        cache = getattr(fastapi.dependencies.models, name, None)
        if cache is not None:
            cache.cache_clear()
    gc.collect()  # the engine sits in reference cycles


def start_server(engine: LLMEngine, **app_kwargs) -> Served:
    app_kwargs.setdefault("served_model_name", [MODEL_NAME])
    options = ServerOptions(**app_kwargs)
    app = create_app(AsyncLLMEngine.for_server(engine, options), options)
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


def metric_sample(text: str, name: str, **labels) -> float:
    """One sample of a Prometheus exposition, summed over the label sets that match `labels`
    (a counter's sample is its name with `_total`, a histogram's `_count`, `_sum`, `_bucket`)."""
    values = [sample.value for family in text_string_to_metric_families(text) for sample in family.samples
              if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())]
    if not values:
        raise KeyError(f"{name} {labels} not in the exposition")
    return sum(values)


def metric_value(url: str, name: str, **labels) -> float:
    """One sample from the server's /metrics."""
    return metric_sample(httpx.get(url + "/metrics").text, name, **labels)


@pytest.fixture(scope="module")
def server_factory():
    """Start extra servers (own engine settings); they stop at `make.stop(server)` or when the
    module ends."""
    started: list[Served] = []

    def make(engine_kwargs: dict | None = None, **app_kwargs) -> Served:
        engine = LLMEngine(**{**ENGINE_KWARGS, **(engine_kwargs or {})})
        s = start_server(engine, **app_kwargs)
        started.append(s)
        return s

    def stop(s: Served) -> None:
        started.remove(s)
        s.stop()

    make.stop = stop
    yield make
    for s in started:
        s.stop()


@pytest.fixture(scope="session")
def served():
    engine = LLMEngine(**ENGINE_KWARGS)
    s = start_server(engine)
    yield s
    s.stop()


# ------------------------------------------------------------------ the scripted engine, in process
@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer(default_model_path())


@pytest.fixture(scope="session")
def structured(tokenizer):
    return StructuredOutputs(tokenizer, len(tokenizer), [tokenizer.eos_token_id])


@pytest.fixture
def scripted(tokenizer, structured) -> ScriptedEngine:
    return ScriptedEngine(tokenizer, structured, vocab_size=len(tokenizer))


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture
async def api(scripted, anyio_backend):
    """An httpx client on `create_app(scripted)` with the default options."""
    async with serve(scripted) as http:
        yield http


@asynccontextmanager
async def real_http(s: Served) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=s.url, timeout=60) as http:
        http.ctx = s.server
        http.wait_idle = s.wait_idle
        yield http


BOTH = ["scripted", pytest.param("real", marks=pytest.mark.slow)]


@pytest.fixture(params=BOTH)
async def http(request, anyio_backend):
    """A contract that holds whatever the engine: checked on the scripted engine in the default
    suite, and on the shared real server as well in the slow one. `http.ctx`: the ServingContext;
    `http.wait_idle()`: True once the engine holds no request."""
    if request.param == "scripted":
        async with serve(request.getfixturevalue("scripted")) as client:
            yield client
    else:
        async with real_http(request.getfixturevalue("served")) as client:
            yield client


@pytest.fixture(params=BOTH)
def make_http(request, anyio_backend):
    """`async with make_http(**server options) as http`: a server of its own with those options,
    on the scripted engine (default suite) or a real engine (slow suite; stopped after the test)."""
    if request.param == "scripted":
        yield lambda **options: serve(request.getfixturevalue("scripted"), **options)
        return
    factory, made = request.getfixturevalue("server_factory"), []

    def make(**options):
        made.append(factory(**options))
        return real_http(made[-1])

    yield make
    for s in made:
        factory.stop(s)
