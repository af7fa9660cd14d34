"""Sampling fields a request leaves unset come from the model's generation_config.json."""

from __future__ import annotations

import pytest

from carpool.server.async_engine import AsyncLLMEngine
from carpool.server.options import ServerOptions
from carpool.server.protocol import CompletionRequest, parse_request
from carpool.server.serving import ServingContext


@pytest.fixture
def served_engine(served):
    """The shared server's engine: only its model_config is read (and patched) here."""
    return served.engine


def test_generation_config_fills_unset_fields(served_engine, monkeypatch):
    monkeypatch.setattr(served_engine.model_config, "generation_defaults",
                        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1})
    ctx = ServingContext(AsyncLLMEngine(served_engine), ServerOptions())
    sp = ctx.sampling_params(parse_request(CompletionRequest, b'{"prompt": "Hi"}'), 16, 0, None)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.repetition_penalty) == (0.6, 0.9, 20, 0.05, 1.1)
    body = b'{"prompt": "Hi", "temperature": 0, "top_p": 1, "top_k": 0, "min_p": 0, "repetition_penalty": 1}'
    sp = ctx.sampling_params(parse_request(CompletionRequest, body), 16, 0, None)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.repetition_penalty) == (0, 1, -1, 0, 1)


def test_without_generation_config_the_openai_defaults(served_engine):
    assert served_engine.model_config.generation_defaults == {}
    ctx = ServingContext(AsyncLLMEngine(served_engine), ServerOptions())
    sp = ctx.sampling_params(parse_request(CompletionRequest, b'{"prompt": "Hi"}'), 16, 0, None)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.min_p, sp.repetition_penalty) == (1.0, 1.0, -1, 0.0, 1.0)
