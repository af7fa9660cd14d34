"""Drive a (thread-unsafe) LLMEngine from asyncio.

One thread owns the engine and is the only one that calls `add_request`, `abort_request` and
`step`: the process's main thread under `carpool serve` (torch's OpenMP pool stays hot there;
the same loop on any other thread measured 1.4-2x slower per step), or a background thread for
embedding and tests (`start()`). Coroutines on the event loop hand it commands through a locked
list; before every step the loop drains that list, so adds and aborts land between iterations.
Each step's outputs go back to the event loop through a `LoopWaker`, one callback per request
group.

A `RequestGroup` is the engine requests of one HTTP request (n choices x prompts). Its engine
requests produce deltas (`output_kind="delta"`), and deltas that its reader has not taken yet
are merged per choice, so a client that stops reading holds O(output length) memory, never a
queue that grows with every step.

Faults: a request the engine refuses (ValueError) is a 400 for that HTTP request only; any other
exception from `add_request` fails that request alone (500) and the loop goes on. A step that
fails fails its batch (the engine does that); `max_consecutive_failed_steps` such steps in a row
mean a sticky fault, and, as when `step()` itself raises, the loop dies: every live group gets
`EngineDeadError`, new submissions are refused, and `healthy` turns False (/health 503).
"""

from __future__ import annotations

import asyncio
import collections
import copy
import ctypes
import logging
import os
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property

import torch
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from carpool.engine import LLMEngine
from carpool.outputs import Logprob, RequestOutput
from carpool.sampling_params import SamplingParams
from carpool.server.engine_client import (
    DEAD_AFTER_ERROR,
    NOT_RUNNING,
    EngineClient,
    EngineDeadError,
    EngineInfo,
    EngineOverloadedError,
    RequestFailedError,
    RequestRejectedError,
)
from carpool.server.metrics import ServerMetrics, StatsLog, num_speculative_tokens
from carpool.server.options import ServerOptions

log = logging.getLogger("carpool.server")

MAX_CONSECUTIVE_FAILED_STEPS = 3


_libc = ctypes.PyDLL(None)  # PyDLL: its calls keep the GIL
_libc.write.argtypes, _libc.write.restype = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t], ctypes.c_ssize_t


class LoopWaker:
    """Runs callbacks on an event loop, called from the engine thread.

    `call_soon_threadsafe` wakes the loop with a socket send, which lets the GIL go: the loop's
    thread, just woken, takes it and streams the step's tokens while the engine thread waits
    to get it back -- its per-token work lands in the middle of every step. Here the wake-up
    byte is written with the GIL held, so the loop's thread runs when the engine next lets
    the GIL go: during the step's long C calls (the fused layers, torch's kernels)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        """On the loop's own thread."""
        self._loop = weakref.ref(loop)  # weak: wakers are kept per loop, keyed by the loop
        self.callbacks: collections.deque = collections.deque()
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)  # a full pipe already has a wake-up pending
        loop.add_reader(self._read_fd, self._run)
        weakref.finalize(loop, os.close, self._read_fd)
        weakref.finalize(loop, os.close, self._write_fd)

    def call(self, fn, *args) -> None:
        loop = self._loop()
        if loop is None or loop.is_closed():
            return  # nobody is listening any more
        self.callbacks.append((fn, args))
        _libc.write(self._write_fd, b"\0", 1)

    def _run(self) -> None:
        try:
            os.read(self._read_fd, 1 << 16)  # before taking callbacks: a later write wakes again
        except BlockingIOError:
            pass
        while self.callbacks:
            fn, args = self.callbacks.popleft()
            try:
                fn(*args)
            except Exception:  # as the loop itself treats a failing callback: log, go on
                log.exception("callback %r failed", fn)


@dataclass
class _Add:
    group: RequestGroup
    index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float


@dataclass
class _Abort:
    request_id: str


