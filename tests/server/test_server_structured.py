"""Structured outputs over HTTP with the official openai client: response_format (json_schema
via `chat.completions.parse`, json_object), vLLM's structured_outputs and guided_* fields,
streaming, and a bad schema as a 400 naming the field it came in."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server.conftest import MODEL_NAME

MAX_TOKENS = 80


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population_millions: int = Field(ge=0, le=100)
    kind: Literal["capital", "port", "other"]


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.v1, api_key="unused", max_retries=0)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_parse_with_a_pydantic_model(client):
    completion = client.chat.completions.parse(
        model=MODEL_NAME, messages=ask("Tell me about Paris as JSON."), response_format=City,
        max_tokens=MAX_TOKENS, temperature=0)
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, City)  # the client validated it against the model
    assert City.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_object_and_streaming_match(client):
    kwargs = dict(model=MODEL_NAME, messages=ask("What is the capital of France? Answer in JSON."),
                  response_format={"type": "json_object"}, max_tokens=MAX_TOKENS, temperature=0)
    whole = client.chat.completions.create(**kwargs)
    text = whole.choices[0].message.content
    assert whole.choices[0].finish_reason == "stop" and isinstance(json.loads(text), dict)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_completions_json_schema_response_format(client):
    schema = City.model_json_schema()
    out = client.completions.create(
        model=MODEL_NAME, prompt="A city, as JSON:", max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}})
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].text), schema)


@pytest.mark.parametrize("extra, check", [
    ({"guided_choice": ["positive", "negative"]}, lambda t: t in ("positive", "negative")),
    ({"guided_regex": r"\d{3}-\d{4}"}, lambda t: re.fullmatch(r"\d{3}-\d{4}", t)),
    ({"structured_outputs": {"choice": ["red", "green"]}}, lambda t: t in ("red", "green")),
    ({"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}}, lambda t: t in ("yes", "no")),
    ({"guided_json": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}},
     lambda t: isinstance(json.loads(t)["ok"], bool)),
])
def test_vllm_fields(client, extra, check):
    out = client.chat.completions.create(model=MODEL_NAME, messages=ask("I love this movie! Sentiment?"),
                                         max_tokens=MAX_TOKENS, temperature=0, n=2, extra_body=extra)
    for choice in out.choices:
        assert choice.finish_reason == "stop" and check(choice.message.content), choice.message.content


def test_streamed_completion_follows_the_regex(client):
    stream = client.completions.create(model=MODEL_NAME, prompt="Call me at", max_tokens=MAX_TOKENS,
                                       temperature=0, stream=True, extra_body={"guided_regex": r" \(\d{3}\) \d{4}"})
    text = "".join(c.choices[0].text for c in stream if c.choices)
    assert re.fullmatch(r" \(\d{3}\) \d{4}", text)


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format", "invalid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format", "schema"),
    ({"response_format": {"type": "structural_tag"}}, "response_format", ""),
    ({"guided_json": {"type": "string", "pattern": "(("}}, "guided_json", "invalid JSON schema"),
    ({"guided_regex": "a(("}, "guided_regex", "invalid regular expression"),
    ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs", "invalid grammar"),
    ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs", "exactly one"),
    ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice", "only one"),
])
def test_bad_constraints_are_400s_naming_the_field(served, body, param, words):
    for path, base in (("/chat/completions", {"messages": ask("hi")}), ("/completions", {"prompt": "hi"})):
        r = httpx.post(served.v1 + path, json={"model": MODEL_NAME, **base, **body}, timeout=30)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and words in error["message"], error
    assert served.wait_idle()


def test_bad_schema_via_the_client(client):
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(
            model=MODEL_NAME, messages=ask("hi"), max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}})


@pytest.mark.parametrize("stream", [False, True])
def test_a_token_the_grammar_refuses_fails_that_request_as_a_400_and_the_server_goes_on(served, monkeypatch, stream):
    """llguidance can allow a token it then refuses (fuzzing found a guided_choice that does); here
    the masks are switched off, so the model samples tokens the choice cannot take."""
    monkeypatch.setattr(served.engine.structured, "start_masks", lambda batch: None)
    body = {"model": MODEL_NAME, "messages": ask("hi"), "guided_choice": ["zzzz"], "max_tokens": 8,
            "stream": stream}
    r = httpx.post(served.v1 + "/chat/completions", json=body, timeout=60)
    error = (r.json() if not stream else
             next(json.loads(line[5:]) for line in r.text.splitlines() if '"error"' in line))["error"]
    assert (r.status_code == 400) != stream, r.text  # a stream has already said 200
    assert error["code"] == "constraint_failed" and error["param"] == "structured_outputs"
    assert "the grammar refused token" in error["message"], error
    assert served.wait_idle()
    monkeypatch.undo()
    ok = httpx.post(served.v1 + "/chat/completions", timeout=60, json={**body, "stream": False})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "zzzz"
