"""The serve process's start-up: what it built is exempt from the cyclic garbage collector."""

from __future__ import annotations

import gc

from carpool.server.startup import freeze_startup_objects


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
