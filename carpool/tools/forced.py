"""tool_choice "required" and a named function: the call is not asked for, it is decoded under a
JSON schema (structured outputs), so even a small model answers with a well-formed call.

As vLLM does: a named function generates that function's arguments object; "required"
generates a JSON array of `{"name", "parameters"}` objects, one `anyOf` branch per tool, so each
name travels with its own arguments' schema. Their parsers read that output back into calls.
"""

from __future__ import annotations

from typing import Any

from carpool.tools.parsers import CallStreamer, StreamDelta, ToolCallDelta, ToolParser, new_call_id

EMPTY_OBJECT = {"type": "object", "properties": {}}


def parameters_of(tool: dict) -> dict:
    return tool["function"].get("parameters") or EMPTY_OBJECT


def named_schema(tools: list[dict], name: str) -> dict:
    return parameters_of(next(t for t in tools if t["function"]["name"] == name))


def required_schema(tools: list[dict], parallel: bool = True) -> dict:
    branches = [{"type": "object",
                 "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                "parameters": parameters_of(t)},
                 "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


class NamedCallParser(ToolParser):
    """The whole output is the arguments of the one named function."""

    name = "named"
    forced = True

    def __init__(self, function: str):
        self.function = function
        self.started = False

    def feed(self, text: str) -> StreamDelta:
        out = StreamDelta()
        if not self.started:
            self.started = True
            out.add_call(ToolCallDelta(0, "", new_call_id(), self.function))
        if text:
            out.add_call(ToolCallDelta(0, text))
        return out

    def finish(self) -> StreamDelta:
        return self.feed("") if not self.started else StreamDelta()


class RequiredCallsParser(ToolParser):
    """A JSON array of `{"name", "parameters"}` objects: each object is one call, streamed as it
    grows (found by counting brackets outside strings)."""

    name = "required"
    forced = True

    def __init__(self):
        self.depth = 0
        self.in_string = self.escaped = False
        self.body = ""  # the current call object's text
        self.call: CallStreamer | None = None
        self.num_calls = 0

    def feed(self, text: str) -> StreamDelta:
        out = StreamDelta()
        for ch in text:
            if self.depth >= 2 or (self.depth == 1 and ch == "{"):
                self.body += ch
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
                continue
            if ch == '"':
                self.in_string = True
            elif ch in "[{":
                self.depth += 1
                if self.depth == 2 and ch == "{":
                    self.call = CallStreamer(self.num_calls)
            elif ch in "]}":
                self.depth -= 1
                if self.depth == 1 and ch == "}" and self.call is not None:
                    for d in self.call.close(self.body) or []:
                        out.add_call(d)
                    self.num_calls += 1
                    self.body, self.call = "", None
        if self.call is not None:
            for d in self.call.update(self.body):
                out.add_call(d)
        return out

    def finish(self) -> StreamDelta:
        return StreamDelta()


def forced_output_parser(tool_choice: str | dict) -> ToolParser:
    if tool_choice == "required":
        return RequiredCallsParser()
    return NamedCallParser(tool_choice["function"]["name"])


def forced_schema(tools: list[dict], tool_choice: str | dict, parallel: bool = True) -> dict:
    if tool_choice == "required":
        return required_schema(tools, parallel)
    return named_schema(tools, tool_choice["function"]["name"])

