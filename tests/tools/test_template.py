"""Tools and earlier calls into chat templates: ones written for tools, and ones that ignore them."""

from __future__ import annotations

import json

import pytest

from carpool.tools.template import apply_chat_template, knows_tools, prepare_conversation
from tests.tools.templates import TOOLS_TEMPLATE

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
EXCHANGE = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"},
]


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from carpool.tokenizer import load_tokenizer

    return load_tokenizer(model_path)


def render(tokenizer, messages, tools, template=None) -> str:
    return tokenizer.decode(apply_chat_template(tokenizer, messages, tools=tools, chat_template=template))


def test_a_template_with_tools_gets_them_and_the_arguments_as_a_mapping(tokenizer):
    assert knows_tools(TOOLS_TEMPLATE) and not knows_tools(tokenizer.chat_template)
    text = render(tokenizer, EXCHANGE, [WEATHER], TOOLS_TEMPLATE)
    assert json.dumps(WEATHER) in text  # the template wrote the tool itself
    # The arguments reached the template as a dict (`tojson` of the string would be quoted twice).
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<tool_response>\n22 C, sunny\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_template_without_tools_gets_them_written_into_the_messages(tokenizer):
    text = render(tokenizer, EXCHANGE, [WEATHER])
    assert "<tools>" in text and '"get_weather"' in text and "<tool_call>" in text  # the system prompt
    assert "named SmolLM" not in text  # our system message replaced the template's default one
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n22 C, sunny\n</tool_response><|im_end|>" in text
    assert "<|im_start|>tool" not in text


def test_a_system_message_is_kept_and_consecutive_results_make_one_turn():
    messages = [{"role": "developer", "content": "Be brief."}] + EXCHANGE + [
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "windy"}]}]
    conversation, tools = prepare_conversation(messages, [WEATHER], "{{ messages }}")
    assert tools is None
    assert conversation[0]["role"] == "system" and conversation[0]["content"].startswith("Be brief.\n\n# Tools")
    assert [m["role"] for m in conversation] == ["system", "user", "assistant", "user"]
    assert conversation[-1]["content"].count("<tool_response>") == 2 and "windy" in conversation[-1]["content"]


def test_bad_arguments_are_named():
    bad = [dict(EXCHANGE[1], tool_calls=[{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{x"}}])]
    with pytest.raises(ValueError, match=r"messages\.0\.tool_calls\.0\.function\.arguments"):
        prepare_conversation(bad, None, TOOLS_TEMPLATE)
