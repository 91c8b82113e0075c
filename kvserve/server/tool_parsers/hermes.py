"""`hermes`: each call (or a JSON list of calls) between <tool_call> and </tool_call>, as Hermes 2 Pro,
Qwen2.5, Qwen3 and SmolLM2 write them and kvserve's default tool prompt asks (kvserve/chat_tools.py):

    Let me look.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from __future__ import annotations

from kvserve.server.tool_parsers.base import Extracted, ToolParser, json_calls, register, tagged_calls


@register
class HermesToolParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def parse(self, text: str, final: bool) -> Extracted:
        return tagged_calls(text, final, self.START, self.END, json_calls)
