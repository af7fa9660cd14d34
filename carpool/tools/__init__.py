"""Tool calling: tools into the chat template (template.py), calls out of the text (parsers.py),
and calls forced by tool_choice "required" or a named function (forced.py)."""

from carpool.tools.parsers import (TOOL_PARSERS, HermesToolParser, ParsedMessage, StreamDelta, ToolCall,
                                   ToolCallDelta, ToolParser, get_tool_parser, register_tool_parser)

__all__ = ["TOOL_PARSERS", "HermesToolParser", "ParsedMessage", "StreamDelta", "ToolCall", "ToolCallDelta",
           "ToolParser", "get_tool_parser", "register_tool_parser"]
