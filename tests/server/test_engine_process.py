"""`carpool serve`'s process layout: the engine in its own process, the frontend over a pipe.
A killed engine process fails its in-flight requests with a clear error, and the frontend then
exits 1 (as vLLM's does). Each of the real servers here is a process of its own (slow
suite); the default suite's real `carpool serve` is test_server_sigterm.py's, which checks the
two processes as well."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from carpool.config import EngineConfig
from carpool.server.launch import plan_cpus
from tests.server.serve_process import start_serve


def engine_pid(frontend: subprocess.Popen) -> int:
    """The engine process's pid (the frontend's one child besides multiprocessing's resource tracker)."""
    engines = [c for c in psutil.Process(frontend.pid).children() if "spawn_main" in " ".join(c.cmdline())]
    assert len(engines) == 1, engines  # beside it only multiprocessing's resource tracker
    return engines[0].pid


@pytest.fixture
def server():
    p, url = start_serve("--dtype", "float32", "--num-threads", "1", "--kv-cache-memory", "64MiB",
                         "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log", "--shutdown-timeout", "2")
    yield p, url
    if p.poll() is None:
        p.kill()
        p.wait()


@pytest.mark.slow  # also checked on test_server_sigterm.py's server
def test_two_processes_and_the_engine_process_ends_with_the_frontend(server):
    p, url = server
    pid = engine_pid(p)
    out = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "ignore_eos": True}).json()
    assert out["usage"]["completion_tokens"] == 4
    metrics = httpx.get(url + "/metrics").text  # recorded in the engine process, served by the frontend
    assert "generation_tokens_total" in metrics
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=60) == 0
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.mark.slow  # the answers to a dead engine: test_server_hardening.py, on the scripted engine
def test_killed_engine_process_fails_in_flight_requests_then_the_frontend_exits_1(server):
    """kill -9 of the engine: the stream in flight ends with an error event, /health and /metrics
    answer 503 (never 500) while the frontend shuts down, and it exits 1 within 10 s."""
    p, url = server
    chunks: list[dict] = []
    errors: list[str] = []
    started = threading.Event()

    def stream():
        body = {"prompt": "Once upon a time", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as http, http.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                errors.append(f"HTTP {r.status_code}: {r.read()!r}")
                started.set()
            for line in r.iter_lines():
                if line.startswith("data:") and line != "data: [DONE]":
                    chunk = json.loads(line[5:])
                    (errors.append(chunk["error"]["message"]) if "error" in chunk else chunks.append(chunk))
                    started.set()

    reader = threading.Thread(target=stream, daemon=True)
    reader.start()
    assert started.wait(60) and chunks, errors
    os.kill(engine_pid(p), signal.SIGKILL)
    killed = time.monotonic()
    statuses = set()
    while p.poll() is None and time.monotonic() - killed < 15:
        for path in ("/metrics", "/health"):
            try:
                statuses.add((path, httpx.get(url + path, timeout=2).status_code))
            except httpx.TransportError:  # no longer listening
                pass
        time.sleep(0.05)
    assert p.wait(timeout=1) == 1 and time.monotonic() - killed < 10
    assert not any(status == 500 for _, status in statuses), statuses
    reader.join(10)
    assert not reader.is_alive()
    assert len(chunks) < 1000
    assert errors and "engine" in errors[0]  # the stream ended with a clear error, not a hang
    assert "the engine process has died" in p.stdout.read()


def allowed_cpus(pid: int, tid: int) -> set[int]:
    text = Path(f"/proc/{pid}/task/{tid}/status").read_text().split("Cpus_allowed_list:")[1].split()[0]
    cpus: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def test_cpu_plan_binds_only_an_engine_that_takes_every_core():
    cpus = sorted(os.sched_getaffinity(0))
    whole = EngineConfig(model="m", num_threads=len(cpus))
    env, frontend = plan_cpus(whole, environ={})
    if len(cpus) < 2:
        assert (env, frontend) == ({}, None)
        return
    assert env["OMP_PLACES"] == ",".join(f"{{{c}}}" for c in cpus) and env["OMP_PROC_BIND"] == "close"
    assert frontend == {cpus[-1]} and "GOMP_SPINCOUNT" not in env  # libgomp's own spin (launch.plan_cpus)
    assert plan_cpus(whole, environ={"OMP_PLACES": "cores"}) == ({}, None)
    assert plan_cpus(EngineConfig(model="m", num_threads=len(cpus) - 1), environ={}) == ({}, None)
    assert plan_cpus(EngineConfig(model="m", num_threads=len(cpus), tensor_parallel_size=2), environ={}) == ({}, None)


@pytest.mark.slow  # the plan: test_cpu_plan_binds_only_an_engine_that_takes_every_core
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="binding needs two cores")
def test_an_engine_on_every_core_is_bound_one_thread_per_core_and_the_frontend_beside_its_last():
    cpus = sorted(os.sched_getaffinity(0))
    p, url = start_serve("--num-threads", str(len(cpus)), "--kv-cache-memory", "64MiB", "--uvicorn-log-level",
                         "warning", "--disable-uvicorn-access-log", "--shutdown-timeout", "2")
    try:
        out = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "ignore_eos": True}).json()
        assert out["usage"]["completion_tokens"] == 4  # the step's parallel regions have started every thread
        engine = engine_pid(p)
        bound = [allowed_cpus(engine, int(tid)) for tid in os.listdir(f"/proc/{engine}/task")]
        assert allowed_cpus(engine, engine) == {cpus[0]}  # the main thread runs the step loop
        assert all({c} in bound for c in cpus)  # one OpenMP thread per core
        assert allowed_cpus(p.pid, p.pid) == {cpus[-1]}
    finally:
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 0


def test_an_engine_that_fails_to_start_does_not_outlive_the_frontend(monkeypatch):
    """`carpool serve` starts the engine process before its own imports; a failure (or Ctrl-C)
    before the engine is ready kills that process instead of leaving it loading."""
    from carpool.server import engine_process, launch
    from carpool.server.options import ServerOptions

    class Process:
        calls: list[str] = []

        def kill(self):
            self.calls.append("kill")

        def join(self):
            self.calls.append("join")

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "start_engine_process", lambda config, options: launch.StartingEngine(Process(), None))
    monkeypatch.setattr(engine_process, "EngineProcess", interrupted)
    with pytest.raises(KeyboardInterrupt):
        launch.run_server(EngineConfig(model="m.gguf"), ServerOptions())
    assert Process.calls == ["kill", "join"]
