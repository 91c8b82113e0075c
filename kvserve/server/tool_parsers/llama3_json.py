"""`llama3_json`: Llama 3.1 / 3.2's JSON tool calls. The output is the calls: optionally
<|python_tag|>, then JSON objects {"name": ..., "parameters": {...}} ("arguments" is taken too)
separated by ";". An output that starts otherwise is content. Text from the first thing that is not
a call onwards is content; an output with no call is content whole.
"""

from __future__ import annotations

from kvserve.server.tool_parsers.base import Extracted, ToolParser, decode_at, make_call, register, skip_ws


@register
class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> Extracted:
        pos = skip_ws(text, 0)
        rest = text[pos:]
        if rest.startswith(self.TAG):
            pos = skip_ws(text, pos + len(self.TAG))
        elif not final and self.TAG.startswith(rest):
            return Extracted("")  # nothing yet, or a part of the tag: undecided
        elif not rest.startswith("{"):
            return Extracted(text)
        calls = []
        while True:
            if pos >= len(text) and not final:
                return Extracted("", calls)  # more calls may follow
            got = decode_at(text, pos) if text.startswith("{", pos) else None
            call = make_call(got[0]) if got is not None else None
            if call is None:
                if got is None and not final and text.startswith("{", pos):
                    return Extracted("", calls)  # an object still being written
                break
            calls.append(call)
            pos = skip_ws(text, got[1])
            if text.startswith(";", pos):
                pos = skip_ws(text, pos + 1)
            elif pos < len(text) or final:
                break
        return Extracted(text[pos:] if calls else text, calls)
