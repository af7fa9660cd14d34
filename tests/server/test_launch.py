"""The serve process's start-up: what it built is exempt from the cyclic garbage collector; and
the same for the span of a tool that measures an engine in its caller's process."""

from __future__ import annotations

import gc

from carpool.server.startup import freeze_startup_objects, startup_objects_frozen


def test_startup_objects_are_frozen_and_garbage_is_collected_first():
    class Node:
        pass

    garbage = Node()
    garbage.self = garbage  # a cycle only the collector frees
    alive = Node()
    alive.self = alive
    gc.unfreeze()
    collected = []
    gc.callbacks.append(lambda phase, info: collected.append(info["collected"]) if phase == "stop" else None)
    del garbage
    try:
        freeze_startup_objects()
        assert gc.get_freeze_count() > 0
        assert any(n >= 1 for n in collected)  # the dead cycle was freed, not frozen
        assert gc.is_tracked(alive)
        # Frozen objects are out of every generation the collector walks.
        assert all(obj is not alive for gen in range(3) for obj in gc.get_objects(gen))
    finally:
        gc.callbacks.pop()
        gc.unfreeze()


def test_a_measuring_tool_freezes_for_its_span_and_gives_the_objects_back():
    """A benchmark in a test's (or a script's) process must not leave the collector blind to
    the engines built after it: cycles among them would never be freed."""
    gc.unfreeze()
    try:
        with startup_objects_frozen():
            assert gc.get_freeze_count() > 0
        assert gc.get_freeze_count() == 0
        try:
            with startup_objects_frozen():
                raise RuntimeError("a failed run")
        except RuntimeError:
            pass
        assert gc.get_freeze_count() == 0
    finally:
        gc.unfreeze()
