"""ServerMetrics from fake engine state: no model needed. The exposition is read back with
prometheus_client's own parser."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from carpool.config import SpeculativeConfig
from carpool.engine import IterationStats
from carpool.outputs import CompletionOutput, RequestMetrics, RequestOutput
from carpool.server.metrics import MIN_HISTORY, STALL_FACTOR, ServerMetrics, StatsLog
from carpool.spec.acceptance import SpecDecodeStats
from tests.server.conftest import metric_sample


def fake_engine(running=0, waiting=0, preemptions=0, usage=0.0, queries=0, hits=0):
    return SimpleNamespace(scheduler=SimpleNamespace(running=[None] * running, waiting=[None] * waiting,
                                                     num_preemptions=preemptions, prefix_cache_queries=queries,
                                                     prefix_cache_hits=hits),
                           block_manager=SimpleNamespace(usage=usage))


def output(times, n_new=1, finished=False, reason=None, prompt_len=5):
    metrics = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.1, token_times=list(times),
                             finished_time=times[-1] if finished else None, num_preemptions=0)
    choice = CompletionOutput(0, "x" * len(times), [7] * len(times), None, None, reason)
    return RequestOutput("r", None, [1] * prompt_len, [choice], finished, new_text="x", new_token_ids=[7] * n_new,
                         metrics=metrics)


def stats(duration):
    return IterationStats(0.0, duration, 0, 1, 1, 0)


def sample(m: ServerMetrics, name: str, **labels) -> float:
    value = m.registry.get_sample_value(name, {"model_name": "m", **labels})
    return 0.0 if value is None else value


def test_stalls_ttft_and_gauges():
    m = ServerMetrics("m", 2048)
    engine = fake_engine(running=1, waiting=2, preemptions=3, usage=0.25)
    # First token at 0.5 s: TTFT 0.5, prompt tokens counted once.
    m.on_step(engine, [output([0.5])], stats(0.01))
    assert sample(m, "carpool:time_to_first_token_seconds_count") == 1
    assert sample(m, "carpool:time_to_first_token_seconds_sum") == 0.5
    assert sample(m, "carpool:prompt_tokens_total") == 5
    assert sample(m, "carpool:num_requests_waiting") == 2
    assert sample(m, "carpool:kv_cache_usage_perc") == 0.25
    assert sample(m, "carpool:num_preemptions_total") == 3
    # A long gap before there is enough history is not judged.
    m.on_step(engine, [output([0.5, 1.5])], stats(0.01))
    assert sample(m, "carpool:generation_stalls_total") == 0
    for _ in range(MIN_HISTORY):
        m.on_step(engine, [], stats(0.01))
    times = [0.5, 1.5]
    ok_gap = 0.01 * STALL_FACTOR * 0.9
    times.append(times[-1] + ok_gap)
    m.on_step(engine, [output(times)], stats(0.01))
    assert sample(m, "carpool:generation_stalls_total") == 0
    times.append(times[-1] + 0.01 * STALL_FACTOR * 1.5)
    m.on_step(fake_engine(preemptions=5), [output(times, finished=True, reason="length")], stats(0.01))
    assert sample(m, "carpool:generation_stalls_total") == 1
    assert sample(m, "carpool:inter_token_latency_seconds_count") == 3
    assert sample(m, "carpool:generation_tokens_total") == 4
    assert sample(m, "carpool:num_preemptions_total") == 5  # counter follows the engine's total
    assert sample(m, "carpool:request_success_total", finished_reason="length") == 1
    assert sample(m, "carpool:e2e_request_latency_seconds_count") == 1
    assert sample(m, "carpool:request_queue_time_seconds_sum") == 0.1
    assert sample(m, "carpool:num_requests_running") == 0
    assert sample(m, "carpool:iteration_tokens_total_count") == MIN_HISTORY + 4


def test_prefix_cache_counters_follow_the_scheduler():
    m = ServerMetrics("m", 2048)
    m.on_step(fake_engine(queries=100, hits=64), [], stats(0.01))
    m.on_step(fake_engine(queries=250, hits=192), [], stats(0.01))
    assert sample(m, "carpool:prefix_cache_queries_total") == 250
    assert sample(m, "carpool:prefix_cache_hits_total") == 192


def test_abort_counts():
    m = ServerMetrics("m", 2048)
    m.on_abort(fake_engine(), 2)
    assert sample(m, "carpool:request_success_total", finished_reason="abort") == 2
    families = {f.name: f for f in text_string_to_metric_families(m.render()[0].decode())}
    assert families["carpool:generation_stalls"].type == "counter"
    assert [s.value for s in families["carpool:generation_stalls"].samples] == [0.0]
    assert not [s.name for f in families.values() for s in f.samples if s.name.endswith("_created")]


@pytest.mark.anyio
async def test_the_exposition_over_http(api):
    r = await api.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    kinds = {"carpool:num_requests_running": "gauge", "carpool:kv_cache_usage_perc": "gauge",
             "carpool:generation_tokens": "counter", "carpool:request_success": "counter",
             "carpool:time_to_first_token_seconds": "histogram", "carpool:cache_config_info": "gauge"}
    assert {name: families[name].type for name in kinds} == kinds
    assert metric_sample(r.text, "carpool:request_success_total", finished_reason="length") == 0
    assert metric_sample(r.text, "carpool:time_to_first_token_seconds_bucket", le="+Inf") == 0


def test_a_stats_line_every_interval_while_busy(caplog):
    caplog.set_level("INFO", logger="carpool")
    now = [0.0]
    log = StatsLog(interval=10.0, clock=lambda: now[0])
    m = ServerMetrics("m", 2048, stats_log=log)
    engine = fake_engine(running=3, waiting=1, usage=0.5)
    for _ in range(4):  # back-to-back 2 s steps of 200 prompt tokens and 3 new tokens
        now[0] += 2.0
        m.on_step(engine, [output([now[0]], n_new=3)], IterationStats(now[0] - 2.0, 2.0, 200, 3, 4, 0))
    assert not caplog.records  # 8 s: no line yet
    engine.scheduler.prefix_cache_queries, engine.scheduler.prefix_cache_hits = 100, 25
    now[0] += 2.0
    line = log.on_step(engine, IterationStats(now[0] - 2.0, 2.0, 200, 3, 4, 0), 3)
    assert line == ("100.0 prompt tokens/s, 1.5 generated tokens/s, running 3, waiting 1, KV cache 50.0%, "
                    "prefix cache hits 25.0%; 5 steps, p50 2000.0 ms, max 2000.0 ms")
    assert line in caplog.text
    assert log.on_step(engine, None, 0) is None  # nothing ran: no line
    engine.scheduler.target_tbt, engine.scheduler.cost = 0.25, SimpleNamespace(margin=1.1)
    now[0] += 100.0  # idle for 100 s, then two 0.3 s steps 10 s apart
    assert log.on_step(engine, IterationStats(now[0] - 0.3, 0.3, 0, 3, 3, 0), 3) is None
    now[0] += 10.0
    assert log.on_step(engine, IterationStats(now[0] - 0.3, 0.3, 0, 3, 3, 0), 3) == (
        "0.0 prompt tokens/s, 0.6 generated tokens/s, running 3, waiting 1, KV cache 50.0%, prefix cache hits "
        "0.0%; 2 steps, p50 300.0 ms, max 300.0 ms; target 250 ms: 2 steps over it, fit margin 1.10x")


def spec_engine(num_speculative_tokens=3, **kwargs):
    engine = fake_engine(**kwargs)
    engine.spec_config = SpeculativeConfig(num_speculative_tokens=num_speculative_tokens)
    engine.spec_stats = SpecDecodeStats()
    return engine


def test_spec_decode_counters_only_when_the_engine_speculates():
    plain = {f.name for f in text_string_to_metric_families(ServerMetrics("m", 2048).render()[0].decode())}
    assert not [name for name in plain if "spec_decode" in name]
    m = ServerMetrics("m", 2048, namespace="vllm", num_speculative_tokens=3)
    families = {f.name: f for f in text_string_to_metric_families(m.render()[0].decode())}
    for name in ("drafts", "draft_tokens", "accepted_tokens", "accepted_tokens_per_pos"):
        assert families[f"vllm:spec_decode_num_{name}"].type == "counter"
    per_pos = families["vllm:spec_decode_num_accepted_tokens_per_pos"].samples
    assert [(s.labels["position"], s.value) for s in per_pos] == [("0", 0.0), ("1", 0.0), ("2", 0.0)]


def test_spec_decode_counters_follow_the_engine():
    m = ServerMetrics("m", 2048, num_speculative_tokens=3)
    engine = spec_engine()
    engine.spec_stats.record(3, 2)
    engine.spec_stats.record(2, 0)
    m.on_step(engine, [], stats(0.01))
    engine.spec_stats.record(3, 3)
    m.on_step(engine, [], stats(0.01))
    m.on_step(engine, [], stats(0.01))  # nothing new: nothing counted twice
    assert sample(m, "carpool:spec_decode_num_drafts_total") == 3
    assert sample(m, "carpool:spec_decode_num_draft_tokens_total") == 8
    assert sample(m, "carpool:spec_decode_num_accepted_tokens_total") == 5
    per_pos = [sample(m, "carpool:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(3)]
    assert per_pos == [2, 2, 1]


def test_the_stats_line_says_how_drafts_fared(caplog):
    caplog.set_level("INFO", logger="carpool")
    now = [0.0]
    log = StatsLog(interval=10.0, clock=lambda: now[0])
    engine = spec_engine(running=1)
    engine.spec_stats.record(4, 4)  # before the first step: not this line's
    for drafts, kept in [(0, 0), (4, 3), (4, 0)]:  # 4 s steps: the third one is due a line
        now[0] += 4.0
        engine.spec_stats.record(drafts, kept)
        line = log.on_step(engine, IterationStats(now[0] - 4.0, 4.0, 0, 1 + drafts, 1, 0), 1 + kept)
    assert line == ("0.0 prompt tokens/s, 0.5 generated tokens/s, running 1, waiting 0, KV cache 0.0%, prefix cache "
                    "hits 0.0%; 3 steps, p50 4000.0 ms, max 4000.0 ms; spec decode: 37.5% of 8 draft tokens "
                    "accepted, 2.5 tokens per verification")
    assert line in caplog.text
    now[0] += 20.0
    engine.spec_stats.record(2, 2)
    assert log.on_step(engine, IterationStats(now[0] - 20.0, 20.0, 0, 3, 1, 0), 3).endswith(
        "; spec decode: 100.0% of 2 draft tokens accepted, 3.0 tokens per verification")
    now[0] += 20.0
    assert log.on_step(engine, IterationStats(now[0] - 20.0, 20.0, 0, 1, 1, 0), 1).endswith(
        "; spec decode: no draft tokens")
