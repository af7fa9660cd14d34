"""The engine in its own process, the HTTP frontend in another (vLLM v1's split).

With the frontend on a thread of the engine's process, its per-token Python (the event loop,
SSE chunks, socket writes) needed the GIL, and took it whenever the engine thread let go between
torch calls: the Python part of a batch-1 step measured ~0.3 ms longer served than in process
(BENCHMARKS.md, "The engine in its own process"). Here the engine process's main thread runs
nothing but the step loop, and the frontend has its own interpreter.

Wire: one duplex `multiprocessing` pipe.
- frontend -> engine: ("add", [(group key, index, request id, prompt ids, params, arrival)]),
  ("abort", [request ids]), ("metrics", token), ("stop",).
- engine -> frontend: ("ready", EngineInfo) once, then per loop iteration ("events", [(group
  key, method, args)], num waiting, num aborted) -- the same group calls the in-process loop
  makes on the event loop -- and ("metrics", token, body, content type) answers.

Faults: the engine process dies (killed, crashed) -> the frontend's event loop sees the pipe close,
fails every live request with EngineDeadError, /health and /metrics turn 503, and `on_death`
runs (`carpool serve` then shuts the frontend down and exits 1, as vLLM's does: a supervisor
restarts a server that cannot serve). The frontend dies -> the engine's reader sees the pipe
close and stops the loop; the process exits.
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import logging
import multiprocessing
import os
import pickle
import signal
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection

from carpool.config import EngineConfig
from carpool.outputs import Logprob, RequestOutput
from carpool.sampling_params import SamplingParams
from carpool.server.async_engine import AsyncLLMEngine, RequestGroup, _Abort, _Add
from carpool.server.engine_client import (
    DEAD_AFTER_ERROR,
    NOT_RUNNING,
    EngineDeadError,
    EngineInfo,
    EngineOverloadedError,
)
from carpool.server.metrics import ServerMetrics, StatsLog, num_speculative_tokens
from carpool.server.startup import freeze_startup_objects
from carpool.structured import StructuredOutputs

log = logging.getLogger("carpool.server")

READY_TIMEOUT = 600.0  # model load and compile warm-up


@dataclass
class OutputDelta:
    """The part of a RequestOutput that `Delta.merge` reads: what crosses the pipe per step
    (not the prompt or the token timestamps, which grow with the request)."""

    new_text: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, Logprob]]
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    error: str | None
    num_cached_tokens: int
    prompt_logprobs: list | None

    @classmethod
    def of(cls, out: RequestOutput) -> OutputDelta:
        return cls(out.new_text, out.new_token_ids, out.new_logprobs, out.finished, out.finish_reason,
                   out.stop_reason, out.error, out.num_cached_tokens, out.prompt_logprobs)


# ---------------------------------------------------------------- the engine process


class _EngineCore(AsyncLLMEngine):
    """The in-process loop, with groups as keys and their calls sent to the frontend."""

    def __init__(self, engine, conn, metrics):
        super().__init__(engine, metrics=metrics)
        self._conn = conn
        self._outbox: list[tuple[int, str, tuple]] = []
        self._send_lock = threading.Lock()  # the reader thread answers metrics requests

    def _call(self, group, method: str, *args) -> None:
        if method == "deliver":
            args = ([(index, OutputDelta.of(out)) for index, out in args[0]],)
        elif method in ("accepted", "fail") and args[-1] is not None:
            args = (*args[:-1], _picklable(args[-1]))
        self._outbox.append((group, method, args))

    def _flush(self) -> None:
        if not self._outbox:
            return
        events, self._outbox = self._outbox, []
        self.send(("events", events, self._engine_waiting, self.num_aborted))

    def send(self, message) -> None:
        with self._send_lock:
            try:
                self._conn.send(message)
            except (BrokenPipeError, OSError):  # the frontend is gone; the reader stops the loop
                pass


def _picklable(error: BaseException) -> BaseException:
    """Errors cross the pipe as the types the frontend handles (their messages kept)."""
    try:
        pickle.dumps(error)
        return error
    except (pickle.PicklingError, TypeError, AttributeError):
        return EngineDeadError(str(error))


def _read_commands(core: _EngineCore, conn, metrics) -> None:
    """The engine process's reader thread: the frontend's commands into the loop's queue."""
    try:
        while True:
            message = conn.recv()
            kind = message[0]
            if kind == "add":
                core._push([_Add(key, index, rid, prompt, params, arrival)
                            for key, index, rid, prompt, params, arrival in message[1]])
            elif kind == "abort":
                core._push([_Abort(rid) for rid in message[1]])
            elif kind == "metrics":
                body, content_type = metrics.render()
                core.send(("metrics", message[1], body, content_type))
            elif kind == "stop":
                break
    except (EOFError, OSError):
        log.info("the frontend has gone; stopping the engine")
    core.stop(timeout=0)


