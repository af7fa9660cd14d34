"""The two drivers on the embedded model: in process, and over HTTP against `carpool serve`
started in this process on loopback. Tiny workloads: seconds each."""

from __future__ import annotations

import pytest

from carpool import LLMEngine
from carpool.harness.drivers import InProcessDriver, OnlineDriver, count_tokens
from carpool.harness.metrics import summarize
from carpool.harness.workload import PromptSource, RequestSpec, WorkloadConfig, build_workload

ENGINE_KWARGS = dict(dtype="float32", num_threads=2, kv_cache_memory=64 << 20, seed=0)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(**ENGINE_KWARGS)


@pytest.fixture(scope="module")
def prompts(engine):
    return PromptSource.from_tokenizer(engine.tokenizer)


def small_workload(prompts, n=6, qps=20.0, seed=0):
    cfg = WorkloadConfig(num_requests=n, lengths="uniform", min_prompt_len=8, max_prompt_len=48,
                         min_output_len=3, max_output_len=8, qps=qps, seed=seed)
    return build_workload(cfg, prompts)


def test_in_process_run_records_full_timelines(engine, prompts):
    specs = small_workload(prompts)
    driver = InProcessDriver(engine)
    result = driver.run(specs)
    assert result.stopped_early is None and not engine.has_unfinished_requests()
    by_id = {t.request_id: t for t in result.timelines}
    for s in specs:
        t = by_id[str(s.index)]
        assert t.error is None and t.completed
        assert len(t.token_times) == s.output_len and t.num_prompt_tokens == s.prompt_len
        assert t.arrival_time == pytest.approx(result.start_time + s.arrival_time)
        assert t.arrival_time <= t.first_scheduled_time <= t.token_times[0] <= t.finished_time
        assert t.token_times == sorted(t.token_times)
    its = result.iterations
    assert its and all(result.start_time <= it.start_time <= result.end_time for it in its)
    assert sum(it.num_prefill_tokens for it in its) == sum(s.prompt_len for s in specs)
    assert sum(it.num_decode_tokens for it in its) == sum(s.output_len - 1 for s in specs)
    summary, per_request = summarize(result.timelines, result.iterations)
    assert summary.num_completed == len(specs) and summary.output_tokens == sum(s.output_len for s in specs)
    assert summary.scheduling_delay.p50 is not None and summary.tbt.count == sum(s.output_len - 1 for s in specs)


def test_in_process_replays_arrival_times(engine, prompts):
    ids = prompts.sample(__import__("numpy").random.default_rng(0), 16)
    specs = [RequestSpec(0, 0.0, ids, 2), RequestSpec(1, 0.4, ids, 2)]
    result = InProcessDriver(engine).run(specs)
    late = next(t for t in result.timelines if t.request_id == "1")
    assert late.first_scheduled_time >= result.start_time + 0.4
    assert result.end_time - result.start_time >= 0.4


def test_in_process_stop_aborts_everything(engine, prompts):
    specs = small_workload(prompts, n=4, qps=1000.0)
    for s in specs:
        s.output_len = 400
    calls = []

    def stop(timelines, now):
        calls.append(len(timelines))
        return "enough" if any(t.token_times for t in timelines) else None

    result = InProcessDriver(engine, check_interval=0.05).run(specs, stop=stop)
    assert result.stopped_early == "enough" and calls
    bm = engine.block_manager
    assert not engine.has_unfinished_requests() and bm.num_free_blocks == bm.num_blocks
    assert all(not t.completed for t in result.timelines)


def test_in_process_bad_request_is_recorded_not_fatal(engine, prompts):
    ids = prompts.sample(__import__("numpy").random.default_rng(0), 8)
    too_long = [1] * (engine.max_model_len + 5)
    result = InProcessDriver(engine).run([RequestSpec(0, 0.0, ids, 2), RequestSpec(1, 0.0, too_long, 2)])
    t0, t1 = sorted(result.timelines, key=lambda t: t.request_id)
    assert t0.completed and t1.error and "prompt" in t1.error


def conversations(prompts, **kw):
    cfg = WorkloadConfig(num_requests=2, lengths="uniform", min_prompt_len=8, max_prompt_len=24, min_output_len=3,
                         max_output_len=6, qps=20.0, turns=3, think_time=0.05, system_prompt_len=32, seed=1, **kw)
    return build_workload(cfg, prompts)


