"""Tool calls out of generated text, whole or streamed.

A parser is fed text as it arrives (`feed`) and told when the text ends (`finish`); each call
returns what may be shown so far: content, and tool-call fragments (a call's id and name first,
then pieces of its arguments). `parse(text)` is that same fold over the whole text, so a streamed
answer and a non-streamed one always agree. Markup never leaks into content: text that might be
the start of a tag is held back until it is known not to be one.

Parsers register by name (`--tool-call-parser NAME`); `hermes` reads the `<tool_call>{"name": ...,
"arguments": ...}</tool_call>` blocks Hermes-2-Pro, Qwen2.5/3 and many fine-tunes emit.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI's API carries it
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ToolCallDelta:
    """A piece of call `index`: its first piece carries `id` and `name`, later ones only arguments."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict[str, Any]:
        if self.name is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class StreamDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls)

    def add(self, other: StreamDelta) -> None:
        self.content += other.content
        for d in other.tool_calls:
            self.add_call(d)

    def add_call(self, d: ToolCallDelta) -> None:
        """Fragments of the same call, one after the other, travel as one."""
        last = self.tool_calls[-1] if self.tool_calls else None
        if last is not None and last.index == d.index and d.name is None:
            last.arguments += d.arguments
        else:
            self.tool_calls.append(ToolCallDelta(d.index, d.arguments, d.id, d.name))


@dataclass
class ParsedMessage:
    content: str | None
    tool_calls: list[ToolCall]


class ToolParser(ABC):
    """One response's parser: stateful, so make one per choice."""

    name: ClassVar[str]
    # The text was decoded under the calls' schema (tools/forced.py): arguments that are not whole
    # JSON were cut short (max_tokens) and stay a call, as vLLM answers a named call cut that way.
    forced: ClassVar[bool] = False

    @abstractmethod
    def feed(self, text: str) -> StreamDelta:
        """More generated text; returns what can be shown now."""

    @abstractmethod
    def finish(self) -> StreamDelta:
        """The text has ended: whatever was held back."""

    def parse(self, text: str) -> ParsedMessage:
        """The whole text at once. A call whose arguments are not JSON makes the whole text
        content (nothing is called), as vLLM does, unless the output was forced to be calls;
        streaming cannot take back what it sent."""
        total = self.feed(text)
        total.add(self.finish())
        calls: dict[int, ToolCall] = {}
        for d in total.tool_calls:
            if d.name is not None:
                calls[d.index] = ToolCall(d.name, d.arguments, d.id)
            else:
                calls[d.index].arguments += d.arguments
        tool_calls = [calls[i] for i in sorted(calls)]
        if not self.forced and not all(_is_json(c.arguments) for c in tool_calls):
            return ParsedMessage(text, [])
        return ParsedMessage(total.content if total.content or not tool_calls else None, tool_calls)

    # -------- for chat templates that know nothing of tools (carpool/tools/template.py); a parser
    # of free-form output says how its format is written, one of forced output has no format.
    @classmethod
    def system_prompt(cls, tools: list[dict]) -> str:
        """Tells the model which tools it has and how to call them, in this parser's format."""
        raise NotImplementedError(f"the {cls.name!r} tool parser has no prompt format")

    @classmethod
    def render_call(cls, name: str, arguments: Any) -> str:
        """An earlier call of the conversation, as the model would have written it."""
        raise NotImplementedError(f"the {cls.name!r} tool parser has no prompt format")

    @classmethod
    def render_result(cls, content: str) -> str:
        """A tool's answer, as the model expects to read it."""
        raise NotImplementedError(f"the {cls.name!r} tool parser has no prompt format")


TOOL_PARSERS: dict[str, type[ToolParser]] = {}


