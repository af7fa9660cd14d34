"""The `carpool serve` process: the engine loop on the main thread, uvicorn on a thread beside it.

torch's OpenMP pool is fastest driven from the main thread: the same decode loop measured 1.4x
(AMD EPYC) to 2x (Intel Xeon, 61.8 vs 31.5 ms per step, BENCHMARKS.md) slower on any other
thread (its workers then wake as if OMP_WAIT_POLICY were PASSIVE, once per parallel region,
~1,000 regions per step). So the main thread runs
`AsyncLLMEngine.run()`, and uvicorn, which only moves requests in and tokens out, runs its
event loop on a second thread. Signals land on the main thread: SIGTERM/SIGINT ask uvicorn to
stop accepting, drain in-flight requests for up to --shutdown-timeout seconds, and run the app's
lifespan end, which stops the engine loop; then the engine's workers are stopped and the
process exits 0.
"""

from __future__ import annotations

import gc
import logging
import signal
import sys
import threading

from carpool.config import EngineConfig
from carpool.server.options import ServerOptions

log = logging.getLogger("carpool.server")


def freeze_startup_objects() -> None:
    """Exempt what start-up built from the cyclic garbage collector, as vLLM does. The imports,
    the model and torch.compile's graphs are ~1 million objects that live as long as the
    process; every full collection walked them all: in a 16-request burst, full collections of
    100-470 ms (growing) stalled the engine loop, and one was the burst's largest inter-token gap."""
    gc.collect()
    gc.freeze()


def run_server(config: EngineConfig, options: ServerOptions) -> int:
    import uvicorn

    from carpool.engine import LLMEngine
    from carpool.server.app import create_app

    engine = LLMEngine(config)
    app = create_app(engine, options, engine_thread=False)
    async_engine = app.state.ctx.async_engine
    freeze_startup_objects()
    server = uvicorn.Server(uvicorn.Config(
        app, host=options.host, port=options.port, log_level=options.uvicorn_log_level,
        access_log=not options.disable_uvicorn_access_log, lifespan="on",
        timeout_graceful_shutdown=options.shutdown_timeout))

    def serve() -> None:
        try:
            server.run()
        finally:  # however uvicorn ends (stopped, or failed to bind), the engine loop ends too
            async_engine.stop()

    def request_stop(signum, frame) -> None:
        server.should_exit = True

    previous = {sig: signal.signal(sig, request_stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    http = threading.Thread(target=serve, name="carpool-http", daemon=True)
    try:
        http.start()
        print(f"carpool: serving {app.state.ctx.model_name!r} on http://{options.host}:{options.port}/v1",
              file=sys.stderr, flush=True)
        async_engine.run()  # returns once the lifespan ends or the engine dies
        if async_engine.error is not None:  # keep answering 503s until asked to stop
            while http.is_alive():
                http.join(0.5)
        http.join()
    finally:
        server.should_exit = True
        engine.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0 if server.started else 1
