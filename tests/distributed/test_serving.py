"""The OpenAI server over a pipeline-parallel engine: concurrent requests, same text as one
process; a dead worker turns into errors that name it, and an unhealthy server."""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from carpool.engine import LLMEngine
from carpool.sampling_params import SamplingParams
from tests.distributed.test_equivalence import PROMPTS, TINY
from tests.server.conftest import start_server, wait_idle


def final_texts(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> list[str]:
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    ids = [engine.add_request(p, sp).request_id for p in prompts]
    texts = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                texts[out.request_id] = out.text
    return [texts[i] for i in ids]


def test_server_on_a_pipeline(parallel_engine, tiny_llama):
    expected = final_texts(LLMEngine(model=tiny_llama, **TINY), PROMPTS, 10)
    engine = parallel_engine(model=tiny_llama, pipeline_parallel_size=2, **TINY)
    served = start_server(engine, served_model_name=["tiny"])
    try:
        def complete(prompt):
            r = httpx.post(served.v1 + "/completions", timeout=60,
                           json={"model": "tiny", "prompt": prompt, "max_tokens": 10, "temperature": 0})
            r.raise_for_status()
            return r.json()["choices"][0]["text"]

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            texts = list(pool.map(complete, PROMPTS))
        assert texts == expected
        with httpx.stream("POST", served.v1 + "/completions", timeout=60,
                          json={"model": "tiny", "prompt": PROMPTS[5], "max_tokens": 10, "temperature": 0,
                                "stream": True}) as r:
            chunks = [line for line in r.iter_lines() if line.startswith("data: {")]
        assert len(chunks) >= 2
        assert wait_idle(engine)
    finally:
        served.stop()


def test_server_when_a_worker_dies(parallel_engine, tiny_llama, caplog):
    engine = parallel_engine(model=tiny_llama, pipeline_parallel_size=2, **TINY)
    served = start_server(engine, served_model_name=["tiny"])
    body = {"model": "tiny", "prompt": PROMPTS[2], "max_tokens": 5, "temperature": 0}
    try:
        assert httpx.post(served.v1 + "/completions", json=body, timeout=60).status_code == 200
        os.kill(engine.executor.processes[1].pid, signal.SIGKILL)
        time.sleep(0.2)
        r = httpx.post(served.v1 + "/completions", json=body, timeout=60)
        assert r.status_code >= 500 and "SIGKILL" not in r.text  # no internals in responses: in the log
        assert any("worker rank 1" in m and "SIGKILL" in m for m in caplog.messages)
        assert httpx.get(served.url + "/health", timeout=10).status_code == 503
        assert httpx.post(served.v1 + "/completions", json=body, timeout=60).status_code == 503
    finally:
        served.stop()
