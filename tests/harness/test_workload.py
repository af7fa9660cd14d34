"""Workloads: determinism under seed, lengths, arrivals, trace parsing and bad inputs."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from carpool.harness.workload import (PromptSource, WorkloadConfig, WorkloadError, build_workload, describe,
                                    load_trace, resolve_trace)

WORDS = PromptSource(word_ids=list(range(1000, 1100)))


def build(**kw):
    return build_workload(WorkloadConfig(**kw), WORDS)


def key(specs):
    return [(s.index, s.arrival_time, tuple(s.prompt_token_ids), s.output_len) for s in specs]


@pytest.mark.parametrize("kw", [dict(lengths="fixed"), dict(lengths="uniform"), dict(lengths="zipf"),
                                dict(lengths="trace", trace="arxiv", length_scale=0.25),
                                dict(lengths="trace", trace="splitwise", arrivals="trace", qps=2.0),
                                dict(lengths="uniform", arrivals="gamma", burstiness=3.0)])
def test_same_seed_same_workload(kw):
    a, b = build(num_requests=30, seed=7, **kw), build(num_requests=30, seed=7, **kw)
    assert key(a) == key(b)
    if kw.get("arrivals") != "trace":  # trace arrivals are the trace's, whatever the seed
        assert key(build(num_requests=30, seed=8, **kw)) != key(a)


def test_longer_run_extends_shorter_and_rate_only_stretches():
    short = build(lengths="uniform", num_requests=10, qps=1.0, seed=3)
    long = build(lengths="uniform", num_requests=40, qps=1.0, seed=3)
    assert key(long[:10]) == key(short)
    fast = build(lengths="uniform", num_requests=10, qps=4.0, seed=3)
    assert [s.prompt_token_ids for s in fast] == [s.prompt_token_ids for s in short]
    assert [s.output_len for s in fast] == [s.output_len for s in short]
    assert np.allclose([s.arrival_time * 4 for s in fast], [s.arrival_time for s in short])


def test_lengths_in_ranges():
    specs = build(lengths="uniform", num_requests=200, min_prompt_len=64, max_prompt_len=1024,
                  min_output_len=64, max_output_len=256)
    p, d = [s.prompt_len for s in specs], [s.output_len for s in specs]
    assert 64 <= min(p) and max(p) <= 1024 and 64 <= min(d) and max(d) <= 256
    assert all(t in WORDS.word_ids for s in specs for t in s.prompt_token_ids)
    fixed = build(lengths="fixed", num_requests=5, prompt_len=33, output_len=7)
    assert {(s.prompt_len, s.output_len) for s in fixed} == {(33, 7)}
    z = build(lengths="zipf", num_requests=500, min_prompt_len=10, max_prompt_len=1000, zipf_theta=1.2)
    zp = np.array([s.prompt_len for s in z])
    assert zp.min() >= 10 and zp.max() <= 1000 and np.median(zp) < 100  # heavy at the short end


def test_arrivals():
    specs = build(num_requests=2000, qps=5.0, arrivals="poisson", seed=1)
    t = np.array([s.arrival_time for s in specs])
    assert t[0] == 0.0 and np.all(np.diff(t) >= 0)
    assert (len(t) - 1) / t[-1] == pytest.approx(5.0, rel=0.1)
    gaps = np.diff(t)
    assert np.std(gaps) / np.mean(gaps) == pytest.approx(1.0, abs=0.15)
    bursty = np.diff([s.arrival_time for s in build(num_requests=2000, qps=5.0, arrivals="gamma", burstiness=3.0)])
    assert np.std(bursty) / np.mean(bursty) == pytest.approx(3.0, rel=0.25)
    assert (len(bursty)) / np.sum(bursty) == pytest.approx(5.0, rel=0.3)
    assert {s.arrival_time for s in build(num_requests=16, arrivals="burst", qps=None)} == {0.0}


def test_trace_files_parse():
    arxiv = load_trace("arxiv")
    assert len(arxiv) == 28257 and arxiv.arrivals is None
    assert np.median(arxiv.prompt_lens) == pytest.approx(2730, rel=0.02)
    conv = load_trace("splitwise")
    assert len(conv) == 19366 and conv.arrivals is not None and conv.arrivals[0] == 0.0
    assert resolve_trace(arxiv.path) == resolve_trace("arxiv")


def test_trace_scaling_keeps_pd_ratio():
    cfg = WorkloadConfig(num_requests=300, lengths="trace", trace="arxiv", length_scale=0.25,
                         min_prompt_len=1, max_prompt_len=100_000, min_output_len=1, max_output_len=100_000)
    specs = build_workload(cfg, WORDS)
    p = np.array([s.prompt_len for s in specs])
    assert np.median(p) == pytest.approx(2730 / 4, rel=0.1)
    clipped = build_workload(replace(cfg, min_prompt_len=256, max_prompt_len=512, min_output_len=16,
                                     max_output_len=64), WORDS)
    assert all(256 <= s.prompt_len <= 512 and 16 <= s.output_len <= 64 for s in clipped)
    # without clipping, each request's P:D is the trace's (up to rounding)
    trace = load_trace("arxiv")
    ratios = trace.prompt_lens / trace.output_lens
    assert np.median([s.prompt_len / s.output_len for s in specs]) == pytest.approx(np.median(ratios), rel=0.15)
    capped = build_workload(replace(cfg, max_model_len=600), WORDS)
    assert all(s.prompt_len + s.output_len <= 600 for s in capped)


def test_trace_arrivals_window_and_rate():
    raw = build(num_requests=50, lengths="trace", trace="splitwise", arrivals="trace", qps=None)
    conv = load_trace("splitwise")
    assert [s.arrival_time for s in raw] == pytest.approx(list(conv.arrivals[:50] - conv.arrivals[0]))
    assert [s.prompt_len for s in raw][:3] == [374, 396, 879]  # the trace's own rows, unscaled
    at2 = build(num_requests=50, lengths="trace", trace="splitwise", arrivals="trace", qps=2.0)
    assert 49 / at2[-1].arrival_time == pytest.approx(2.0)
    later = build(num_requests=5, lengths="trace", trace="splitwise", arrivals="trace", qps=None, trace_offset=100)
    assert later[0].arrival_time == 0.0 and later[0].prompt_len == int(conv.prompt_lens[100])
    d = describe(at2)
    assert d["num_requests"] == 50 and d["offered_qps"] == pytest.approx(2.0)


@pytest.mark.parametrize("content, message", [
    ("a,b\n1,2\n", "missing column"),
    ("num_prefill_tokens,num_decode_tokens\n", "no rows"),
    ("num_prefill_tokens,num_decode_tokens\n10,x\n", "line 2: not a number"),
    ("num_prefill_tokens,num_decode_tokens\n10,5\n-3,5\n", "line 3"),
    ("num_prefill_tokens,num_decode_tokens,arrived_at\n10,5,2\n10,5,1\n", "must not decrease"),
    ("", "missing column"),
])
def test_bad_trace_files(tmp_path, content, message):
    p = tmp_path / "bad.csv"
    p.write_text(content)
    with pytest.raises(WorkloadError, match=message):
        build(lengths="trace", trace=str(p))


def test_bad_trace_references(tmp_path):
    with pytest.raises(WorkloadError, match="not found"):
        build(lengths="trace", trace=str(tmp_path / "nope.csv"))
    with pytest.raises(WorkloadError, match="no arrived_at"):
        build(lengths="trace", trace="arxiv", arrivals="trace")
    with pytest.raises(WorkloadError, match="do not fit"):
        build(lengths="trace", trace="splitwise", arrivals="trace", num_requests=10, trace_offset=19360)
    binary = tmp_path / "bin.csv"
    binary.write_bytes(b"\xff\xfe\x00\x81" * 10)
    with pytest.raises(WorkloadError, match="not a text CSV|missing column"):
        build(lengths="trace", trace=str(binary))


@pytest.mark.parametrize("kw, message", [
    (dict(num_requests=0), "num_requests"), (dict(lengths="pareto"), "unknown lengths"),
    (dict(arrivals="hourly"), "unknown arrivals"), (dict(qps=0.0), "qps"), (dict(qps=float("nan")), "qps"),
    (dict(min_prompt_len=10, max_prompt_len=5), "min_prompt_len"), (dict(output_len=0), "output_len"),
    (dict(burstiness=0.0), "burstiness"), (dict(length_scale=-1.0), "length_scale"),
    (dict(lengths="trace"), "needs a trace"), (dict(qps=None), "need a qps"),
    (dict(zipf_theta=0.0), "zipf_theta"), (dict(turns=0), "turns"), (dict(think_time=-1.0), "think_time"),
    (dict(system_prompt_len=-1), "system_prompt_len"), (dict(system_prompt_len=99, max_model_len=100), "no room"),
])
def test_bad_config_values(kw, message):
    with pytest.raises(WorkloadError, match=message):
        WorkloadConfig(**kw)


def test_prompt_source_from_tokenizer_round_trips(tmp_path):
    from carpool.config import default_model_path
    from carpool.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_path())
    src = PromptSource.from_tokenizer(tok)
    ids = src.sample(np.random.default_rng(0), 300)
    assert tok.encode(tok.decode(ids), add_special_tokens=False) == ids  # text prompts keep their length
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("The quick brown fox jumps over the lazy dog. " * 3)
    c = PromptSource.from_tokenizer(tok, str(corpus))
    window = c.sample(np.random.default_rng(0), 100)  # longer than the corpus: it wraps
    assert len(window) == 100 and set(window) <= set(c.corpus_ids)
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(WorkloadError, match="no tokens"):
        PromptSource.from_tokenizer(tok, str(tmp_path / "empty.txt"))


def test_shared_system_prompt():
    plain = build(lengths="uniform", num_requests=20, seed=4)
    shared = build(lengths="uniform", num_requests=20, seed=4, system_prompt_len=50)
    system = shared[0].prompt_token_ids[:50]
    for a, b in zip(plain, shared):  # the same requests, each behind the same 50 tokens
        assert b.prompt_token_ids == system + a.prompt_token_ids and b.prompt_len == a.prompt_len + 50
    capped = build(lengths="uniform", num_requests=20, seed=4, system_prompt_len=50, max_model_len=300)
    assert all(s.prompt_token_ids[:50] == system and s.prompt_len + s.output_len <= 300 for s in capped)


def test_conversations():
    kw = dict(lengths="trace", trace="splitwise", length_scale=0.1, num_requests=6, turns=4, think_time=2.0,
              system_prompt_len=16, max_model_len=4096, seed=5)
    specs = build(**kw)
    assert key(specs) == key(build(**kw))
    firsts = [s for s in specs if s.parent is None]
    assert len(firsts) == 6
    assert sorted(s.index for s in specs) == list(range(len(specs)))
    assert [s.arrival_time for s in firsts] == sorted(s.arrival_time for s in firsts)
    by_index = {s.index: s for s in specs}
    for s in specs:
        if s.parent is None:
            assert s.history_len == 0 and s.prompt_token_ids[:16] == firsts[0].prompt_token_ids[:16]
            continue
        prev = by_index[s.parent]
        assert s.history_len == prev.prompt_len + prev.output_len
        assert s.prompt_len == s.history_len + len(s.prompt_token_ids) <= 4096 - s.output_len
        assert s.arrival_time >= 0  # think time after the previous turn
    assert len(specs) == 24  # nothing was cut at 4096 tokens
    thinks = [s.arrival_time for s in specs if s.parent is not None]
    assert np.mean(thinks) == pytest.approx(2.0, rel=0.6)
    # More conversations extend fewer; a tight context ends conversations early.
    more = build(**{**kw, "num_requests": 9})
    assert key([s for s in more if s.parent is None][:6]) == key(firsts)
    short = build(**{**kw, "max_model_len": 300})
    assert 6 <= len(short) < 24 and all(s.prompt_len + s.output_len <= 300 for s in short)
    d = describe(specs)
    assert d["num_requests"] == 24 and d["num_conversations"] == 6
