"""Schema fuzzing: schemathesis generates requests from the server's own OpenAPI schema (valid
ones, then invalid ones in its negative mode); none may get a 5xx, every answer conforms to the
schema (a documented status, content type and body schema: errors in OpenAI's error body), and
afterwards the engine holds nothing: 0 running, 0 waiting, 0% of the KV cache in use. The default suite fuzzes the
app over the scripted engine, in process, with a bounded number of examples per operation; the
slow suite a real server as well, and many more examples.

(schemathesis' pytest plugin does not run under pytest 9, so its Hypothesis strategies are
driven directly.)"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from carpool.server.app import BODY_MODELS, create_app
from carpool.server.options import ServerOptions
from tests.server.scripted import MODEL_NAME, ScriptedEngine

CONFORMANCE = [status_code_conformance, content_type_conformance, response_schema_conformance]
MAX_MODEL_LEN = 48  # bounds the work of any generated request: at most 4 choices x 48 tokens


@dataclass
class Target:
    schema: Any
    call: Callable  # a generated case -> its response
    idle: Callable[[], bool]  # nothing running, waiting or held


@pytest.fixture(scope="module", params=["scripted", pytest.param("real", marks=pytest.mark.slow)])
def target(request, tokenizer, structured):
    if request.param == "scripted":
        engine = ScriptedEngine(tokenizer, structured, len(tokenizer), max_model_len=MAX_MODEL_LEN)
        app = create_app(engine, ServerOptions(served_model_name=[MODEL_NAME], max_choices_per_request=4))
        engine.start()  # what the lifespan does; the cases call the app without one
        schema = schemathesis.openapi.from_dict(app.openapi())
        schema.app = app  # (as openapi.from_asgi sets it, without running the lifespan to its end)
        return Target(schema, lambda case: case.call(),
                      lambda: engine.idle and engine.num_waiting == 0)
    server = request.getfixturevalue("server_factory")({"max_model_len": MAX_MODEL_LEN}, max_choices_per_request=4)

    def idle() -> bool:
        return (server.wait_idle(timeout=30) and server.metric("carpool:num_requests_running") == 0
                and server.metric("carpool:num_requests_waiting") == 0
                and server.metric("carpool:kv_cache_usage_perc") == 0
                and httpx.get(server.url + "/health").status_code == 200)

    return Target(schemathesis.openapi.from_dict(httpx.get(server.url + "/openapi.json").json()),
                  lambda case: case.call(base_url=server.url, timeout=120), idle)


@pytest.fixture(scope="module")
def api_schema(target):
    return target.schema


def operations(api_schema) -> list:
    return [result.ok() for result in api_schema.get_all_operations()]


def fuzz(api_schema, target: Target, max_examples: int) -> int:
    """Every operation, valid bodies and then invalid ones; returns the number of calls."""
    calls = 0
    for operation in operations(api_schema):
        has_body = operation.path in BODY_MODELS  # nothing can be invalid about a bare GET or /ping
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if has_body else (GenerationMode.POSITIVE,):
            @settings(max_examples=max_examples, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case):
                nonlocal calls
                calls += 1
                response = target.call(case)
                assert response.status_code < 500, (case.method, case.path, case.body, response.status_code,
                                                    response.text)
                # the answer is one the schema documents: its status, content type and body schema
                case.validate_response(response, checks=CONFORMANCE)

            run()
    return calls


def test_schema_describes_the_request_bodies(api_schema):
    """The schema is precise enough to mean something: the request models, with their limits."""
    raw = api_schema.raw_schema
    body = raw["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    completion = raw["components"]["schemas"][body["$ref"].rsplit("/", 1)[1]]
    assert "prompt" in completion["required"]
    temperature = next(s for s in completion["properties"]["temperature"]["anyOf"] if s.get("type") == "number")
    assert temperature["maximum"] == 100.0
    assert {f"{o.method.upper()} {o.path}" for o in operations(api_schema)} >= {
        "POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize", "POST /detokenize",
        "GET /v1/models", "GET /health"}


def test_no_server_error_for_any_generated_request(api_schema, target):
    assert fuzz(api_schema, target, max_examples=10) > 50


@pytest.mark.slow
@pytest.mark.parametrize("target", ["real"], indirect=True)  # the scripted app is fuzzed above
def test_no_server_error_long(api_schema, target):
    assert fuzz(api_schema, target, max_examples=250) > 1000


def test_after_fuzzing_nothing_is_held(target):
    assert target.idle()


def test_the_schema_documents_each_routes_errors(tokenizer, structured):
    engine = ScriptedEngine(tokenizer, structured, len(tokenizer))
    raw = create_app(engine, ServerOptions(api_key="k")).openapi()
    codes = {f"{method.upper()} {path}": set(op["responses"]) for path, ops in raw["paths"].items()
             for method, op in ops.items()}
    generating = {"200", "400", "401", "404", "413", "415", "500", "503"}
    assert codes["POST /v1/completions"] == codes["POST /v1/chat/completions"] == generating
    assert codes["POST /tokenize"] == codes["POST /detokenize"] == generating - {"503"}
    assert codes["GET /v1/models"] == {"200", "401"}
    assert codes["GET /health"] == codes["GET /ping"] == codes["GET /metrics"] == {"200", "503"}
    error = raw["paths"]["/tokenize"]["post"]["responses"]["413"]["content"]["application/json"]["schema"]
    assert error == {"$ref": "#/components/schemas/ErrorResponse"}
    assert raw["components"]["schemas"]["ErrorDetail"]["required"] == ["message", "type", "param", "code"]
    without_key = create_app(engine, ServerOptions()).openapi()
    assert "401" not in without_key["paths"]["/v1/completions"]["post"]["responses"]


@pytest.mark.anyio
async def test_health_and_ping_answer_json(api):
    for r in (await api.get("/health"), await api.get("/ping"), await api.post("/ping")):
        assert r.status_code == 200 and r.json() == {"status": "ok"}
