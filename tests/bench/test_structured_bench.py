"""The schemas of `carpool bench structured`: at least 50, valid, varied, and all compile."""

from __future__ import annotations

import json

import jsonschema
import pytest

from carpool.bench.structured import load_schemas
from carpool.sampling_params import StructuredOutputsParams
from carpool.structured.grammar import GrammarCompiler
from carpool.tokenizer import load_tokenizer


def keywords(node) -> set[str]:
    if isinstance(node, dict):
        return set(node) | {k for v in node.values() for k in keywords(v)}
    if isinstance(node, list):
        return {k for v in node for k in keywords(v)}
    return set()


def test_schemas_are_many_valid_and_varied():
    schemas = load_schemas()
    assert len(schemas) >= 50 and len({s["name"] for s in schemas}) == len(schemas)
    for s in schemas:
        jsonschema.Draft202012Validator.check_schema(s["schema"])
        assert s["prompt"]
    used = keywords([s["schema"] for s in schemas])
    assert {"properties", "required", "items", "enum", "minimum", "maximum", "pattern", "format", "anyOf",
            "oneOf", "allOf", "$ref", "const", "minItems", "maxLength"} <= used


@pytest.fixture(scope="module")
def compiler(model_path):
    tokenizer = load_tokenizer(model_path)
    return GrammarCompiler(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}))


def test_every_schema_compiles(compiler):
    for s in load_schemas():
        matcher = compiler.matcher(StructuredOutputsParams(json=json.dumps(s["schema"])))
        assert not matcher.is_error(), s["name"]
