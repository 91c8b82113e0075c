"""Tool-call parsers, one file per format, selected by `--tool-call-parser NAME` (TOOL_PARSERS).
A new format is a new file with a registered ToolParser subclass (base.py), imported below."""

from kvserve.server.tool_parsers import hermes, llama3_json, mistral, pythonic  # noqa: F401 - they register
from kvserve.server.tool_parsers.base import (TOOL_PARSERS, Extracted, ToolCall, ToolCallStream, ToolParser,
                                              new_call_id, register)

__all__ = ["TOOL_PARSERS", "Extracted", "ToolCall", "ToolCallStream", "ToolParser", "new_call_id", "register"]