@dataclass
class Delta:
    """What one choice produced since its reader last looked: merged engine deltas."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None  # once, with the first token
    _parts: list[str] = field(default_factory=list, repr=False)

    def merge(self, out: RequestOutput) -> None:
        self.num_cached_tokens = out.num_cached_tokens
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self._parts.append(out.new_text)
        self.token_ids.extend(out.new_token_ids)
        self.logprobs.extend(out.new_logprobs)
        self.finished, self.finish_reason = out.finished, out.finish_reason
        self.stop_reason, self.error = out.stop_reason, out.error

    def seal(self) -> Delta:
        self.text = "".join(self._parts)
        self._parts = []
        return self


class RequestGroup:
    """The engine requests behind one HTTP request; iterate it for (index, Delta). Its client
    reports to it on its event loop: `accepted` per request, `deliver` for outputs, `fail`."""

    def __init__(self, client: EngineClient, loop: asyncio.AbstractEventLoop, request_ids: list[str],
                 waker: LoopWaker | None = None):
        """`waker`: how the engine thread reaches `loop` (AsyncLLMEngine); None for a client
        whose calls already arrive on the loop."""
        self._client = client
        self._waker = waker
        self.request_ids = request_ids
        self._pending: dict[int, Delta] = {}  # merged deltas not yet taken, by choice index
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self._accepted = loop.create_future()
        # Mark a failure as retrieved even if the handler is gone (no "never retrieved" noise).
        self._accepted.add_done_callback(lambda f: f.cancelled() or f.exception())
        self._num_added = 0
        self._finished: set[int] = set()
        self._aborted = False

    def __len__(self) -> int:
        return len(self.request_ids)

    # ---------------------------------------------------- the client's side, on the group's event loop
    def accepted(self, index: int, error: BaseException | None) -> None:
        if self._accepted.done():
            return
        if error is not None:
            self._accepted.set_exception(error)
            return
        self._num_added += 1
        if self._num_added == len(self.request_ids):
            self._accepted.set_result(None)

    def deliver(self, items: list[tuple[int, RequestOutput]]) -> None:
        for index, out in items:
            self._pending.setdefault(index, Delta()).merge(out)
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        if not self._accepted.done():
            self._accepted.set_exception(error)
        self._error = error
        self._ready.set()

    # ---------------------------------------------------- for the request handler
    async def wait_accepted(self) -> None:
        try:
            await asyncio.shield(self._accepted)
        except BaseException:
            self.abort()
            raise

    @property
    def finished(self) -> bool:
        return len(self._finished) == len(self.request_ids)

    async def __aiter__(self) -> AsyncIterator[tuple[int, Delta]]:
        while not self.finished:
            await self._ready.wait()
            self._ready.clear()
            pending, self._pending = self._pending, {}
            for index in sorted(pending):
                delta = pending[index].seal()
                if delta.finished:
                    self._finished.add(index)
                yield index, delta
            if self._error is not None and not self.finished:
                raise self._error

    def abort(self) -> None:
        """Abort every engine request of the group that has not finished (idempotent)."""
        if self._aborted or self.finished:
            return
        self._aborted = True
        self._client.abort([rid for i, rid in enumerate(self.request_ids) if i not in self._finished])


class AsyncLLMEngine:
    """The in-process `EngineClient`: an LLMEngine stepped by a loop on one thread, fed from
    the event loop. It owns the engine: `shutdown` shuts the engine down."""

    def __init__(self, engine: LLMEngine, max_waiting_requests: int | None = None,
                 metrics: ServerMetrics | None = None,
                 max_consecutive_failed_steps: int = MAX_CONSECUTIVE_FAILED_STEPS):
        if max_waiting_requests is not None and max_waiting_requests < 0:
            raise ValueError("max_waiting_requests must be >= 0")
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self.max_consecutive_failed_steps = max_consecutive_failed_steps
        self.metrics = metrics  # recorded on the engine thread after every step
        self._cond = threading.Condition()
        self._commands: list[_Add | _Abort] = []
        self._num_pending_adds = 0      # queued _Add commands not yet handed to the engine
        self._engine_waiting = 0        # len(scheduler.waiting) as of the last drain or step
        self._stop = False
        self._running = False
        self._thread: threading.Thread | None = None
        self._routes: dict[str, tuple[RequestGroup, int]] = {}  # engine thread only
        self.error: BaseException | None = None
        self.num_aborted = 0
        self._torch_threads = torch.get_num_threads()
        self._wakers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # one per event loop

    @classmethod
    def for_server(cls, engine: LLMEngine, options: ServerOptions) -> AsyncLLMEngine:
        """The client `create_app` takes for an engine of this process: its waiting limit and
        metrics as the server's options say (EngineProcess, started by server/launch.py, is the other kind)."""
        metrics = ServerMetrics(options.model_names(engine.config.model)[0], engine.max_model_len,
                                namespace=options.metrics_namespace,
                                stats_log=None if options.disable_log_stats else StatsLog(),
                                num_speculative_tokens=num_speculative_tokens(engine))
        metrics.set_cache_config(engine.block_manager.num_blocks, engine.block_manager.block_size)
        return cls(engine, options.max_waiting_requests, metrics=metrics)

    @cached_property
    def info(self) -> EngineInfo:
        """The engine thread detokenizes with engine.tokenizer; the frontend gets its own copy,
        so that two threads never share one tokenizer object."""
        info = EngineInfo.of(self.engine)
        try:
            return replace(info, tokenizer=copy.deepcopy(info.tokenizer))
        except Exception:  # pragma: no cover - tokenizers that cannot be copied
            return info

    @property
    def structured(self):
        """The engine's own: a constraint compiled while preparing is cached for the engine thread."""
        return self.engine.structured

    # ------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Run the loop on a background thread (for embedding and tests)."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self.run, name="carpool-engine", daemon=True)
        self._thread.start()

    def run(self) -> None:
        """Run the engine loop on the calling thread until `stop()` or the engine dies."""
        with self._cond:
            if self._stop:
                return
            self._running = True
        try:
            self._loop()
        finally:
            self._running = False

    def stop(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    @property
    def healthy(self) -> bool:
        return self._running and self.error is None and not self._stop

    @property
    def num_waiting(self) -> int:
        """Requests accepted but not yet running: queued for the engine plus its waiting queue."""
        with self._cond:
            return self._num_pending_adds + self._engine_waiting

    def dead_message(self) -> str:
        return DEAD_AFTER_ERROR if self.error is not None else NOT_RUNNING

    async def render_metrics(self) -> tuple[bytes, str]:
        if self.metrics is None:
            return b"", CONTENT_TYPE_LATEST
        return self.metrics.render()

    def shutdown(self) -> None:
        self.engine.shutdown()

    # ------------------------------------------------------------ submitting (event loop thread)
    async def add_requests(self, entries: Sequence[tuple[list[int], SamplingParams]],
                           arrival_time: float | None = None, prefix: str | None = None) -> RequestGroup:
        """Queue one engine request per (prompt ids, params); return once the engine has
        accepted them all. Raises EngineOverloadedError, EngineDeadError, RequestRejectedError
        (the engine's ValueError) or RequestFailedError -- then nothing stays queued."""
        if not self.healthy:
            raise EngineDeadError(self.dead_message())
        loop = asyncio.get_running_loop()
        prefix = prefix or uuid.uuid4().hex
        arrival = time.monotonic() if arrival_time is None else arrival_time
        ids = [f"{prefix}-{i}" for i in range(len(entries))]
        waker = self._wakers.get(loop)
        if waker is None:
            waker = self._wakers[loop] = LoopWaker(loop)
        group = RequestGroup(self, loop, ids, waker)
        commands = [_Add(group, i, rid, list(p), sp, arrival) for i, (rid, (p, sp)) in enumerate(zip(ids, entries))]
        with self._cond:
            limit = self.max_waiting_requests
            if limit is not None and self._num_pending_adds + self._engine_waiting + len(entries) > limit:
                raise EngineOverloadedError(
                    f"the server is overloaded: {self._num_pending_adds + self._engine_waiting} requests are "
                    f"waiting (--max-waiting-requests {limit}); retry later")
            self._num_pending_adds += len(commands)
            self._commands.extend(commands)
            self._cond.notify_all()
        await group.wait_accepted()
        return group

    def abort(self, request_ids: list[str]) -> None:
        self._push([_Abort(rid) for rid in request_ids])

    def _push(self, commands: list[_Add | _Abort]) -> None:
        with self._cond:
            self._commands.extend(commands)
            self._cond.notify_all()

    # ------------------------------------------------------------ the engine thread
    def _take_commands(self) -> list[_Add | _Abort]:
        with self._cond:
            while not self._commands and not self._stop and not self.engine.has_unfinished_requests():
                self._cond.wait()
            commands, self._commands = self._commands, []
            return commands

    def _apply(self, commands: list[_Add | _Abort]) -> None:
        engine = self.engine
        num_aborted = 0
        try:
            for cmd in commands:
                if isinstance(cmd, _Add):
                    self._add(cmd)
                else:
                    self._routes.pop(cmd.request_id, None)
                    if engine.abort_request(cmd.request_id):
                        num_aborted += 1
        finally:
            adds = sum(isinstance(c, _Add) for c in commands)
            with self._cond:
                self._num_pending_adds -= adds
                self._engine_waiting = len(engine.scheduler.waiting)
        if num_aborted:
            self.num_aborted += num_aborted
            if self.metrics is not None:
                self.metrics.on_abort(engine, num_aborted)

    def _add(self, cmd: _Add) -> None:
        try:
            self.engine.add_request(cmd.prompt_ids, cmd.params, request_id=cmd.request_id,
                                    arrival_time=cmd.arrival_time)
        except ValueError as exc:
            error: BaseException | None = RequestRejectedError(cmd.index, str(exc))
        except Exception:
            log.exception("add_request failed for %s", cmd.request_id)
            error = RequestFailedError("the server failed to queue this request; see the server log")
        else:
            self._routes[cmd.request_id] = (cmd.group, cmd.index)
            error = None
        self._call(cmd.group, "accepted", cmd.index, error)

    def _loop(self) -> None:
        torch.set_num_threads(self._torch_threads)
        engine = self.engine
        try:
            while True:
                self._flush()
                commands = self._take_commands()
                if self._stop:
                    self._fail_all(EngineDeadError("the server is shutting down"), commands)
                    return
                self._apply(commands)
                if not engine.has_unfinished_requests():
                    continue
                stats = engine.iteration_stats
                last = stats[-1] if stats else None
                outputs = engine.step()
                new_stats = stats[-1] if stats and stats[-1] is not last else None
                with self._cond:
                    self._engine_waiting = len(engine.scheduler.waiting)
                if self.metrics is not None:
                    try:
                        self.metrics.on_step(engine, outputs, new_stats)
                    except Exception:  # metrics must never take the engine down
                        log.exception("recording the metrics failed")
                self._dispatch(outputs)
                failed = engine.num_consecutive_failed_steps
                if failed >= self.max_consecutive_failed_steps:
                    raise EngineDeadError(f"{failed} engine steps in a row failed")
                if not outputs and new_stats is None:
                    time.sleep(0.001)  # nothing could be scheduled; do not spin
        except BaseException as exc:
            self.error = exc
            log.exception("the engine loop died")
            with self._cond:
                commands, self._commands = self._commands, []
            self._fail_all(EngineDeadError(self.dead_message()), commands)
        finally:
            self._flush()

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        by_group: dict[RequestGroup, list] = {}
        for out in outputs:
            route = self._routes.get(out.request_id)
            if route is None:
                continue  # aborted meanwhile
            group, index = route
            if out.finished:
                del self._routes[out.request_id]
            if out.error:
                log.error("request %s failed: %s", out.request_id, out.error)
            by_group.setdefault(group, []).append((index, out))
        for group, items in by_group.items():
            self._call(group, "deliver", items)

    def _fail_all(self, error: BaseException, pending: list[_Add | _Abort]) -> None:
        groups = {g: None for g, _ in self._routes.values()}
        groups.update({c.group: None for c in pending if isinstance(c, _Add)})
        for request_id in list(self._routes):  # free their blocks if the engine still can
            try:
                self.engine.abort_request(request_id)
            except Exception:
                break
        self._routes.clear()
        with self._cond:
            self._num_pending_adds = 0
        for group in groups:
            self._call(group, "fail", error)

    def _call(self, group: RequestGroup, method: str, *args) -> None:
        """Run `group.<method>(*args)` on the group's event loop (engine_process overrides this
        to send it to the frontend process instead)."""
        group._waker.call(getattr(group, method), *args)

    def _flush(self) -> None:
        """Hook: everything `_call` queued in this iteration is ready to go (engine_process)."""
