"""Tool-call parsers over crafted text: whole, and streamed in every possible split."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from carpool.tools import TOOL_PARSERS, HermesToolParser, StreamDelta, get_tool_parser
from carpool.tools.forced import NamedCallParser, RequiredCallsParser
from tests.helpers import examples

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2]}}\n</tool_call>'


def streamed(parser, pieces: list[str]) -> tuple[str, list[dict], list[StreamDelta]]:
    """Content and calls as a streaming client would assemble them from the deltas."""
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    content, calls = "", {}
    for d in deltas:
        content += d.content
        for c in d.tool_calls:
            if c.name is not None:
                assert c.index not in calls and c.id and c.index == len(calls)  # the name comes first
                calls[c.index] = {"name": c.name, "arguments": c.arguments}
            else:
                calls[c.index]["arguments"] += c.arguments
    return content, [calls[i] for i in sorted(calls)], deltas


def test_registry():
    assert get_tool_parser("hermes") is HermesToolParser and "hermes" in TOOL_PARSERS
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")


def test_hermes_calls_and_content():
    text = "Let me check.\n" + WEATHER + "\n" + WEATHER.replace("Paris", "Rome") + "\n"
    m = HermesToolParser().parse(text)
    assert m.content == "Let me check.\n"
    assert [c.name for c in m.tool_calls] == ["get_weather", "get_weather"]
    assert [json.loads(c.arguments)["city"] for c in m.tool_calls] == ["Paris", "Rome"]
    assert len({c.id for c in m.tool_calls}) == 2 and m.tool_calls[0].id.startswith("call_")


def test_hermes_only_calls_means_no_content():
    m = HermesToolParser().parse("\n" + WEATHER + "\n\n")
    assert m.content is None and len(m.tool_calls) == 1


@pytest.mark.parametrize("text", ["Paris is sunny.", "  \n", "a < b and <tool", "x <tool_call", ""])
def test_hermes_text_without_calls_is_returned_exactly(text):
    m = HermesToolParser().parse(text)
    assert m.content == text and m.tool_calls == []


def test_hermes_other_key_order_and_unclosed_block():
    m = HermesToolParser().parse('<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>')
    assert [(c.name, json.loads(c.arguments)) for c in m.tool_calls] == [("f", {"a": 1})]
    m = HermesToolParser().parse('ok <tool_call>{"name": "f", "arguments": {"a": 1}}')  # EOS before the end tag
    assert m.content == "ok " and json.loads(m.tool_calls[0].arguments) == {"a": 1}


@pytest.mark.parametrize("text", ['<tool_call>not json</tool_call>', '<tool_call>{"name": "f", "arguments": {"a": </tool_call>',
                                  '<tool_call>{"name": "f", "arguments": {"a": 1'])
def test_hermes_malformed_call_is_text(text):
    m = HermesToolParser().parse(text)
    assert m.content == text and m.tool_calls == []


def test_hermes_streams_name_first_then_argument_pieces():
    p = HermesToolParser()
    pieces = ["Sure", ". <tool", "_call>\n{\"name\": \"get_", "weather\", \"argu", "ments\": {\"city\"", ": \"Par",
              "is\"}}\n</tool", "_call>"]
    content, calls, deltas = streamed(p, pieces)
    assert content == "Sure. " and calls == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    first = next(d for d in deltas if d.tool_calls).tool_calls[0]
    assert first.name == "get_weather" and first.id and first.arguments == "{\"city\""  # name, then what is known
    pieces_of_args = [c.arguments for d in deltas for c in d.tool_calls if c.name is None]
    assert len(pieces_of_args) >= 2  # the arguments stream, not one lump at the end


# Text around calls: any characters, including tag look-alikes, braces and quotes.
_text = st.text(alphabet=st.sampled_from(list("ab <>/_{}\"\n:tool_cal")), max_size=12)
_value = st.recursive(st.one_of(st.integers(-5, 5), st.text(alphabet='a}{"\\ <>/', max_size=5), st.booleans()),
                      lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text("xyz", max_size=2), c, max_size=3),
                      max_leaves=6)
_call = st.builds(lambda name, args, order, sep: (
    json.dumps({"name": name, "arguments": args} if order else {"arguments": args, "name": name}, separators=sep)),
    st.sampled_from(["f", "get_weather", "a\"b"]), st.dictionaries(st.text("xyz", min_size=1, max_size=2), _value, max_size=3),
    st.booleans(), st.sampled_from([(",", ":"), (", ", ": ")]))


@st.composite
def _hermes_output(draw) -> tuple[str, list[str], list[str]]:
    """Model output: text, then calls each followed by text; and those texts and calls."""
    texts, calls = [draw(_text)], []
    for _ in range(draw(st.integers(0, 3))):
        calls.append(draw(_call))
        texts.append(draw(_text))
    blocks = [f"<tool_call>{draw(st.sampled_from(['', chr(10)]))}{c}\n</tool_call>" for c in calls]
    return "".join(t + b for t, b in zip(texts, blocks + [""])), texts, calls


@st.composite
def _splits(draw, text: str):
    cuts = sorted(draw(st.sets(st.integers(0, len(text)), max_size=len(text) + 1)))
    return [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]


@settings(max_examples=examples(300), deadline=None)
@given(st.data())
def test_hermes_streaming_agrees_with_whole_text_at_any_split(data):
    text, texts, inserted = data.draw(_hermes_output())
    whole = HermesToolParser().parse(text)
    for pieces in ([text], list(text), data.draw(_splits(text))):
        content, calls, _ = streamed(HermesToolParser(), pieces)
        assert content == (whole.content or "")
        assert calls == [{"name": c.name, "arguments": c.arguments} for c in whole.tool_calls]
    if not any("<" in t for t in texts):  # nothing around the calls looks like a tag: all are found
        assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == [
            (o["name"], o["arguments"]) for o in map(json.loads, inserted)]
        shown = "".join(t for t in texts if t.strip()) if inserted else text
        assert (whole.content or "") == shown

def test_every_single_split_of_a_call():
    text = "Hi <" + WEATHER + " bye"
    whole = HermesToolParser().parse(text)
    assert whole.content == "Hi < bye"
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            content, calls, deltas = streamed(HermesToolParser(), [text[:i], text[i:j], text[j:]])
            assert content == whole.content and calls == [{"name": c.name, "arguments": c.arguments}
                                                          for c in whole.tool_calls]
            assert not any("<t" in d.content or "_call" in d.content for d in deltas)  # no markup shown


def test_required_calls_stream():
    text = '[{"name": "f", "parameters": {"q": "]}\\"["}}, {"name": "g", "parameters": {}}]'
    whole = RequiredCallsParser().parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == [("f", {"q": ']}"['}), ("g", {})]
    for i in range(len(text) + 1):
        _, calls, _ = streamed(RequiredCallsParser(), [text[:i], text[i:]])
        assert calls == [{"name": c.name, "arguments": c.arguments} for c in whole.tool_calls]


def test_named_call():
    _, calls, deltas = streamed(NamedCallParser("f"), ['{"a"', ': 1}'])
    assert calls == [{"name": "f", "arguments": '{"a": 1}'}] and deltas[0].tool_calls[0].name == "f"