def register_tool_parser(cls: type[ToolParser]) -> type[ToolParser]:
    TOOL_PARSERS[cls.name] = cls
    return cls


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}") from None


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def _held_back(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could begin `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


# The usual head of a call object: its name, then its arguments. When the model writes this,
# the arguments can stream as they come; any other shape is sent whole once the call is complete.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')


class CallStreamer:
    """One call object `{"name": ..., "arguments": ...}` as its text grows: the name once it is
    complete, then the arguments' own text, holding back a trailing `}` and whitespace (they may
    close the call object rather than the arguments) so that what was sent is always a prefix of
    the final arguments."""

    def __init__(self, index: int):
        self.index = index
        self.name: str | None = None
        self.args_at = 0  # where the arguments start in the body
        self.sent = 0  # characters of the arguments sent

    def update(self, body: str) -> list[ToolCallDelta]:
        out = []
        if self.name is None:
            m = _HEAD.match(body)
            if m is None:
                return []
            try:
                self.name = json.loads(m.group(1))
            except ValueError:
                return []
            self.args_at = m.end()
            out.append(ToolCallDelta(self.index, "", new_call_id(), self.name))
        if self.sent == 0:  # the arguments start at their first non-blank character
            self.args_at += len(body[self.args_at:]) - len(body[self.args_at:].lstrip())
        raw = body[self.args_at:].rstrip()
        if raw.endswith("}"):
            raw = raw[:-1].rstrip()
        if len(raw) > self.sent:
            out.append(ToolCallDelta(self.index, raw[self.sent:]))
            self.sent = len(raw)
        return out

    def close(self, body: str) -> list[ToolCallDelta] | None:
        """The complete call text; None when it is not a call (nothing was sent for it)."""
        out = self.update(body)  # whole or streamed, the same pieces come out
        try:
            obj = json.loads(body)
        except ValueError:
            obj = None
        ok = (isinstance(obj, dict) and isinstance(obj.get("name"), str)
              and ("arguments" in obj or "parameters" in obj))
        if self.name is None:
            if not ok:
                return None
            args = obj.get("arguments", obj.get("parameters"))
            return [ToolCallDelta(self.index, json.dumps(args, ensure_ascii=False), new_call_id(), obj["name"])]
        return out  # update() sent all of the arguments but the object's closing `}`


@register_tool_parser
class HermesToolParser(ToolParser):
    """`<tool_call>{"name": "f", "arguments": {...}}</tool_call>` blocks, any number of them.

    Text outside the blocks is content. A stretch of outside text is held while it is only
    whitespace and dropped if it stays so (the newlines around calls are not an answer); an answer
    without calls is returned exactly as written."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self):
        self.buf = ""
        self.inside = False
        self.body = ""
        self.call: CallStreamer | None = None
        self.num_calls = 0
        self.held = ""  # whitespace-only outside text, not yet shown
        self.shown = False  # this stretch of outside text has shown something

    def feed(self, text: str) -> StreamDelta:
        out = StreamDelta()
        self.buf += text
        while True:
            if not self.inside:
                i = self.buf.find(self.START)
                if i < 0:
                    keep = _held_back(self.buf, self.START)
                    self._outside(self.buf[:len(self.buf) - keep], out)
                    self.buf = self.buf[len(self.buf) - keep:]
                    return out
                self._outside(self.buf[:i], out)
                self.buf = self.buf[i + len(self.START):]
                self.inside, self.body, self.call = True, "", CallStreamer(self.num_calls)
            else:
                j = self.buf.find(self.END)
                if j < 0:
                    keep = _held_back(self.buf, self.END)
                    self.body += self.buf[:len(self.buf) - keep]
                    self.buf = self.buf[len(self.buf) - keep:]
                    for d in self.call.update(self.body):
                        out.add_call(d)
                    return out
                self.body += self.buf[:j]
                self.buf = self.buf[j + len(self.END):]
                self._close(out, self.END)

    def finish(self) -> StreamDelta:
        out = StreamDelta()
        if self.inside:  # the text ended inside a block: a complete object still counts
            self.body += self.buf
            self.buf = ""
            self._close(out, "")
        self._outside(self.buf, out)
        self.buf = ""
        if self.num_calls == 0 and self.held:
            out.content += self.held
        self.held = ""
        return out

    def _close(self, out: StreamDelta, end: str) -> None:
        self.inside = False
        deltas = self.call.close(self.body)
        if deltas is None:  # not a call after all: the block is text
            self._outside(self.START + self.body + end, out)
            return
        for d in deltas:
            out.add_call(d)
        self.num_calls += 1
        self.held, self.shown = "", False

    def _outside(self, text: str, out: StreamDelta) -> None:
        if self.shown:
            out.content += text
            return
        self.held += text
        if self.held.strip():
            out.content += self.held
            self.held, self.shown = "", True

    @classmethod
    def system_prompt(cls, tools: list[dict]) -> str:
        listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n"
                f"<tools>\n{listed}\n</tools>\n\n"
                "For each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n"
                '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

    @classmethod
    def render_call(cls, name: str, arguments: Any) -> str:
        return f"{cls.START}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{cls.END}"

    @classmethod
    def render_result(cls, content: str) -> str:
        return f"<tool_response>\n{content}\n</tool_response>"
