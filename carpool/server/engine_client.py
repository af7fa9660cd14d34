"""`EngineClient`: what the HTTP server needs from an engine, wherever the engine runs.

Two clients implement it: `AsyncLLMEngine` (the engine on a thread of this process: embedding,
tests) and `EngineProcess` (the engine in its own process: `carpool serve`). The server (app.py,
serving.py) holds one and never asks which; a test can hand it a scripted fake instead
(tests/server/scripted.py). This module imports nothing from the server, so every module there
may import it.

A client hands out `RequestGroup`s (async_engine.py): the engine requests of one HTTP request,
iterated for (choice index, Delta). It fails calls with the errors below, which the server
turns into status codes (serving.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from carpool.sampling_params import SamplingParams

if TYPE_CHECKING:
    from carpool.server.async_engine import RequestGroup
    from carpool.structured import StructuredOutputs


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (crashed or shut down); the request cannot be served."""


class EngineOverloadedError(RuntimeError):
    """Admitting the request would grow the waiting queue past --max-waiting-requests."""


class RequestRejectedError(ValueError):
    """The engine refused one request of a group in add_request (a ValueError there)."""

    def __init__(self, index: int, message: str):
        super().__init__(message)
        self.index = index

    def __reduce__(self):  # it crosses the engine process's pipe
        return type(self), (self.index, str(self))


class RequestFailedError(RuntimeError):
    """add_request failed with something other than a ValueError: a server-side fault."""


DEAD_AFTER_ERROR = "the engine has stopped after an internal error; see the server log"
NOT_RUNNING = "the engine is not running"


@dataclass
class EngineInfo:
    """What the frontend needs from the engine to validate and answer requests."""

    model: str
    max_model_len: int
    vocab_size: int
    sampling_defaults: SamplingParams
    tokenizer: Any  # the frontend's own: never the object the engine detokenizes with
    eos_token_ids: list[int]
    num_blocks: int
    block_size: int

    @classmethod
    def of(cls, engine) -> EngineInfo:
        return cls(engine.config.model, engine.max_model_len, engine.model_config.vocab_size,
                   engine.default_sampling_params(), engine.tokenizer, list(engine.eos_token_ids),
                   engine.block_manager.num_blocks, engine.block_manager.block_size)


class EngineClient(Protocol):
    """The engine as the server sees it. `start` runs on the server's event loop (the app's
    lifespan), `add_requests` and `abort` on that loop; `stop` and `shutdown` on any thread."""

    info: EngineInfo
    structured: StructuredOutputs  # compiles a request's constraint while it is prepared
    num_aborted: int  # engine requests aborted so far (their clients left)

    @property
    def healthy(self) -> bool:
        """Accepting requests: started, not stopped, not dead (/health)."""

    @property
    def num_waiting(self) -> int:
        """Requests accepted but not yet running (what --max-waiting-requests bounds)."""

    def dead_message(self) -> str:
        """Why the engine does not serve: the body of /health's 503."""

    def start(self) -> None:
        """Begin serving, on the running event loop."""

    async def add_requests(self, entries: Sequence[tuple[list[int], SamplingParams]],
                           arrival_time: float | None = None, prefix: str | None = None) -> RequestGroup:
        """One engine request per (prompt ids, params), returned once all are accepted; raises
        EngineOverloadedError, EngineDeadError, RequestRejectedError or RequestFailedError."""

    def abort(self, request_ids: list[str]) -> None:
        """Drop these engine requests (their client has gone); unknown ids are ignored."""

    async def render_metrics(self) -> tuple[bytes, str]:
        """The Prometheus exposition and its content type (/metrics)."""

    def stop(self, timeout: float = 10.0) -> None:
        """Stop generating: requests still running fail with EngineDeadError."""

    def shutdown(self) -> None:
        """Release what the engine holds (its workers, its process); after `stop`."""
