"""TP / PP engines give the single-process engine's greedy outputs (fp32, gloo on CPU)."""

from __future__ import annotations

import numpy as np
import pytest

from carpool.core.scheduler import SCHEDULERS
from carpool.engine import LLMEngine
from carpool.sampling_params import SamplingParams
from tests.conftest import PROMPTS as TEXT_PROMPTS
from tests.helpers import run_greedy, scheduler_config

TINY = dict(dtype="float32", kv_cache_memory=16 << 20, max_num_batched_tokens=48)
LENGTHS = (3, 7, 20, 45, 60, 90, 130)  # chunked at a 48-token budget, across block boundaries
PROMPTS = [np.random.default_rng(n).integers(3, 49152, n).tolist() for n in LENGTHS]
MAX_TOKENS = 12
SEEDED = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.9, seed=42, ignore_eos=True)


@pytest.fixture(scope="module")
def single(tiny_llama):
    return LLMEngine(model=tiny_llama, **TINY)


@pytest.fixture(scope="module")
def reference(single):
    return run_greedy(single, PROMPTS, MAX_TOKENS)


def run_seeded(engine) -> list[int]:
    request = engine.add_request(PROMPTS[4], SEEDED)
    while engine.has_unfinished_requests():
        engine.step()
    return request.output_token_ids


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), pytest.param(2, 2, marks=pytest.mark.slow)])
def test_tiny_llama_matches_single_process(parallel_engine, tiny_llama, single, reference, tp, pp):
    engine = parallel_engine(model=tiny_llama, tensor_parallel_size=tp, pipeline_parallel_size=pp, **TINY)
    assert run_greedy(engine, PROMPTS, MAX_TOKENS) == reference
    assert run_seeded(engine) == run_seeded(single)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def watch_in_flight(engine, monkeypatch) -> dict:
    """Check on every submit that no request is already in flight; count the pipeline depth."""
    ex = engine.executor
    queue: list[set[str]] = []
    seen = {"max_depth": 0}
    submit, collect = ex.submit, ex.collect

    def checked_submit(batch):
        ids = {r.request_id for r in batch.requests}
        busy = set().union(*queue) if queue else set()
        assert not ids & busy, f"requests {ids & busy} scheduled while in flight"
        submit(batch)
        queue.append(ids)
        seen["max_depth"] = max(seen["max_depth"], len(queue))

    def checked_collect():
        queue.pop(0)
        return collect()

    monkeypatch.setattr(ex, "submit", checked_submit)
    monkeypatch.setattr(ex, "collect", checked_collect)
    return seen


@pytest.mark.parametrize("policy", list(SCHEDULERS))
def test_every_scheduler_pipelined(parallel_engine, tiny_llama, reference, policy, monkeypatch):
    engine = parallel_engine(model=tiny_llama, pipeline_parallel_size=2, **TINY)
    seen = watch_in_flight(engine, monkeypatch)
    with scheduler_config(engine, budget=48 if policy in ("sarathi", "chunked-only") else 128, policy=policy):
        assert run_greedy(engine, PROMPTS, MAX_TOKENS) == reference
    # Request-level batching admits nothing while a batch runs, so it never fills the pipeline.
    assert seen["max_depth"] == (1 if policy == "request-level" else 2)


@pytest.mark.parametrize("policy", ["sarathi", "vllm"])
def test_preemption_under_pipelining(parallel_engine, tiny_llama, reference, policy, monkeypatch):
    engine = parallel_engine(model=tiny_llama, pipeline_parallel_size=2, **TINY)
    watch_in_flight(engine, monkeypatch)
    with scheduler_config(engine, budget=48 if policy == "sarathi" else 128, num_blocks=12, policy=policy) as e:
        assert run_greedy(e, PROMPTS, MAX_TOKENS) == reference
        assert e.scheduler.num_preemptions > 0


def test_abort_while_in_flight(parallel_engine, tiny_llama, reference):
    engine = parallel_engine(model=tiny_llama, pipeline_parallel_size=2, **TINY)
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    requests = [engine.add_request(p, sp) for p in PROMPTS]
    engine.step()  # submits two micro-batches, returns the first
    in_flight = [r for r in requests if r in engine.scheduler.in_flight]
    assert in_flight
    victim = in_flight[0]
    engine.abort_request(victim.request_id)
    done = len(victim.output_token_ids)
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id != victim.request_id
    assert victim.finish_reason == "abort" and len(victim.output_token_ids) == done
    for r, expected in zip(requests, reference):
        if r is not victim:
            assert r.output_token_ids == expected
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


SHARED = [PROMPTS[6][:100] + p[:20] for p in PROMPTS[:4]] + [PROMPTS[6][:64]]  # a 100-token shared prefix


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_prefix_cache_under_parallelism(parallel_engine, tiny_llama, single, tp, pp):
    """The driver's block manager shares cached blocks; workers only see the block tables."""
    with scheduler_config(single, budget=48, prefix_caching=False):
        expected = run_greedy(single, SHARED, MAX_TOKENS)
    engine = parallel_engine(model=tiny_llama, tensor_parallel_size=tp, pipeline_parallel_size=pp, **TINY)
    with scheduler_config(engine, budget=48, prefix_caching=True) as e:
        assert run_greedy(e, SHARED[:1], MAX_TOKENS) == expected[:1]
        assert run_greedy(e, SHARED, MAX_TOKENS) == expected
        assert e.scheduler.prefix_cache_hits >= 4 * 96 + 48


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp", [(1, 3), (3, 1)])
def test_embedded_model_matches_single_process(parallel_engine, engine_fp32, tp, pp):
    """SmolLM2: 9 heads / 3 KV heads, 30 layers, vocabulary 49152: all divide by 3."""
    prompts = [engine_fp32.tokenizer.encode(p) for p in TEXT_PROMPTS]
    expected = run_greedy(engine_fp32, prompts, 16)
    engine = parallel_engine(dtype="float32", kv_cache_memory=64 << 20, tensor_parallel_size=tp,
                             pipeline_parallel_size=pp)
    assert run_greedy(engine, prompts, 16) == expected
