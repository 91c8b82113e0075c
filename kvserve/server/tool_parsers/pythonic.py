"""`pythonic`: the whole output is a Python list of calls with keyword arguments of literal values,
as Llama 3.2 and ToolACE write them: `[get_weather(city="Paris"), get_time(zone="CET")]`. Any other
output is content. The list is only known to be calls when it ends, so a stream holds an output
that starts with "[" until the end.
"""

from __future__ import annotations

import ast
import json

from kvserve.server.tool_parsers.base import Extracted, ToolCall, ToolParser, register


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _name(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def _call(node: ast.expr) -> ToolCall | None:
    if not isinstance(node, ast.Call) or node.args or (name := _name(node.func)) is None:
        return None
    args = {}
    for kw in node.keywords:
        if kw.arg is None:  # **kwargs
            return None
        try:
            args[kw.arg] = ast.literal_eval(kw.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
    try:
        return ToolCall(name, json.dumps(args, ensure_ascii=False, allow_nan=False))
    except (ValueError, TypeError):  # a set, bytes, a complex number, nan: not JSON
        return None


def pythonic_calls(text: str) -> list[ToolCall] | None:
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = [_call(e) for e in tree.body.elts]
    return calls if all(c is not None for c in calls) else None  # type: ignore[return-value]


@register
class PythonicToolParser(ToolParser):
    name = "pythonic"

    def parse(self, text: str, final: bool) -> Extracted:
        head = text.lstrip()
        if not final:
            return Extracted("" if not head or head.startswith("[") else text)
        calls = pythonic_calls(text) if head.startswith("[") else None
        return Extracted("", calls) if calls else Extracted(text)
