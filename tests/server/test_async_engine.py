"""The in-process client. LoopWaker: callbacks from the engine thread run on the event loop, in
order, one failure does not stop the rest, and a closed loop takes no more and frees its pipe.
The loop: when a step raises, or steps keep failing, it dies and says so."""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import threading
from types import SimpleNamespace

import pytest

from carpool.sampling_params import SamplingParams
from carpool.server.async_engine import AsyncLLMEngine, LoopWaker
from carpool.server.engine_client import DEAD_AFTER_ERROR, EngineDeadError


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


# ------------------------------------------------------------------ the loop's death
class FakeEngine:
    """What AsyncLLMEngine's loop calls on an LLMEngine; each step raises or counts a failed step."""

    def __init__(self, step_raises: bool):
        self.step_raises = step_raises
        self.requests: dict[str, list[int]] = {}
        self.scheduler = SimpleNamespace(waiting=[])
        self.iteration_stats: list = []
        self.num_consecutive_failed_steps = 0
        self.shut_down = False

    def add_request(self, prompt, params, request_id, arrival_time):
        self.requests[request_id] = prompt

    def abort_request(self, request_id):
        return self.requests.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self):
        if self.step_raises:
            raise RuntimeError("scheduler exploded")
        self.num_consecutive_failed_steps += 1  # the engine failed the batch, and returns nothing
        return []

    def shutdown(self) -> None:
        self.shut_down = True


@pytest.mark.parametrize("step_raises", [True, False])
def test_a_dead_loop_fails_its_requests_refuses_new_ones_and_says_so(step_raises, caplog):
    engine = FakeEngine(step_raises)
    client = AsyncLLMEngine(engine, max_consecutive_failed_steps=3)

    async def main():
        client.start()
        while not client.healthy:
            await asyncio.sleep(0.001)
        group = await client.add_requests([([1, 2, 3], SamplingParams(max_tokens=4))])
        with pytest.raises(EngineDeadError, match="the engine has stopped after an internal error"):
            async for _ in group:
                pass
        assert not client.healthy and client.dead_message() == DEAD_AFTER_ERROR
        with pytest.raises(EngineDeadError):
            await client.add_requests([([1], SamplingParams(max_tokens=1))])

    with caplog.at_level(logging.ERROR, "carpool.server"):
        asyncio.run(main())
    assert engine.num_consecutive_failed_steps == (0 if step_raises else 3)
    assert not engine.requests  # what it held was aborted
    assert "the engine loop died" in caplog.text
    client.stop()
    client.shutdown()
    assert engine.shut_down
