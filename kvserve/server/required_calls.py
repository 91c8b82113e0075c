"""The output of tool_choice "required", read as it is generated: the grammar holds it to
`[{"name": <a tool>, "parameters": {...}}, ...]` (tools.required_schema), so each call is sent as
soon as its name is known and its arguments as they are written, as the OpenAI API streams them.
The arguments are the text the model wrote between the braces (valid JSON: the grammar saw to it).
A whole answer is the same reading of the whole text, so both agree; one cut off by max_tokens
ends with the arguments written so far (finish_reason "length"), as vLLM answers it. Text the
grammar would not have let through (an engine without it) is returned as content.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.server.tool_parsers.base import ToolCall, decode_at, skip_ws

_ARGS_KEYS = ("parameters", "arguments")


def object_end(text: str, pos: int) -> int | None:
    """Where the JSON object or array starting at text[pos] ends (exclusive); None if not yet."""
    depth, in_str, esc = 0, False, False
    for i in range(pos, len(text)):
        ch = text[i]
        if in_str:
            esc, in_str = (False, in_str) if esc else (ch == "\\", ch != '"')
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


@dataclass
class _Call:
    call: ToolCall
    args_start: int
    args_end: int | None = None
    sent: int = 0  # characters of the arguments sent


@dataclass
class RequiredCalls:
    """Feed the text so far; read `calls` (the arguments of the last may still grow) and `content`."""

    text: str = ""
    pos: int = 0  # where reading goes on
    calls: list[_Call] = field(default_factory=list)
    broken: int | None = None  # where text stopped being calls: the rest is content
    done: bool = False
    need_close: bool = False  # the last call's arguments ended; its closing brace comes next

    def feed(self, delta: str) -> None:
        self.text += delta
        while self.broken is None and not self.done and self._step():
            pass
        for c in self.calls:
            c.call.arguments = self.text[c.args_start:c.args_end if c.args_end is not None else len(self.text)]

    def content(self) -> str:
        """What is not calls: text the grammar would not have allowed (all of it without a call), or
        what follows the array."""
        if self.broken is not None:
            return self.text[self.broken:] if self.calls else self.text
        return self.text[self.pos:] if self.done else ""

    def _step(self) -> bool:
        """Read one more piece (the array's start, a call, a separator); False when it needs more text."""
        text, pos = self.text, skip_ws(self.text, self.pos)
        if self.calls and self.calls[-1].args_end is None:
            return self._args_end()
        if pos == len(text):
            return False
        if self.pos == 0 and text[pos] != "[":
            self.broken = 0
            return False
        if self.need_close:
            if text[pos] != "}":
                self.broken = self.pos
                return False
            self.pos, self.need_close = pos + 1, False
            return True
        return self._next(pos)

    def _next(self, pos: int) -> bool:
        text = self.text
        ch = text[pos]
        if ch == "[" and self.pos == 0 and not self.calls:
            self.pos = pos + 1
            return True
        if ch == "," and self.calls:
            self.pos = pos + 1
            return True
        if ch == "]" and self.calls:
            self.pos, self.done = pos + 1, True
            return False
        return self._call_head(pos)

    def _call_head(self, pos: int) -> bool:
        """{"name": "x", "parameters": — the call's name, and where its arguments start."""
        text = self.text
        if text[pos] != "{":
            self.broken = self.pos
            return False
        keys: dict[str, str] = {}
        at = skip_ws(text, pos + 1)
        while True:
            key = decode_at(text, at) if text.startswith('"', at) else None
            if key is None:
                return self._incomplete(at)
            colon = skip_ws(text, key[1])
            if colon == len(text):
                return False
            if text[colon] != ":" or key[0] not in ("name", *_ARGS_KEYS) or key[0] in keys:
                self.broken = self.pos
                return False
            value_at = skip_ws(text, colon + 1)
            if key[0] in _ARGS_KEYS:
                if value_at == len(text):
                    return False
                if text[value_at] != "{" or "name" not in keys:
                    self.broken = self.pos
                    return False
                self.calls.append(_Call(ToolCall(keys["name"], ""), value_at))
                self.pos = value_at
                return True
            name = decode_at(text, value_at) if text.startswith('"', value_at) else None
            if name is None:
                return self._incomplete(value_at)
            keys["name"] = name[0]
            comma = skip_ws(text, name[1])
            if comma == len(text):
                return False
            if text[comma] != ",":
                self.broken = self.pos
                return False
            at = skip_ws(text, comma + 1)

    def _incomplete(self, at: int) -> bool:
        """A key or value not whole yet: wait, unless it cannot become one."""
        if at < len(self.text) and self.text[at] != '"':
            self.broken = self.pos
        return False

    def _args_end(self) -> bool:
        """Where the last call's arguments object ends."""
        last = self.calls[-1]
        end = object_end(self.text, last.args_start)
        if end is None:
            return False
        last.args_end, self.pos, self.need_close = end, end, True
        return True
