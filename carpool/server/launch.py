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
import logging
import signal
import sys

from carpool.config import EngineConfig
from carpool.server.options import ServerOptions
from carpool.server.startup import freeze_startup_objects

log = logging.getLogger("carpool.server")


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
    import torch
    import uvicorn

    from carpool.server.app import create_app
    from carpool.server.engine_process import EngineProcess

    engine = EngineProcess.for_server(config, options)
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
