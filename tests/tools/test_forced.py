"""The JSON schemas that force a call (llguidance accepts them), and their outputs read back."""

from __future__ import annotations

import json

from carpool.tools.forced import EMPTY_OBJECT, forced_output_parser, forced_schema

F = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "x": {"type": "integer"}}, "required": ["x"]}}}
G = {"type": "function", "function": {"name": "g"}}  # no parameters: an empty object


def test_named_is_the_functions_parameters():
    named = {"type": "function", "function": {"name": "f"}}
    assert forced_schema([F, G], named) == F["function"]["parameters"]
    assert forced_schema([F, G], {"type": "function", "function": {"name": "g"}}) == EMPTY_OBJECT
    assert forced_output_parser(named).parse('{"x": 1}').tool_calls[0].name == "f"


def test_required_is_an_array_of_one_branch_per_tool():
    schema = forced_schema([F, G], "required")
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    branches = schema["items"]["anyOf"]
    assert [b["properties"]["name"]["enum"] for b in branches] == [["f"], ["g"]]
    assert branches[0]["properties"]["parameters"] == F["function"]["parameters"]
    assert forced_schema([F, G], "required", parallel=False)["maxItems"] == 1


def test_llguidance_accepts_them_and_their_output_parses():
    from llguidance import LLMatcher

    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        grammar = LLMatcher.grammar_from_json_schema(forced_schema([F, G], choice))
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar)
        assert not is_error, messages
    text = json.dumps([{"name": "g", "parameters": {}}, {"name": "f", "parameters": {"x": 2}}])
    calls = forced_output_parser("required").parse(text).tool_calls
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("g", {}), ("f", {"x": 2})]
