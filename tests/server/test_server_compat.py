"""What a client written for vLLM or OpenAI expects: its fields, probes, metric names and types."""

from __future__ import annotations

import json
import logging

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from carpool.server.metrics import ServerMetrics

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}

pytestmark = pytest.mark.anyio


async def test_unknown_fields_are_ignored_and_logged_once(http, caplog):
    caplog.set_level(logging.WARNING, logger="carpool.server")
    for _ in range(2):
        r = await http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "cache_prompt": False,
                                                      "n_probs": 3})
        assert r.status_code == 200
    warnings = [m for m in caplog.messages if "cache_prompt" in m]
    assert len(warnings) == 1 and "n_probs" in warnings[0]


@pytest.mark.parametrize("field, value", [
    ("guided_decoding_backend", "xgrammar"), ("logits_processors", ["mine"]), ("use_beam_search", True),
    ("tool_choice", "required"),
])
async def test_fields_that_would_change_the_output_are_refused(http, field, value):
    for path, body in (("/v1/completions", {"prompt": "Hi"}), ("/v1/chat/completions", CHAT)):
        r = await http.post(path, json=dict(body, **{field: value}))
        assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


async def test_harmless_values_of_those_fields_pass(http):
    r = await http.post("/v1/chat/completions", json=dict(CHAT, tool_choice="none", guided_json=None))
    assert r.status_code == 200


async def test_version_and_ping(http):
    assert (await http.get("/version")).json()["version"]
    assert (await http.get("/ping")).status_code == 200
    assert (await http.post("/ping")).status_code == 200


def test_metrics_under_vllm_names():
    for namespace in ("carpool", "vllm"):
        text = ServerMetrics("m", 2048, namespace=namespace).render()[0].decode()
        for name in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc",
                     "time_to_first_token_seconds_bucket"):
            assert f"{namespace}:{name}" in text
    with pytest.raises(ValueError):
        ServerMetrics("m", 2048, namespace="other")


async def test_responses_validate_against_the_openai_types(http):
    body = {"prompt": "Hi", "max_tokens": 3, "logprobs": 2, "n": 2, "ignore_eos": True}
    Completion.model_validate((await http.post("/v1/completions", json=body)).json())
    ChatCompletion.model_validate((await http.post("/v1/chat/completions",
                                                   json=dict(CHAT, logprobs=True, top_logprobs=2))).json())
    r = await http.post("/v1/chat/completions", json=dict(CHAT, stream=True, ignore_eos=True,
                                                          stream_options={"include_usage": True}))
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
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


async def test_cors_and_chat_template(make_http):
    async with make_http(allowed_origins=["https://app.example"], chat_template="[{{ messages[-1].content }}]") as s:
        r = await s.options("/v1/chat/completions", headers={
            "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
        r = await s.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]})
        assert s.ctx.tokenizer.decode(r.json()["tokens"]) == "[hi]"


async def test_api_key(make_http):
    async with make_http(api_key="sekret") as s:
        r = await s.get("/v1/models")
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert r.headers["www-authenticate"] == "Bearer"
        assert (await s.get("/v1/models", headers={"Authorization": "Bearer wrong"})).status_code == 401
        assert (await s.post("/tokenize", json={"prompt": "x"})).status_code == 401
        assert (await s.get("/health")).status_code == 200  # probes need no key
        assert (await s.get("/metrics")).status_code == 200
        for scheme in ("Bearer", "bearer", "BEARER"):  # the scheme is case-insensitive (RFC 7235)
            r = await s.get("/v1/models", headers={"Authorization": f"{scheme} sekret"})
            assert r.status_code == 200, scheme
        for auth in ("bearer SEKRET", "Basic sekret", "sekret", "Bearer  sekret", "Bearer"):
            assert (await s.get("/v1/models", headers={"Authorization": auth})).status_code == 401, auth
    async with make_http(api_key=["one", "two"]) as s:  # vLLM's --api-key K1 K2: any of them
        for key, status in (("one", 200), ("two", 200), ("three", 401), ("one two", 401)):
            assert (await s.get("/v1/models", headers={"Authorization": f"Bearer {key}"})).status_code == status