def test_in_process_conversations_send_the_exact_history(engine, prompts, monkeypatch):
    specs = conversations(prompts)
    sent = {}
    real_add = engine.add_request

    def recording_add(prompt, sp, request_id=None, arrival_time=None):
        r = real_add(prompt, sp, request_id=request_id, arrival_time=arrival_time)
        sent[int(request_id.rsplit("-", 1)[1])] = r
        return r

    monkeypatch.setattr(engine, "add_request", recording_add)
    driver = InProcessDriver(engine)
    result = driver.run(specs)
    assert len(result.timelines) == 6 and all(t.completed for t in result.timelines)
    cached = {t.request_id: t.num_cached_tokens for t in result.timelines}
    for s in specs:
        r = sent[s.index]
        assert cached[str(s.index)] == r.num_cached_tokens
        if s.parent is None:
            continue
        prev = sent[s.parent]
        assert r.prompt_token_ids == prev.token_ids + s.prompt_token_ids  # every token of the history
        assert r.arrival_time == pytest.approx(prev.finished_time + s.arrival_time)
        assert r.num_cached_tokens == (prev.num_tokens - 1) // 16 * 16  # all of it that was computed
    summary, _ = summarize(result.timelines, result.iterations)
    assert summary.cached_prompt_tokens == sum(cached.values()) > 0
    prefill = sum(it.num_prefill_tokens for it in result.iterations)
    assert prefill == summary.prompt_tokens - summary.cached_prompt_tokens
    # Every run starts with an empty prefix cache: a rerun's first request finds nothing cached.
    again = {t.request_id: t.num_cached_tokens for t in driver.run(specs).timelines}
    assert again[str(specs[0].index)] == 0
    assert all(again[str(s.index)] == cached[str(s.index)] for s in specs if s.parent is not None)


def test_count_tokens():
    assert count_tokens({"text": "ab", "logprobs": {"tokens": ["a", "b"]}}) == 2
    assert count_tokens({"text": "", "logprobs": {"tokens": ["\ufffd"]}}) == 1
    assert count_tokens({"text": "x", "logprobs": None}) == 1
    assert count_tokens({"text": "", "finish_reason": None}) == 1  # a token whose text the server holds
    assert count_tokens({"text": "", "finish_reason": "length"}) == 0


@pytest.fixture(scope="module")
def served():
    from tests.server.conftest import start_server

    s = start_server(LLMEngine(**ENGINE_KWARGS))
    yield s
    s.stop()


@pytest.mark.slow
@pytest.mark.parametrize("fmt, logprobs", [("ids", True), ("text", False)])
def test_online_driver_against_carpool_serve(served, prompts, engine, fmt, logprobs):
    specs = small_workload(prompts, n=5, qps=20.0, seed=1)
    driver = OnlineDriver(served.url, prompt_format=fmt, logprobs=logprobs,
                          detokenize=lambda ids: engine.tokenizer.decode(ids))
    result = driver.run(specs)
    assert result.notes["model"] == served.model_name and result.iterations == []
    by_id = {t.request_id: t for t in result.timelines}
    for s in specs:
        t = by_id[str(s.index)]
        assert t.error is None, t.error
        assert len(t.token_times) == s.output_len and t.completed
        assert t.arrival_time < t.token_times[0] and t.first_scheduled_time is None
    summary, _ = summarize(result.timelines)
    assert summary.num_completed == 5 and summary.scheduling_delay.count == 0 and summary.ttft.count == 5
    assert served.wait_idle()


def test_online_driver_stop_cancels_requests(served, prompts):
    specs = small_workload(prompts, n=3, qps=1000.0, seed=2)
    for s in specs:
        s.output_len = 300
    result = OnlineDriver(served.url, check_interval=0.1).run(
        specs, stop=lambda tls, now: "stop" if any(t.token_times for t in tls) else None)
    assert result.stopped_early == "stop" and all(not t.completed for t in result.timelines)
    assert served.wait_idle(20)  # the server aborted them when the client went away


def test_online_driver_unreachable_server_fails_requests_not_run(prompts):
    specs = small_workload(prompts, n=2)
    result = OnlineDriver("http://127.0.0.1:9", model="m", timeout=5).run(specs)
    assert all(t.error and "Connect" in t.error for t in result.timelines)
    with pytest.raises(ValueError, match="prompt_format"):
        OnlineDriver("http://x", prompt_format="xml")
