"""Structured outputs over HTTP with the official openai client: response_format (json_schema
via `chat.completions.parse`, json_object), vLLM's structured_outputs and guided_* fields,
streaming, and a bad schema as a 400 naming the field it came in.

Which constraint each field becomes, and the answers' shapes, are checked on the scripted
engine; that the real model's output follows the constraint, on the real engine."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from carpool.sampling_params import StructuredOutputsParams
from carpool.structured.masks import GRAMMAR_REFUSED
from tests.server.conftest import MODEL_NAME

MAX_TOKENS = 80

pytestmark = pytest.mark.anyio


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


class Picks(BaseModel):
    ids: set[int]  # pydantic's schema: {"type": "array", "uniqueItems": true, ...}


@pytest.fixture
def scripted_client(api):
    return openai.AsyncOpenAI(base_url="http://scripted/v1", api_key="unused", max_retries=0, http_client=api)


# ------------------------------------------------------------------ on the scripted engine
PARIS = City(name="Paris", country="France", population_millions=2, kind="capital")


async def test_parse_with_a_pydantic_model_scripted(scripted_client, scripted):
    scripted.reply = lambda prompt, params: PARIS.model_dump_json()
    completion = await scripted_client.chat.completions.parse(
        model=MODEL_NAME, messages=ask("Tell me about Paris as JSON."), response_format=City, max_tokens=MAX_TOKENS)
    assert completion.choices[0].finish_reason == "stop" and completion.choices[0].message.parsed == PARIS
    schema = scripted.added[0][1].structured_outputs.json
    assert set(schema["properties"]) == set(City.model_fields) and schema["additionalProperties"] is False


async def test_parse_with_a_set_field_scripted(scripted_client, scripted):
    """A `set[int]` field: its schema's uniqueItems is accepted (the grammar holds the list's shape)."""
    assert Picks.model_json_schema()["properties"]["ids"]["uniqueItems"] is True
    scripted.reply = lambda prompt, params: '{"ids": [3, 1, 2]}'
    completion = await scripted_client.chat.completions.parse(
        model=MODEL_NAME, messages=ask("Pick three numbers."), response_format=Picks, max_tokens=MAX_TOKENS)
    assert completion.choices[0].message.parsed == Picks(ids={1, 2, 3})
    assert scripted.added[0][1].structured_outputs.json["properties"]["ids"]["uniqueItems"] is True


@pytest.mark.parametrize("body, expected", [
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": City.model_json_schema()}}},
     StructuredOutputsParams(json=City.model_json_schema())),
    ({"guided_choice": ["positive", "negative"]}, StructuredOutputsParams(choice=["positive", "negative"])),
    ({"guided_regex": r"\d{3}-\d{4}"}, StructuredOutputsParams(regex=r"\d{3}-\d{4}")),
    ({"structured_outputs": {"choice": ["red", "green"]}}, StructuredOutputsParams(choice=["red", "green"])),
    ({"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}},
     StructuredOutputsParams(grammar='root ::= "yes" | "no"')),
    ({"guided_json": {"type": "object"}}, StructuredOutputsParams(json={"type": "object"})),
])
async def test_each_field_becomes_its_constraint(api, scripted, body, expected):
    for path, base in (("/v1/chat/completions", {"messages": ask("hi")}), ("/v1/completions", {"prompt": "hi"})):
        r = await api.post(path, json={**base, **body, "max_tokens": 4, "n": 2})
        assert r.status_code == 200, r.text
    assert [sp.structured_outputs for _, sp in scripted.added] == [expected] * 4


async def test_json_object_streamed_like_the_whole_answer_scripted(api, scripted):
    scripted.reply = lambda prompt, params: '{"capital": "Paris"}'
    body = {"messages": ask("Capital of France? JSON."), "response_format": {"type": "json_object"},
            "max_tokens": MAX_TOKENS}
    whole = (await api.post("/v1/chat/completions", json=body)).json()
    assert json.loads(whole["choices"][0]["message"]["content"]) == {"capital": "Paris"}
    r = await api.post("/v1/chat/completions", json={**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == \
        whole["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


async def test_bad_schema_via_the_client_scripted(scripted_client):
    with pytest.raises(openai.BadRequestError, match="response_format"):
        await scripted_client.chat.completions.create(
            model=MODEL_NAME, messages=ask("hi"), max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}})


@pytest.mark.parametrize("stream", [False, True])
async def test_a_refused_token_is_a_400_naming_the_constraint(api, scripted, stream):
    scripted.fail_after = (2, f"{GRAMMAR_REFUSED} 123: no path\nmore detail")
    body = {"messages": ask("hi"), "guided_choice": ["zzzz"], "max_tokens": 8, "stream": stream}
    r = await api.post("/v1/chat/completions", json=body)
    if stream:
        lines = [line for line in r.text.splitlines() if line.startswith("data: ")]
        assert r.status_code == 200 and lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2][6:])["error"]
        assert len(lines) == 5  # the role, two tokens, the error, [DONE]
    else:
        assert r.status_code == 400, r.text
        error = r.json()["error"]
    assert error["code"] == "constraint_failed" and error["param"] == "structured_outputs"
    assert error["message"] == f"{GRAMMAR_REFUSED} 123: no path (the constraint could not be followed)"
    scripted.fail_after = None
    ok = await api.post("/v1/chat/completions", json={**body, "stream": False})
    assert ok.status_code == 200


# ------------------------------------------------------------------ on the real engine


@pytest.mark.slow  # which constraint, and the shapes: the scripted tests
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


@pytest.mark.slow  # which constraint, and the shapes: the scripted tests
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
@pytest.mark.slow  # which constraint, and the shapes: the scripted tests
def test_vllm_fields(client, extra, check):
    out = client.chat.completions.create(model=MODEL_NAME, messages=ask("I love this movie! Sentiment?"),
                                         max_tokens=MAX_TOKENS, temperature=0, n=2, extra_body=extra)
    for choice in out.choices:
        assert choice.finish_reason == "stop" and check(choice.message.content), choice.message.content


@pytest.mark.slow  # which constraint, and the shapes: the scripted tests
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
async def test_bad_constraints_are_400s_naming_the_field(http, body, param, words):
    for path, base in (("/v1/chat/completions", {"messages": ask("hi")}), ("/v1/completions", {"prompt": "hi"})):
        r = await http.post(path, json={"model": MODEL_NAME, **base, **body})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == param and words in error["message"], error
    assert http.wait_idle()


@pytest.mark.slow  # which constraint, and the shapes: the scripted tests
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


def test_a_constraint_left_with_no_token_is_the_requests_error():
    """Its constraint plus its own token controls (logit_bias, min_tokens, ...) allow no token:
    a 400 naming structured_outputs, not the engine's 500."""
    from carpool.sampler import NO_ALLOWED_TOKEN
    from carpool.server.serving import generation_error

    message, status, param, code = generation_error("r1", f"{NO_ALLOWED_TOKEN} (logit_bias)")
    assert (status, param, code) == (400, "structured_outputs", "constraint_failed")
    assert message.startswith(NO_ALLOWED_TOKEN)
    assert generation_error("r1", "sampling failed: the logits became NaN")[1] == 500