THINKING_TEMPLATE = "{% if enable_thinking %}<think>{% endif %}[{{ messages[-1].content }}]"


async def test_chat_template_kwargs(make_http):
    """The request's chat_template_kwargs reach the template, over --default-chat-template-kwargs;
    keys the template does not read, or that are apply_chat_template's own arguments, are dropped."""
    async with make_http(chat_template=THINKING_TEMPLATE, default_chat_template_kwargs={"enable_thinking": True}) as s:
        async def rendered(**body) -> str:
            r = await s.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}], **body})
            assert r.status_code == 200, r.text
            return s.ctx.tokenizer.decode(r.json()["tokens"])

        assert await rendered() == "<think>[hi]"  # the server's default
        assert await rendered(chat_template_kwargs={"enable_thinking": False}) == "[hi]"
        assert await rendered(chat_template_kwargs={"return_dict": True, "tokenize": False, "unused": 1}) == "<think>[hi]"
        r = await s.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                                                       "chat_template_kwargs": {"enable_thinking": False}})
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(s.ctx.tokenizer.encode("[hi]"))
        r = await s.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        assert r.json()["usage"]["prompt_tokens"] == len(s.ctx.tokenizer.encode("<think>[hi]"))


def test_default_chat_template_kwargs_flag():
    from carpool.cli import build_parser
    from carpool.server.options import ServerOptions

    args = build_parser().parse_args(["serve", "m.gguf", "--default-chat-template-kwargs", '{"enable_thinking": false}'])
    assert ServerOptions.from_args(args).default_chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m.gguf", "--default-chat-template-kwargs", "[1]"])


# ------------------------------------------------------------------ vLLM's server flags
async def test_root_path_keeps_the_guards(make_http):
    """Behind --root-path a proxy may pass /api/v1/... on unchanged: it is routed, and the API
    key and the body guard cover it as they cover /v1/..."""
    async with make_http(root_path="/api", api_key="k") as s:
        key = {"Authorization": "Bearer k"}
        for path in ("/api/v1/models", "/v1/models"):
            assert (await s.get(path)).status_code == 401, path
            assert (await s.get(path, headers=key)).status_code == 200, path
        r = await s.post("/api/v1/completions", content=b'{"prompt": "Hi"}', headers=dict(key, **{"Content-Type": "text/plain"}))
        assert r.status_code == 415
        r = await s.post("/api/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers=key)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1
        assert (await s.get("/api/health")).status_code == 200


async def test_response_role(make_http):
    async with make_http(response_role="bot") as s:
        r = await s.post("/v1/chat/completions", json=CHAT)
        assert r.json()["choices"][0]["message"]["role"] == "bot"
        r = await s.post("/v1/chat/completions", json=dict(CHAT, stream=True))
        first = json.loads(r.text.splitlines()[0][6:])
        assert first["choices"][0]["delta"]["role"] == "bot"


def _names(body: dict) -> list[str]:
    """Every token name in a completion's or a chat completion's logprobs."""
    lp = body["choices"][0]["logprobs"]
    if "content" in lp:
        return [n for c in lp["content"] for n in [c["token"]] + [t["token"] for t in c["top_logprobs"]]]
    return lp["tokens"] + [k for top in lp["top_logprobs"] for k in top]


async def test_return_tokens_as_token_ids(make_http):
    chat = dict(CHAT, logprobs=True, top_logprobs=2, temperature=0)  # greedy: the same tokens twice
    completion = {"prompt": "Hi", "max_tokens": 3, "logprobs": 2, "temperature": 0}
    async with make_http(return_tokens_as_token_ids=True) as s:
        for path, body in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
            r = (await s.post(path, json=body)).json()
            names = _names(r)
            assert len(names) >= 6 and all(n.startswith("token_id:") and n[9:].isdigit() for n in names), names
            ids = [int(n[9:]) for n in names]
            assert all(0 <= t < s.ctx.vocab_size for t in ids)
            plain = _names((await s.post(path, json=dict(body, return_tokens_as_token_ids=False))).json())
            assert plain == [s.ctx.token_str(t) for t in ids]  # the same tokens, by their text
    async with make_http() as s:
        r = (await s.post("/v1/completions", json=dict(completion, return_tokens_as_token_ids=True))).json()
        assert all(n.startswith("token_id:") for n in _names(r))
        assert not any(n.startswith("token_id:") for n in _names((await s.post("/v1/completions", json=completion)).json()))


async def test_max_logprobs(make_http):
    async with make_http(max_logprobs=2) as s:
        for path, body, param in (("/v1/chat/completions", dict(CHAT, logprobs=True, top_logprobs=3), "top_logprobs"),
                                  ("/v1/completions", {"prompt": "Hi", "logprobs": 3}, "logprobs"),
                                  ("/v1/completions", {"prompt": "Hi", "prompt_logprobs": 3}, "prompt_logprobs")):
            r = await s.post(path, json=body)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
            assert "--max-logprobs" in r.json()["error"]["message"]
        r = await s.post("/v1/completions", json={"prompt": "Hi", "logprobs": 2, "max_tokens": 1})
        # the top 2, and the sampled token when it is not among them
        assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["top_logprobs"][0]) in (2, 3)
    from carpool.server.options import ServerOptions

    assert ServerOptions().max_logprobs == 20  # vLLM's default
    with pytest.raises(ValueError):
        ServerOptions(max_logprobs=21)


