"""Compiling constraints (carpool/structured/grammar.py): bad ones are named, good ones cached."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from carpool.sampling_params import SamplingParams, StructuredOutputsParams
from carpool.structured.grammar import GrammarCompiler, GrammarError
from carpool.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return load_tokenizer(model_path)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    # 64 more logits than the tokenizer has tokens, as models with a padded LM head have
    return GrammarCompiler(tokenizer, len(tokenizer) + 64, frozenset({tokenizer.eos_token_id}))


def allowed(compiler, matcher) -> set[int]:
    from llguidance.torch import fill_next_token_bitmask

    mask = torch.zeros(1, (compiler.tokenizer.vocab_size + 31) // 32, dtype=torch.int32)
    fill_next_token_bitmask(matcher, mask)
    bits = np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


@pytest.mark.parametrize("params, kind, words", [
    (dict(json={"type": "objekt"}), "json", "objekt"),
    (dict(json={"$ref": "#/definitions/missing"}), "json", "missing"),
    (dict(json={"type": "string", "pattern": "(("}), "json", "unclosed"),
    (dict(regex="a((b"), "regex", "unclosed"),
    (dict(grammar="start: ("), "grammar", ""),
])
def test_bad_constraints_are_named(compiler, params, kind, words):
    with pytest.raises(GrammarError) as info:
        compiler.matcher(StructuredOutputsParams(**params))
    assert str(info.value).startswith(f"structured_outputs.{kind}: invalid")
    assert words in str(info.value)


def test_shape_errors_are_value_errors():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{")
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs.kind == "regex"


def test_cached_grammar_gives_independent_matchers(compiler, tokenizer):
    params = StructuredOutputsParams(choice=["yes", "no"])
    a, b = compiler.matcher(params), compiler.matcher(params)
    assert a is not b
    assert a.consume_tokens(tokenizer.encode("yes", add_special_tokens=False))
    assert a.is_stopped() and not b.is_stopped()
    assert b.consume_tokens(tokenizer.encode("no", add_special_tokens=False))


def test_padding_ids_never_allowed_and_eos_only_when_complete(compiler, tokenizer):
    m = compiler.matcher(StructuredOutputsParams(json_object=True))
    first = allowed(compiler, m)
    assert first and all(tokenizer.decode([t]).startswith("{") for t in first)
    assert not any(t >= len(tokenizer) for t in first)
    assert tokenizer.eos_token_id not in first
    assert m.consume_tokens(tokenizer.encode("{}", add_special_tokens=False))
    assert allowed(compiler, m) == {tokenizer.eos_token_id}


def test_unique_items_is_accepted_as_the_shape_of_a_list(compiler, tokenizer):
    """What `client.chat.completions.parse()` sends for a `set[int]` field: the output is held to
    an array of integers (uniqueness is not something a grammar can hold)."""
    from carpool.structured.grammar import without_unique_items

    schema = {"type": "object", "required": ["ids"], "properties": {
        "ids": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
        "uniqueItems": {"type": "string"}}}  # a property of that name is not the keyword
    assert without_unique_items(schema)["properties"] == {"ids": {"type": "array", "items": {"type": "integer"}},
                                                          "uniqueItems": {"type": "string"}}
    nested = {"$defs": {"S": {"anyOf": [{"type": "array", "uniqueItems": True, "items": {"type": "string"}}]}}}
    assert without_unique_items(nested) == {"$defs": {"S": {"anyOf": [{"type": "array", "items": {"type": "string"}}]}}}
    m = compiler.matcher(StructuredOutputsParams(json=schema))
    assert m.consume_tokens(tokenizer.encode('{"ids": [1, 2, 2], "uniqueItems": "x"}', add_special_tokens=False))
    assert tokenizer.eos_token_id in allowed(compiler, m)
    m = compiler.matcher(StructuredOutputsParams(json=schema))
    assert not m.consume_tokens(tokenizer.encode('{"ids": ["a"]', add_special_tokens=False))
