"""A conversation with tools into the model's chat template.

OpenAI's messages carry a call's arguments as JSON text; templates written for tools
(Hermes, Qwen, Llama 3.1, ...) index them as a mapping, so they are parsed first, as vLLM does.
A template that knows nothing of tools (the embedded SmolLM2's) would drop them silently; for
such a template the tools go into the system message, and earlier calls and their results into
the messages' text, in the format the tool parser reads back.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from carpool.tools.parsers import HermesToolParser, ToolParser


@lru_cache(maxsize=16)
def _variables(source: str) -> frozenset[str]:
    """The names a template reads from its context; falls back to the words in it."""
    import re

    import jinja2
    from jinja2 import meta

    try:
        env = jinja2.Environment(extensions=["jinja2.ext.loopcontrols", "jinja2.ext.do"])
        return frozenset(meta.find_undeclared_variables(env.parse(source)))
    except jinja2.TemplateError:
        return frozenset(re.findall(r"\w+", source))


def template_source(tokenizer, chat_template: str | None) -> str:
    source = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if isinstance(source, dict):  # named templates: transformers takes "tool_use" when tools are given
        source = source.get("tool_use") or source.get("default") or ""
    return source or ""


def knows_tools(source: str) -> bool:
    return "tools" in _variables(source)


def knows_tool_calls(source: str) -> bool:
    return "tool_calls" in source


def message_text(content: Any) -> str:
    """A message's content as one string: text, a list of text parts, or nothing."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(part["text"] for part in content if part.get("type") == "text")


def parse_arguments(arguments: Any, where: str) -> Any:
    if isinstance(arguments, (dict, list)):
        return arguments
    if not arguments:
        return {}
    try:
        return json.loads(arguments)
    except ValueError:
        raise ValueError(f"{where}: the arguments are not valid JSON") from None


def prepare_conversation(messages: list[dict], tools: list[dict] | None, source: str,
                         tool_format: type[ToolParser] = HermesToolParser) -> tuple[list[dict], list[dict] | None]:
    """Messages (OpenAI's shape, as dicts) and tools, as the template `source` should get them.
    Returns the conversation and the tools to pass (None when they were written into it)."""
    conversation = []
    for i, m in enumerate(messages):
        msg = dict(m, content=message_text(m.get("content")))
        if msg["role"] == "developer":
            msg["role"] = "system"
        if msg.get("tool_calls"):
            msg["tool_calls"] = [
                dict(c, function=dict(c["function"], arguments=parse_arguments(
                    c["function"].get("arguments"), f"messages.{i}.tool_calls.{j}.function.arguments")))
                for j, c in enumerate(msg["tool_calls"])]
        else:
            msg.pop("tool_calls", None)
        conversation.append(msg)
    if not knows_tool_calls(source):
        conversation = _calls_as_text(conversation, tool_format)
    if tools and not knows_tools(source):
        prompt = tool_format.system_prompt(tools)
        if conversation and conversation[0]["role"] == "system":
            conversation[0] = dict(conversation[0], content=f"{conversation[0]['content']}\n\n{prompt}".lstrip())
        else:
            conversation.insert(0, {"role": "system", "content": prompt})
        tools = None
    return conversation, tools


def _calls_as_text(conversation: list[dict], fmt: type[ToolParser]) -> list[dict]:
    """Calls written into the assistant's text; results as one user turn per run of tool
    messages (templates without tools often allow only system/user/assistant)."""
    out: list[dict] = []
    results = False  # the last message out holds tool results
    for msg in conversation:
        if msg["role"] == "tool":
            result = fmt.render_result(msg["content"])
            if results:
                out[-1]["content"] += "\n" + result
            else:
                out.append({"role": "user", "content": result})
            results = True
            continue
        if msg["role"] == "assistant" and msg.get("tool_calls"):
            calls = [fmt.render_call(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]]
            msg = {k: v for k, v in msg.items() if k != "tool_calls"}
            msg["content"] = "\n".join(([msg["content"]] if msg["content"] else []) + calls)
        out.append(msg)
        results = False
    return out

def apply_chat_template(tokenizer, messages: list[dict], *, tools: list[dict] | None = None,
                        chat_template: str | None = None, add_generation_prompt: bool = True,
                        continue_final_message: bool = False,
                        tool_format: type[ToolParser] = HermesToolParser,
                        chat_template_kwargs: dict[str, Any] | None = None,
                        tokenize: bool = True) -> list[int] | str:
    """Token ids of the conversation under the model's template (or `chat_template`), or with
    `tokenize=False` its text. `chat_template_kwargs` become the template's variables (e.g.
    `enable_thinking`)."""
    conversation, tools = prepare_conversation(messages, tools, template_source(tokenizer, chat_template),
                                               tool_format)
    ids = tokenizer.apply_chat_template(conversation, tools=tools, chat_template=chat_template, tokenize=tokenize,
                                        add_generation_prompt=add_generation_prompt and not continue_final_message,
                                        continue_final_message=continue_final_message, **(chat_template_kwargs or {}))
    if not tokenize:
        return ids
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