async def test_openapi_and_docs(make_http):
    async with make_http() as s:
        assert (await s.get("/openapi.json")).status_code == 200
        assert (await s.get("/docs")).status_code == 404  # no docs page: its scripts would come from a CDN
    async with make_http(disable_fastapi_docs=True) as s:
        assert (await s.get("/openapi.json")).status_code == 404
        assert (await s.get("/v1/models")).status_code == 200


def test_vllm_server_flags_parse(caplog):
    from carpool.args import _warned, apply_vllm_engine_flags
    from carpool.cli import build_parser, engine_config
    from carpool.server.options import ServerOptions

    def parse(*flags):
        args = build_parser().parse_args(["serve", "m.gguf", *flags])
        args.model = args.model_tag
        return args, ServerOptions.from_args(args)

    args, options = parse("--root-path", "/api", "--response-role", "bot", "--return-tokens-as-token-ids",
                          "--max-logprobs", "5", "--disable-fastapi-docs", "--enable-prompt-tokens-details",
                          "--kv-cache-dtype", "auto")
    assert (options.root_path, options.response_role, options.return_tokens_as_token_ids, options.max_logprobs,
            options.disable_fastapi_docs) == ("/api", "bot", True, 5, True)
    caplog.set_level(logging.WARNING, logger="carpool")
    _warned.discard("--kv-cache-dtype fp8")
    apply_vllm_engine_flags(args, engine_config(args))
    assert "kv-cache-dtype" not in " ".join(caplog.messages)  # auto: what carpool does anyway
    args, _ = parse("--kv-cache-dtype", "fp8")
    apply_vllm_engine_flags(args, engine_config(args))
    assert sum("--kv-cache-dtype fp8" in m for m in caplog.messages) == 1
    assert parse("--api-key", "a", "b")[1].api_key == ["a", "b"]
    _, defaults = parse()
    assert (defaults.root_path, defaults.response_role, defaults.max_logprobs) == ("", "assistant", 20)


async def test_tokenizer_info(make_http, tokenizer):
    """vLLM's GET /tokenizer_info (behind --enable-tokenizer-info-endpoint): the tokenizer_config.json
    that `carpool export-tokenizer` writes, with the class, chat template and context served."""
    async with make_http() as s:
        assert (await s.get("/tokenizer_info")).status_code == 404
    async with make_http(enable_tokenizer_info_endpoint=True, api_key="k") as s:
        assert (await s.get("/tokenizer_info")).status_code == 401
        r = await s.get("/tokenizer_info", headers={"Authorization": "Bearer k"})
        assert r.status_code == 200, r.text
        info = r.json()
        assert info["tokenizer_class"] and info["model_max_length"] == s.ctx.max_model_len
        assert info["eos_token"] == tokenizer.eos_token and info["chat_template"] == tokenizer.chat_template
        assert (await s.get("/tokenizer_info", headers={"Authorization": "Bearer k"})).json() == info
