"""The tool-call parser interface, its registry, and the one streaming driver every parser shares.

A parser reads the tool calls a model wrote in its own format (`--tool-call-parser`, under
tool_choice "auto"). It implements one method, `parse(text, final)`: the content and the calls of
the text so far. With `final` false the answer must be settled: later text may add to the content
and the calls but never change what was returned (text that may still turn out to be a call, such
as a half-written "<tool_cal", is held back). The non-streaming answer is parse(text, final=True);
the streaming one (ToolCallStream) sends what each new parse adds, so both give the same calls and
the same content by construction. A call is sent once it is whole and parsed, so a stream never
carries a call that the non-streaming answer would have returned as text. A call that does not
parse (malformed JSON, no name, arguments not an object) is returned as content, never an error.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any, ClassVar

TOOL_PARSERS: dict[str, type[ToolParser]] = {}


def register(cls: type[ToolParser]) -> type[ToolParser]:
    """Class decorator: make a parser selectable by its `name` (--tool-call-parser NAME)."""
    TOOL_PARSERS[cls.name] = cls
    return cls


@dataclass
class ToolCall:
    name: str
    arguments: str  # the arguments object as JSON text
    id: str = field(default_factory=lambda: new_call_id())


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class Extracted:
    content: str
    calls: list[ToolCall] = field(default_factory=list)


class ToolParser:
    name: ClassVar[str] = ""

    def parse(self, text: str, final: bool) -> Extracted:
        raise NotImplementedError

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The non-streaming answer: (content, or None when there are calls and no other text; calls)."""
        ex = self.parse(text, final=True)
        return (None if ex.calls and not ex.content.strip() else ex.content), ex.calls


def make_call(obj: Any, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> ToolCall | None:
    """A call from a decoded JSON object {"name": ..., "arguments": {...}}; None if it is not one.
    Arguments given as JSON text of an object are taken too; missing arguments are {}."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    keys = [k for k in args_keys if k in obj]
    if set(obj) - {"name", *keys} or len(keys) > 1:
        return None
    args = obj[keys[0]] if keys else {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def make_calls(value: Any) -> list[ToolCall] | None:
    """One call, or a list of at least one (all must be calls); None otherwise."""
    items = value if isinstance(value, list) else [value]
    calls = [make_call(v) for v in items]
    return calls if calls and all(c is not None for c in calls) else None  # type: ignore[return-value]


_DECODER = json.JSONDecoder()


def decode_at(text: str, pos: int) -> tuple[Any, int] | None:
    """The JSON value starting at text[pos] and where it ends; None if there is none (yet)."""
    try:
        return _DECODER.raw_decode(text, pos)
    except ValueError:
        return None


def skip_ws(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in " \t\r\n":
        pos += 1
    return pos


def held_back(text: str, marker: str) -> int:
    """How many trailing characters of `text` could be the start of `marker` (to hold back)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def marked_calls(text: str, final: bool, marker: str,
                 calls_at: Callable[[str, int, bool], tuple[list[ToolCall] | None, int] | None]) -> Extracted:
    """The calls of a format that puts a marker before each call (or list of calls): text outside
    them is content. `calls_at(text, pos, final)` reads what follows a marker ending at `pos`:
    (the calls, where they end), (None, where the span ends) when it is not calls (the marked span
    is then content), or None when it is not whole yet (held, streaming)."""
    pos, content, calls = 0, [], []
    while True:
        i = text.find(marker, pos)
        if i < 0:
            tail = text[pos:]
            content.append(tail if final else tail[:len(tail) - held_back(tail, marker)])
            break
        content.append(text[pos:i])
        got = calls_at(text, i + len(marker), final)
        if got is None:
            break  # not whole yet: held
        found, stop = got
        if found is None:
            content.append(text[i:stop])
        else:
            calls += found
        pos = stop
    return Extracted("".join(content), calls)


def tagged_calls(text: str, final: bool, start: str, end: str, body: Callable[[str], list[ToolCall] | None]
                 ) -> Extracted:
    """The calls of a format that wraps each call (or list of calls) in `start` ... `end`;
    `body(text_between)` gives the calls or None when it is not calls. A call cut off by the end
    of the output (no `end`) is taken if it parses whole, as vLLM does."""

    def calls_at(text: str, pos: int, final: bool) -> tuple[list[ToolCall] | None, int] | None:
        j = text.find(end, pos)
        if j < 0 and not final:
            return None
        return body(text[pos:j if j >= 0 else len(text)]), (j + len(end) if j >= 0 else len(text))

    return marked_calls(text, final, start, calls_at)


def json_calls(inner: str) -> list[ToolCall] | None:
    """The calls of a JSON text: one call object or a list of them."""
    try:
        return make_calls(json.loads(inner))
    except ValueError:
        return None


class ToolCallStream:
    """One choice's streaming extraction: feed text deltas, get the content and the whole calls each
    adds. Whitespace-only content is held until other text follows, and dropped at the end when
    there are calls, as extract() answers content null then."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent_content = ""
        self.num_calls = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[ToolCall]]:
        self.text += delta
        ex = self.parser.parse(self.text, final)
        visible = ex.content
        if not visible.strip() and (not final or ex.calls or self.num_calls):
            visible = self.sent_content
        if not visible.startswith(self.sent_content):  # a parser that broke its promise: keep what was sent
            visible = self.sent_content
        new_content, self.sent_content = visible[len(self.sent_content):], visible
        new_calls = ex.calls[self.num_calls:]
        self.num_calls = max(self.num_calls, len(ex.calls))
        return new_content, new_calls