def run_engine_process(config: EngineConfig, model_name: str, metrics_namespace: str | None, log_stats: bool,
                       conn) -> None:
    """The engine process's main: load the engine, say ready, run the step loop on this (main)
    thread until the frontend says stop or goes away."""
    from carpool.engine import LLMEngine

    for sig in (signal.SIGINT, signal.SIGTERM):  # a signal to the whole group: the frontend drains, then stops us
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        engine = LLMEngine(config)
    except BaseException as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        raise
    try:
        metrics = ServerMetrics(model_name, engine.max_model_len, namespace=metrics_namespace,
                                stats_log=StatsLog() if log_stats else None,
                                num_speculative_tokens=num_speculative_tokens(engine))
        metrics.set_cache_config(engine.block_manager.num_blocks, engine.block_manager.block_size)
        core = _EngineCore(engine, conn, metrics)
        conn.send(("ready", EngineInfo.of(engine)))
        freeze_startup_objects()
        threading.Thread(target=_read_commands, args=(core, conn, metrics), name="carpool-commands",
                         daemon=True).start()
        core.run()
    finally:
        engine.shutdown()


# ---------------------------------------------------------------- the frontend


class EngineProcess:
    """The out-of-process `EngineClient`: the frontend's handle on the engine process, over the
    pipe. The event loop reads the pipe itself (`start`), so a step's tokens reach their
    handlers with one wake-up."""

    def __init__(self, process: multiprocessing.Process, conn: Connection, max_waiting_requests: int | None = None):
        """Wait for the engine process (server/launch.py started it; `conn` its end of the pipe)
        to say ready."""
        self.max_waiting_requests = max_waiting_requests
        self.process, self._conn = process, conn
        # "ready" brings the engine's tokenizer, pickled: import its classes (transformers, ~1 s)
        # while the engine loads, not after.
        importlib.import_module("transformers.tokenization_utils_fast")
        if not self._conn.poll(READY_TIMEOUT):
            self.process.kill()
            raise RuntimeError("the engine process did not start in time")
        try:
            message = self._conn.recv()
        except EOFError:
            self.process.join()
            raise RuntimeError(f"the engine process exited with {self.process.exitcode} while starting") from None
        if message[0] != "ready":
            self.process.join()
            raise RuntimeError(f"the engine process failed to start: {message[1]}")
        self.info: EngineInfo = message[1]  # its tokenizer a copy, unpickled here
        self.structured = StructuredOutputs(self.info.tokenizer, self.info.vocab_size, self.info.eos_token_ids)
        self.error: BaseException | None = None
        self.num_aborted = 0
        self._engine_waiting = 0
        self._num_pending_adds = 0
        self._groups: weakref.WeakValueDictionary[int, RequestGroup] = weakref.WeakValueDictionary()
        self._keys = itertools.count()
        self._metrics: dict[int, asyncio.Future] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False  # the pipe has closed: the process is gone
        self._stopping = False
        self.on_death: Callable[[], None] | None = None  # run on the event loop once the process has died

    # ------------------------------------------------------------ state
    @property
    def healthy(self) -> bool:
        return self._loop is not None and not self._closed and not self._stopping and self.error is None

    @property
    def num_waiting(self) -> int:
        return self._num_pending_adds + self._engine_waiting

    def dead_message(self) -> str:
        return DEAD_AFTER_ERROR if self.error is not None else NOT_RUNNING

    # ------------------------------------------------------------ lifecycle (event loop thread)
    def start(self) -> None:
        """Read the engine's messages on the running event loop (the app's lifespan calls this)."""
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._conn.fileno(), self._read)
        # uvloop's add_reader made the pipe non-blocking: a message longer than one read or write
        # would then fail halfway with BlockingIOError
        os.set_blocking(self._conn.fileno(), True)

    def stop(self, timeout: float = 10.0) -> None:
        """Ask the engine to finish (requests still running get EngineDeadError) and wait for
        its process to exit. Any thread."""
        self._stopping = True
        try:
            self._send(("stop",))
        except EngineDeadError:
            pass
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()

    def shutdown(self) -> None:
        """The engine shut itself down as its process ended (`stop`): nothing is left to release."""
        if self.process.is_alive():
            self.stop()

    # ------------------------------------------------------------ submitting (event loop thread)
    async def add_requests(self, entries: Sequence[tuple[list[int], SamplingParams]],
                           arrival_time: float | None = None, prefix: str | None = None) -> RequestGroup:
        """As AsyncLLMEngine.add_requests."""
        if not self.healthy:
            raise EngineDeadError(self.dead_message())
        prefix = prefix or uuid.uuid4().hex
        arrival = time.monotonic() if arrival_time is None else arrival_time  # one clock: CLOCK_MONOTONIC
        ids = [f"{prefix}-{i}" for i in range(len(entries))]
        group = RequestGroup(self, self._loop, ids)
        limit = self.max_waiting_requests
        if limit is not None and self.num_waiting + len(entries) > limit:
            raise EngineOverloadedError(f"the server is overloaded: {self.num_waiting} requests are waiting "
                                        f"(--max-waiting-requests {limit}); retry later")
        key = next(self._keys)
        self._send(("add", [(key, i, rid, list(prompt), params, arrival)
                            for i, (rid, (prompt, params)) in enumerate(zip(ids, entries))]))
        self._num_pending_adds += len(entries)
        self._groups[key] = group
        await group.wait_accepted()
        return group

    def abort(self, request_ids: list[str]) -> None:
        try:
            self._send(("abort", request_ids))
        except EngineDeadError:
            pass  # nothing left to abort

    async def render_metrics(self) -> tuple[bytes, str]:
        """The engine's Prometheus exposition (its metrics are recorded on its step loop)."""
        token = next(self._keys)
        future = self._metrics[token] = asyncio.get_running_loop().create_future()
        try:
            self._send(("metrics", token))
            return await asyncio.wait_for(future, 30)
        finally:
            self._metrics.pop(token, None)

    def _send(self, message) -> None:
        if self._closed:
            raise EngineDeadError(self.dead_message())
        try:
            self._conn.send(message)
        except OSError as exc:  # the process is gone; _read fails what was in flight
            raise EngineDeadError(self.dead_message()) from exc

    # ------------------------------------------------------------ the engine's messages
    def _read(self) -> None:
        """One message per call: the loop calls again while the pipe stays readable (a
        `poll(0)` per message, which builds a selector, cost more than the message itself)."""
        try:
            self._handle(self._conn.recv())
        except (EOFError, OSError):
            self._on_closed()

    def _handle(self, message) -> None:
        if message[0] == "events":
            _, events, self._engine_waiting, self.num_aborted = message
            for key, method, args in events:
                self._num_pending_adds -= method == "accepted"  # one per request added or refused
                group = self._groups.get(key)
                if group is not None:
                    getattr(group, method)(*args)
        elif message[0] == "metrics":
            future = self._metrics.get(message[1])
            if future is not None and not future.done():
                future.set_result((message[2], message[3]))

    def _on_closed(self) -> None:
        self._closed = True
        self._loop.remove_reader(self._conn.fileno())
        if not self._stopping:
            self.process.join(5)
            log.error("the engine process has died (exit code %s)", self.process.exitcode)
            self.error = EngineDeadError("the engine process has died")
        error = EngineDeadError("the server is shutting down" if self._stopping else self.dead_message())
        for group in list(self._groups.values()):
            group.fail(error)
        self._groups.clear()
        self._num_pending_adds = 0
        for future in self._metrics.values():
            if not future.done():
                future.set_exception(error)
        if self.error is not None and self.on_death is not None:
            self.on_death()

