"""LoopWaker: callbacks from the engine thread run on the event loop, in order, one failure
does not stop the rest, and a closed loop takes no more and frees its pipe."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import threading

from carpool.server.async_engine import LoopWaker


def test_callbacks_from_another_thread_run_on_the_loop_in_order(caplog):
    async def main():
        loop = asyncio.get_running_loop()
        waker = LoopWaker(loop)
        seen: list[tuple[int, bool]] = []
        done = asyncio.Event()

        def record(i: int) -> None:
            seen.append((i, threading.current_thread() is threading.main_thread()))
            if i == 999:
                done.set()

        def engine_thread() -> None:
            for i in range(1000):
                if i == 500:
                    waker.call(lambda: 1 / 0)  # one failing callback does not stop the others
                waker.call(record, i)

        t = threading.Thread(target=engine_thread)
        t.start()
        await asyncio.wait_for(done.wait(), 10)
        t.join()
        return seen

    with caplog.at_level(logging.ERROR, "carpool.server"):
        seen = asyncio.run(main())
    assert seen == [(i, True) for i in range(1000)]
    assert "ZeroDivisionError" in caplog.text


def test_a_closed_loop_takes_no_callbacks_and_frees_its_pipe():
    loop = asyncio.new_event_loop()
    waker = LoopWaker(loop)
    fds = (waker._read_fd, waker._write_fd)
    loop.close()
    waker.call(print, "never")
    assert not waker.callbacks
    del loop
    gc.collect()
    for fd in fds:  # closed with the loop
        try:
            os.fstat(fd)
        except OSError:
            continue
        raise AssertionError(f"fd {fd} still open")
