"""The `carpool serve` processes: the engine in one (its main thread runs the step loop), the
HTTP frontend in this one (uvicorn on the main thread), talking over a pipe (engine_process.py).

The engine's step loop is fastest on a main thread: torch's OpenMP pool then stays hot (the same
decode loop measured 1.4x (AMD EPYC) to 2x (Intel Xeon) slower per step on any other thread).
In its own process it also keeps the frontend's per-token Python off its GIL (on two cores the
two processes and the client still share the cores: BENCHMARKS.md). uvicorn handles the signals here: SIGTERM/SIGINT stop
accepting, drain in-flight requests for up to --shutdown-timeout seconds, and run the app's
lifespan end, which stops the engine process; then this process exits 0. If the engine process
dies, in-flight requests fail with a clear error, /health turns 503, and this process shuts down
the same way and exits 1 (as vLLM's frontend does), for a supervisor to restart the server.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import multiprocessing
import os
import signal
import sys
from dataclasses import dataclass
from multiprocessing.connection import Connection

from carpool.config import EngineConfig
from carpool.server.options import ServerOptions
from carpool.server.startup import freeze_startup_objects

log = logging.getLogger("carpool.server")


# ---------------------------------------------------------------- where each process runs

def plan_cpus(config: EngineConfig, environ=os.environ) -> tuple[dict[str, str], set[int] | None]:
    """Where the engine's OpenMP threads and the frontend run: (the engine process's extra
    environment, the frontend's cores), or ({}, None) to leave both to the OS.

    When the engine's threads take every core this process may use, the frontend has to share
    one. Left to the OS it lands on the core of the step's main thread: a step's outputs, written
    to the pipe, wake it there (a sync wake-up), and it preempts the main thread about once per
    token, stalling both threads. So OpenMP thread i is bound to core i and the frontend to the
    last core, where it runs while the last thread waits through the step's Python. libgomp's own
    spin before a waiting thread sleeps stays: with a short one (GOMP_SPINCOUNT 10000) the threads
    slept between the parallel regions inside a step, and a served 3B step took 142-173 ms in 6
    runs of 9 against 98-105 ms in the others; with the default, 91-110 ms in all 8 (2-core Zen 3
    VM; the 135M and 1B models: no difference). With spare cores, with TP/PP (more than one
    process), or with placement already set in the environment, nothing is bound."""
    cpus = sorted(os.sched_getaffinity(0))
    threads = config.num_threads or len(cpus)
    user_set = any(k in environ for k in ("OMP_PLACES", "OMP_PROC_BIND", "GOMP_CPU_AFFINITY"))
    if config.world_size > 1 or len(cpus) < 2 or threads != len(cpus) or user_set:
        return {}, None
    return {"OMP_PLACES": ",".join(f"{{{c}}}" for c in cpus), "OMP_PROC_BIND": "close"}, {cpus[-1]}


@dataclass
class StartingEngine:
    """An engine process started and loading; `EngineProcess` waits for it to say ready."""

    process: multiprocessing.Process
    conn: Connection


def _engine_main(placement: tuple[str, ...], *args) -> None:
    """The engine process's entry: it imports the engine there, so the frontend starts it
    before importing anything heavy itself. Once torch's libgomp has read the `placement`
    variables (plan_cpus), they leave the environment: another OpenMP runtime loaded later
    (sentencepiece bundles one) would find the main thread already bound to one core, and warn
    that its places shrank; and the engine's subprocesses (compiler workers) need not be bound."""
    importlib.import_module("torch")  # its libgomp reads the placement as it loads

    for key in placement:
        os.environ.pop(key, None)
    from carpool.server.engine_process import run_engine_process

    run_engine_process(*args)


def start_engine_process(config: EngineConfig, options: ServerOptions) -> StartingEngine:
    """Spawn the engine process for `config` (it loads the model meanwhile) and move this
    process's threads to the frontend's cores (plan_cpus)."""
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: no forked threads or torch state
    conn, child = context.Pipe()
    engine_env, frontend_cpus = plan_cpus(config)
    process = context.Process(target=_engine_main, name="carpool-engine",
                              args=(tuple(engine_env), config, options.model_names(config.model)[0],
                                    options.metrics_namespace, not options.disable_log_stats, child))
    saved = {k: os.environ.get(k) for k in engine_env}
    os.environ.update(engine_env)  # the spawned interpreter inherits it; libgomp reads it on load
    try:
        process.start()
    finally:
        for k, v in saved.items():
            if v is None:
                del os.environ[k]
            else:
                os.environ[k] = v
    child.close()
    if frontend_cpus is not None:
        os.sched_setaffinity(0, frontend_cpus)  # this thread, and the threads it starts from now on
    return StartingEngine(process, conn)


def _uvicorn_server_class():
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            """run_server's handlers stop it instead: uvicorn's would re-raise the signal once
            drained, and a SIGTERM would then kill the process instead of exiting 0."""
            yield

    return Server


def run_server(config: EngineConfig, options: ServerOptions) -> int:
    starting = start_engine_process(config, options)  # it loads while this process imports the server
    try:
        import torch
        import uvicorn

        from carpool.server.app import create_app
        from carpool.server.engine_process import EngineProcess

        engine = EngineProcess(starting.process, starting.conn, options.max_waiting_requests)
    except BaseException:  # a failed start, or Ctrl-C while the engine loads: it must not outlive us
        starting.process.kill()
        starting.process.join()
        raise
    try:
        torch.set_num_threads(1)  # the frontend runs no kernels; the engine process owns the cores
        app = create_app(engine, options)
        freeze_startup_objects()
        server = _uvicorn_server_class()(uvicorn.Config(
            app, host=options.host, port=options.port, log_level=options.uvicorn_log_level,
            access_log=not options.disable_uvicorn_access_log, lifespan="on",
            timeout_graceful_shutdown=options.shutdown_timeout))
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda signum, frame: setattr(server, "should_exit", True))
        engine.on_death = lambda: setattr(server, "should_exit", True)
        print(f"carpool: serving {app.state.ctx.model_name!r} on http://{options.host}:{options.port}/v1",
              file=sys.stderr, flush=True)
        server.run()
    finally:  # however uvicorn ended (stopped, or failed to bind), the engine process ends too
        engine.stop()
    if engine.error is not None:
        log.error("the engine process died; the server has shut down")
        return 1
    return 0 if server.started else 1
