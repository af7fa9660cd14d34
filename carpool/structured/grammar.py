"""Compile a request's StructuredOutputsParams into a matcher that knows which tokens may come next.

The engine is llguidance (Microsoft's constrained-decoding library, also a vLLM backend), chosen
over xgrammar and outlines-core because it:
  * needs nothing else installed and builds its view of the vocabulary from the HF tokenizer
    carpool already has (0.3 s, once per engine);
  * compiles a grammar lazily (Earley parser over a lazily built lexer): over the 53 schemas of
    `carpool bench structured`, 0.55 ms median against xgrammar 0.2.9's 6.2 ms, which also warned
    that it ignores maxLength beside a pattern or format and does not fully support allOf
    (2026-11-30, this 2-core Xeon; outlines-core was not measured: it builds an index over the
    whole vocabulary per regex up front and has no context-free grammars);
  * takes JSON schema, regex, choice lists and Lark/GBNF grammars through one API, and computes a
    row's mask with the GIL released, so masks overlap the forward pass (carpool/structured/masks.py).
xgrammar's masks are faster (5 us against 39 us median along the same token walks), but here they
are computed while the model runs: the engine waits ~0.02 ms per step for them.
`carpool bench structured` measures what this costs per decode step.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict

from carpool.sampling_params import StructuredOutputsParams

# Compiled grammars kept for reuse: a matcher copied from a cached one skips parsing the grammar
# (clients usually send the same few schemas over and over).
GRAMMAR_CACHE_SIZE = 256


NOUNS = {"json": "JSON schema", "json_object": "JSON schema", "regex": "regular expression",
         "choice": "choice list", "grammar": "grammar"}


class GrammarError(ValueError):
    """A constraint that does not compile. `reason` says what is wrong without naming the field,
    so that the server can name the request field the client used (response_format, guided_json...)."""

    def __init__(self, kind: str, reason: str):
        super().__init__(f"structured_outputs.{kind}: {reason}")
        self.reason = reason


# Schema keywords whose value is one subschema, a list of them, or a map of names to them.
_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames",
        "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def without_unique_items(schema):
    """The schema without `uniqueItems`, which no grammar can hold (whether an item repeats one
    before it is not context-free) and llguidance refuses. Pydantic writes it for every `set[...]`
    field, so `client.chat.completions.parse()` with such a model sends it: the output keeps the
    schema's shape, and its items may repeat. Only schema positions are walked: a property that
    happens to be named "uniqueItems" stays."""
    if isinstance(schema, list):  # "items": [...] (draft 4 tuples)
        return [without_unique_items(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v for k, v in schema.items() if k != "uniqueItems"}
    for key in _ONE:
        if key in out:
            out[key] = without_unique_items(out[key])
    for key in _LIST:
        if isinstance(out.get(key), list):
            out[key] = [without_unique_items(s) for s in out[key]]
    for key in _MAP:
        if isinstance(out.get(key), dict):
            out[key] = {name: without_unique_items(s) for name, s in out[key].items()}
    return out


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar (JSON text) for a constraint. Raises ValueError when the
    constraint cannot even be turned into a grammar (e.g. a schema that is not a JSON object)."""
    import llguidance
    from llguidance import LLMatcher

    kind = params.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else params.json
        if isinstance(schema, str):
            schema = json.loads(schema)
        schema = without_unique_items(schema)
        options = {"whitespace_flexible": not params.disable_any_whitespace}
        if params.whitespace_pattern is not None:
            options["whitespace_pattern"] = params.whitespace_pattern
        return LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(params.choice))
    return llguidance.grammar_from("grammar", params.grammar)  # Lark, or GBNF converted to Lark


class GrammarCompiler:
    """Per engine: llguidance's view of the tokenizer (built on first use) and a cache of compiled
    grammars. `matcher(params)` gives a fresh matcher for one request or raises ValueError."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int]):
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size  # the model's logits width; may exceed the tokenizer's vocab
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer = None
        self._lock = threading.Lock()  # the tokenizer and the cache: engine and prepare threads
        self._cache: OrderedDict[str, object] = OrderedDict()

    @property
    def tokenizer(self):
        """llguidance's LLTokenizer over the model's vocabulary. Ids past the tokenizer's own
        vocabulary (padding rows of the LM head) have no bytes, so no grammar ever allows them."""
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                try:
                    self._tokenizer = llguidance.hf.from_tokenizer(
                        self._hf_tokenizer, n_vocab=max(self.vocab_size, len(self._hf_tokenizer)),
                        eos_token=self.eos_token_ids)
                except ValueError as e:  # a slow (non-Rust) tokenizer
                    raise ValueError(f"structured outputs need a fast tokenizer: {e}") from None
            return self._tokenizer

    def matcher(self, params: StructuredOutputsParams):
        """A matcher in its start state for `params`; GrammarError naming the problem if the
        schema, regex or grammar is invalid. Thread-safe: the server's prepare thread compiles
        (and so validates) a request's grammar before the engine thread adds it, which then only
        copies the cached matcher."""
        from llguidance import LLMatcher

        noun = NOUNS[params.kind]
        try:
            grammar = grammar_text(params)
        except (ValueError, TypeError) as e:
            raise GrammarError(params.kind, f"invalid {noun}: {e}") from None
        with self._lock:
            template = self._cache.get(grammar)
            if template is not None:
                self._cache.move_to_end(grammar)
        if template is None:
            is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
            if is_error:
                raise GrammarError(params.kind, f"invalid {noun}: {messages[0].strip()}")
            template = LLMatcher(self.tokenizer, grammar, log_level=0)
            if template.is_error():
                raise GrammarError(params.kind, f"invalid {noun}: {template.get_error().strip()}")
            with self._lock:
                self._cache[grammar] = template
                if len(self._cache) > GRAMMAR_CACHE_SIZE:
                    self._cache.popitem(last=False)
        return template.deep_copy()
