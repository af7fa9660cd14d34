"""What a server process does once start-up is over (the frontend's and the engine process's)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


def freeze_startup_objects() -> None:
    """Exempt what start-up built from the cyclic garbage collector, as vLLM does. The imports,
    the model and torch.compile's graphs are ~1 million objects that live as long as the
    process; every full collection walked them all: in a 16-request burst, full collections of
    100-470 ms (growing) stalled the engine loop, and one was the burst's largest inter-token gap."""
    gc.collect()
    gc.freeze()


@contextmanager
def startup_objects_frozen() -> Iterator[None]:
    """freeze_startup_objects while a tool that measures an engine in its own process runs
    (`carpool bench spec`, `profile`, `fidelity`), so its steps are timed as a server runs them;
    then the objects are the collector's again, for callers that build other engines after."""
    freeze_startup_objects()
    try:
        yield
    finally:
        gc.unfreeze()
