"""What a client written for vLLM or OpenAI expects: its fields, probes, metric names and types."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from carpool.server.metrics import ServerMetrics

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}


def test_unknown_fields_are_ignored_and_logged_once(served, caplog):
    caplog.set_level(logging.WARNING, logger="carpool.server")
    for _ in range(2):
        r = httpx.post(served.v1 + "/completions", json={"prompt": "Hi", "max_tokens": 2, "cache_prompt": False,
                                                         "n_probs": 3})
        assert r.status_code == 200
    warnings = [m for m in caplog.messages if "cache_prompt" in m]
    assert len(warnings) == 1 and "n_probs" in warnings[0]


@pytest.mark.parametrize("field, value", [
    ("guided_decoding_backend", "xgrammar"), ("logits_processors", ["mine"]), ("use_beam_search", True),
    ("tool_choice", "required"),
])
def test_fields_that_would_change_the_output_are_refused(served, field, value):
    for path, body in (("/completions", {"prompt": "Hi"}), ("/chat/completions", CHAT)):
        r = httpx.post(served.v1 + path, json=dict(body, **{field: value}))
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def test_harmless_values_of_those_fields_pass(served):
    r = httpx.post(served.v1 + "/chat/completions", json=dict(CHAT, tool_choice="none", guided_json=None))
    assert r.status_code == 200


def test_version_and_ping(served):
    assert httpx.get(served.url + "/version").json()["version"]
    assert httpx.get(served.url + "/ping").status_code == 200
    assert httpx.post(served.url + "/ping").status_code == 200


def test_metrics_under_vllm_names():
    for namespace in ("carpool", "vllm"):
        text = ServerMetrics("m", 2048, namespace=namespace).render()[0].decode()
        for name in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc",
                     "time_to_first_token_seconds_bucket"):
            assert f"{namespace}:{name}" in text
    with pytest.raises(ValueError):
        ServerMetrics("m", 2048, namespace="other")


def test_responses_validate_against_the_openai_types(served):
    body = {"prompt": "Hi", "max_tokens": 3, "logprobs": 2, "n": 2}
    Completion.model_validate(httpx.post(served.v1 + "/completions", json=body).json())
    ChatCompletion.model_validate(httpx.post(served.v1 + "/chat/completions",
                                             json=dict(CHAT, logprobs=True, top_logprobs=2)).json())
    with httpx.stream("POST", served.v1 + "/chat/completions",
                      json=dict(CHAT, stream=True, stream_options={"include_usage": True})) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert chunks and all(ChatCompletionChunk.model_validate(c) for c in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 3


def test_vllm_serve_command_line_parses_and_maps(caplog, monkeypatch):
    from carpool.args import apply_vllm_engine_flags
    from carpool.cli import build_parser, engine_config
    from carpool.server.options import ServerOptions

    monkeypatch.setenv("VLLM_API_KEY", "from-vllm-env")
    monkeypatch.delenv("CARPOOL_API_KEY", raising=False)
    args = build_parser().parse_args([
        "serve", "some-model.gguf", "--gpu-memory-utilization", "0.85", "--kv-cache-memory-bytes", "1000000",
        "--served-model-name", "a", "b", "--chat-template", "{{ messages[0].content }}", "--enforce-eager",
        "--no-enable-chunked-prefill", "--allowed-origins", '["https://x.example"]', "--enable-log-requests",
        "--metrics-namespace", "vllm"])
    args.model = args.model_tag
    caplog.set_level(logging.WARNING, logger="carpool")
    config = apply_vllm_engine_flags(args, engine_config(args))
    options = ServerOptions.from_args(args)
    assert config.kv_cache_memory == 1_000_000 and config.model == "some-model.gguf"
    assert config.enforce_eager is True  # honoured, as in vLLM
    assert options.api_key == "from-vllm-env" and options.served_model_name == ["a", "b"]
    assert options.allowed_origins == ["https://x.example"] and options.enable_log_requests
    assert options.chat_template_text() == "{{ messages[0].content }}" and options.metrics_namespace == "vllm"
    text = " ".join(caplog.messages)
    assert "--gpu-memory-utilization" in text and "chunked" in text and "--enforce-eager" not in text


def test_cors_and_chat_template(server_factory):
    s = server_factory(allowed_origins=["https://app.example"], chat_template="[{{ messages[-1].content }}]")
    r = httpx.options(s.v1 + "/chat/completions", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    tokens = httpx.post(s.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
    assert s.engine.tokenizer.decode(tokens) == "[hi]"
