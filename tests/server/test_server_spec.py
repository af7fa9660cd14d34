"""A server with n-gram speculation (--speculative-config) over the embedded model: a prompt that
repeats itself gets drafts kept, /metrics shows vLLM's spec_decode counters (here under
`--metrics-namespace vllm`), and greedy output is the output of the default server without them."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import metric_sample

SPEC = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}
REPEATING = ", ".join(map(str, range(1, 41))) + "\n" + ", ".join(map(str, range(1, 21))) + ","


@pytest.fixture(scope="module")
def spec_server(server_factory):
    return server_factory({"speculative_config": SPEC}, metrics_namespace="vllm")


def complete(server, prompt: str) -> dict:
    body = {"model": server.model_name, "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    r = httpx.post(server.v1 + "/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_drafts_are_kept_counted_and_change_nothing(spec_server, served):
    got = complete(spec_server, REPEATING)
    assert got["choices"][0]["text"] == complete(served, REPEATING)["choices"][0]["text"]
    assert got["choices"][0]["text"].startswith(" 21, 22, 23")
    assert got["usage"]["completion_tokens"] == 24
    assert spec_server.wait_idle()
    text = httpx.get(spec_server.url + "/metrics").text
    drafts = metric_sample(text, "vllm:spec_decode_num_drafts_total")
    draft_tokens = metric_sample(text, "vllm:spec_decode_num_draft_tokens_total")
    accepted = metric_sample(text, "vllm:spec_decode_num_accepted_tokens_total")
    per_pos = [metric_sample(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
               for i in range(SPEC["num_speculative_tokens"])]
    assert 0 < drafts <= draft_tokens and 0 < accepted <= draft_tokens
    assert per_pos == sorted(per_pos, reverse=True) and sum(per_pos) == accepted
    stats = spec_server.engine.spec_stats  # the counters are the engine's totals
    assert (drafts, draft_tokens, accepted) == (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    # Each verification adds its own token and the drafts it kept: fewer steps than tokens.
    assert accepted + drafts <= got["usage"]["completion_tokens"]
    assert "spec_decode" not in httpx.get(served.url + "/metrics").text  # registered only when speculating
