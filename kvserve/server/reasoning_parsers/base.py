"""The reasoning parser interface, its registry and the streaming driver (`--reasoning-parser`).

A parser splits a model's output into its reasoning (between <think> and </think>) and the answer.
It implements `split(text, final)`: (reasoning or None when the output has none, content) of the
text so far; with `final` false both must be settled, as the tool-call parsers' answers are
(tool_parsers/base.py): later text only adds to them (a half-written tag is held back). The
non-streaming answer is split(text, True); ReasoningStream sends what each new split adds, so both
agree. Tool calls are then read from the content alone.
"""

from __future__ import annotations

from typing import ClassVar

from kvserve.server.tool_parsers.base import held_back

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {}


def register(cls: type[ReasoningParser]) -> type[ReasoningParser]:
    """Class decorator: make a parser selectable by its `name` (--reasoning-parser NAME)."""
    REASONING_PARSERS[cls.name] = cls
    return cls


class ReasoningParser:
    name: ClassVar[str] = ""
    START, END = "<think>", "</think>"

    def split(self, text: str, final: bool) -> tuple[str | None, str]:
        raise NotImplementedError

    def until_end(self, body: str, final: bool) -> tuple[str, str | None]:
        """(reasoning, the text after END or None if END has not come) of text after START."""
        j = body.find(self.END)
        if j < 0:
            return (body if final else body[:len(body) - held_back(body, self.END)]), None
        return body[:j], body[j + len(self.END):]


class ReasoningStream:
    """One choice's streaming split: feed text deltas, get the (reasoning, content) each adds."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self.sent = ("", "")
        self.found = False  # whether the output has reasoning (split gave a string)

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        self.text += delta
        reasoning, content = self.parser.split(self.text, final)
        self.found = self.found or reasoning is not None
        reasoning = reasoning or ""
        if not (reasoning.startswith(self.sent[0]) and content.startswith(self.sent[1])):
            return "", ""  # a parser that broke its promise: keep what was sent
        out = reasoning[len(self.sent[0]):], content[len(self.sent[1]):]
        self.sent = (reasoning, content)
        return out
