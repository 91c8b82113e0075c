"""`mistral`: Mistral's [TOOL_CALLS] marker, then either a JSON list of calls (v0.3 tokenizers:
`[TOOL_CALLS][{"name": "f", "arguments": {...}}]`) or, from tokenizer v11 on, `name[ARGS]{...}` for
each call (each after its own [TOOL_CALLS]). Text before the marker is content; calls that do not
parse are content with their marker.
"""

from __future__ import annotations

import json
import re

from kvserve.server.tool_parsers.base import (Extracted, ToolCall, ToolParser, decode_at, make_calls, marked_calls,
                                              register, skip_ws)

_NAME = re.compile(r"[A-Za-z0-9_.:\-]+")


@register
class MistralToolParser(ToolParser):
    name = "mistral"
    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def parse(self, text: str, final: bool) -> Extracted:
        return marked_calls(text, final, self.TAG, self._calls)

    def _calls(self, text: str, pos: int, final: bool) -> tuple[list[ToolCall] | None, int] | None:
        """The calls after a marker at `pos` and where they end; (None, end) if they are not calls;
        None if they are not whole yet."""
        pos = skip_ws(text, pos)
        if text.startswith("[", pos):
            got = decode_at(text, pos)
            if got is None:
                return None if not final else (None, len(text))
            return make_calls(got[0]) if isinstance(got[0], list) else None, got[1]
        k = text.find(self.ARGS, pos)
        if k < 0:
            m = _NAME.match(text, pos)
            if not final and self.ARGS.startswith(text[m.end() if m else pos:]):
                return None  # a name, then perhaps [ARGS]
            return None, len(text)
        name = text[pos:k]
        if not _NAME.fullmatch(name):
            return None, len(text)
        got = decode_at(text, skip_ws(text, k + len(self.ARGS)))
        if got is None:
            return None if not final else (None, len(text))
        if not isinstance(got[0], dict):
            return None, got[1]
        return [ToolCall(name, json.dumps(got[0], ensure_ascii=False))], got[1]
