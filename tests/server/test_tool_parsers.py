"""Each tool-call parser on hand-written model outputs, well-formed and malformed: the non-streaming
extraction, and the streaming one fed the same text in pieces of every size, giving the same calls
and the same content."""

from __future__ import annotations

import json
import random

import pytest

from kvserve.server.tool_parsers import TOOL_PARSERS, ToolCallStream

W = '{"city": "Paris", "days": 3}'  # arguments as the model writes them
CASES = {
    "hermes": [
        (f'<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>', None,
         [("get_weather", {"city": "Paris", "days": 3})]),
        (f'Let me check.\n<tool_call>\n{{"name": "a", "arguments": {{}}}}\n</tool_call>\n'
         f'<tool_call>{{"name": "b", "arguments": {W}}}</tool_call>', "Let me check.\n\n",
         [("a", {}), ("b", {"city": "Paris", "days": 3})]),
        # SmolLM2 writes a list inside the tags; arguments as JSON text are taken too
        ('<tool_call>[{"name": "a", "arguments": {"x": 1}}, '
         '{"name": "b", "arguments": "{\\"y\\": 2}"}]</tool_call>', None, [("a", {"x": 1}), ("b", {"y": 2})]),
        # cut off by the end of the output, but whole: taken (as vLLM does)
        ('<tool_call>{"name": "a", "arguments": {"x": "é"}}', None, [("a", {"x": "é"})]),
        ("No tools needed: 2 + 2 = 4.", "No tools needed: 2 + 2 = 4.", []),
        ("", "", []),
        # malformed: returned as content, never an error
        ('<tool_call>{"name": "a", "arguments": {"x": 1</tool_call> then text',
         '<tool_call>{"name": "a", "arguments": {"x": 1</tool_call> then text', []),
        ('<tool_call>{"arguments": {"x": 1}}</tool_call>', '<tool_call>{"arguments": {"x": 1}}</tool_call>', []),
        ('<tool_call>{"name": "a", "arguments": [1]}</tool_call>',
         '<tool_call>{"name": "a", "arguments": [1]}</tool_call>', []),
        ('<tool_call>{"name": "a", "arguments": {"x": 1}', '<tool_call>{"name": "a", "arguments": {"x": 1}', []),
        ("<tool_call", "<tool_call", []),
        ('ok <tool_call>{"name": "a"}</tool_call> <tool_call>nope</tool_call>', "ok  <tool_call>nope</tool_call>",
         [("a", {})]),
    ],
    "llama3_json": [
        (f'{{"name": "get_weather", "parameters": {W}}}', None, [("get_weather", {"city": "Paris", "days": 3})]),
        ('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"y": [1, 2]}}', None,
         [("a", {}), ("b", {"y": [1, 2]})]),
        ("The weather is fine.", "The weather is fine.", []),
        ('{"answer": 42}', '{"answer": 42}', []),  # JSON, but not a call
        ('{"name": "a", "parameters": {"x": 1}', '{"name": "a", "parameters": {"x": 1}', []),
        ('{"name": "a", "parameters": {}}; oops', "oops", [("a", {})]),
        ("<|python_tag|>", "<|python_tag|>", []),
    ],
    "mistral": [
        (f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {W}}}]', None,
         [("get_weather", {"city": "Paris", "days": 3})]),
        ('Sure. [TOOL_CALLS] [{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"z": null}}]', "Sure. ",
         [("a", {}), ("b", {"z": None})]),
        (f'[TOOL_CALLS]get_weather[ARGS]{W}[TOOL_CALLS]b[ARGS]{{}}', None,
         [("get_weather", {"city": "Paris", "days": 3}), ("b", {})]),
        ("Just text [TOOL not a call", "Just text [TOOL not a call", []),
        ('[TOOL_CALLS][{"name": "a", "arguments": {', '[TOOL_CALLS][{"name": "a", "arguments": {', []),
        ('[TOOL_CALLS][{"nme": "a"}]', '[TOOL_CALLS][{"nme": "a"}]', []),
        ("[TOOL_CALLS]bad name[ARGS]{}", "[TOOL_CALLS]bad name[ARGS]{}", []),
        ("[TOOL_CALLS]a[ARGS][1]", "[TOOL_CALLS]a[ARGS][1]", []),
    ],
    "pythonic": [
        ('[get_weather(city="Paris", days=3)]', None, [("get_weather", {"city": "Paris", "days": 3})]),
        ('  [a(), ns.b(x=[1, {"k": None}], y=True)]\n', None,
         [("a", {}), ("ns.b", {"x": [1, {"k": None}], "y": True})]),
        ("[1, 2, 3] are numbers", "[1, 2, 3] are numbers", []),
        ("[a(1)]", "[a(1)]", []),  # positional arguments: not a call
        ("[a(x=1), b(y=", "[a(x=1), b(y=", []),
        ("[a(x={1, 2})]", "[a(x={1, 2})]", []),  # a set is not JSON
        ("[a(**k)]", "[a(**k)]", []),
        ("Plain answer.", "Plain answer.", []),
    ],
}
ALL = [(name, *case) for name, cases in CASES.items() for case in cases]


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def _stream(parser, pieces):
    s, content, calls = ToolCallStream(parser), "", []
    for i, piece in enumerate(pieces):
        c, new = s.feed(piece, final=i == len(pieces) - 1)
        content += c
        calls += new
    return content, calls


def _splits(text: str, seed: int) -> list[list[str]]:
    """The text in one piece, one character at a time, and in random pieces."""
    rng = random.Random(seed)
    out = [[text, ""], [*text, ""]]
    for _ in range(5):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text), rng.randint(1, 6))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])] + [""])
    return out


@pytest.mark.parametrize("name,text,content,calls", ALL)
def test_extract(name, text, content, calls):
    got_content, got_calls = TOOL_PARSERS[name]().extract(text)
    assert got_content == content
    assert _calls(got_calls) == calls
    assert all(c.id.startswith("call_") and len(c.id) > 10 for c in got_calls)
    assert len({c.id for c in got_calls}) == len(got_calls)


@pytest.mark.parametrize("name,text,content,calls", ALL)
def test_streaming_gives_the_same_calls(name, text, content, calls):
    for pieces in _splits(text, seed=len(text)):
        got_content, got_calls = _stream(TOOL_PARSERS[name](), pieces)
        assert _calls(got_calls) == calls, pieces
        assert got_content == (content or ""), pieces


def test_stream_sends_content_before_a_call_ends_and_the_call_once_whole():
    s = ToolCallStream(TOOL_PARSERS["hermes"]())
    assert s.feed("Checking") == ("Checking", [])
    assert s.feed(" now.<tool") == (" now.", [])  # a marker's start is held
    assert s.feed('_call>{"name": "f", "arguments": {"a"') == ("", [])
    content, calls = s.feed(': 1}}</tool_call>')
    assert content == "" and _calls(calls) == [("f", {"a": 1})]
    assert s.feed("", final=True) == ("", [])


def test_registry_names_every_format():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic"}
    assert all(cls.name == name for name, cls in TOOL_PARSERS.items())


REQUIRED = [
    ('[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]', None,
     [("a", '{"x": 1}'), ("b", "{}")]),
    (' [ {"name": "a", "parameters": {"s": "}]\\"{"} } ] ', None, [("a", '{"s": "}]\\"{"}')]),
    # cut off by max_tokens: the arguments written so far, as vLLM answers
    ('[{"name": "a", "parameters": {}}, {"name": "b", "parameters": {"y": [1, ', None,
     [("a", "{}"), ("b", '{"y": [1, ')]),
    ('[{"name": "a", "param', '[{"name": "a", "param', []),  # no call yet: the text is content
    # what the grammar would not have let through: content
    ("not json", "not json", []),
    ('[{"nme": "a"}]', '[{"nme": "a"}]', []),
    ('[{"name": "a", "parameters": {}}, 7]', " 7]", [("a", "{}")]),
]


def _required(pieces: list[str], parallel: bool = True):
    """The calls (name, arguments) and content a stream of `pieces` assembles, and the whole answer."""
    from kvserve.server.serving import ChatSettings
    from kvserve.server.tools import ChoiceOutput, ToolPlan

    plan = ToolPlan(mode="required", tools=[], parallel=parallel)
    out, content, calls = ChoiceOutput(plan, ChatSettings()), "", {}
    for i, p in enumerate(pieces):
        parts = out.feed(p, final=i == len(pieces) - 1)
        content += parts.content
        for d in parts.calls:
            c = calls.setdefault(d.index, ["", ""])
            c[0] += d.function.name or ""
            c[1] += d.function.arguments or ""
    whole = ChoiceOutput(plan, ChatSettings()).whole("".join(pieces))
    return (content, [tuple(c) for _, c in sorted(calls.items())]), whole


@pytest.mark.parametrize("text,content,calls", REQUIRED)
def test_required_output(text, content, calls):
    for pieces in _splits(text, seed=1):
        streamed, whole = _required(pieces)
        assert whole.content == content
        assert [(c.function.name, c.function.arguments) for c in whole.tool_calls or []] == calls
        assert streamed == (content or "", calls), pieces


def test_required_streams_arguments_as_they_are_written():
    from kvserve.server.serving import ChatSettings
    from kvserve.server.tools import ChoiceOutput, ToolPlan

    out = ChoiceOutput(ToolPlan(mode="required", tools=[]), ChatSettings())
    assert out.feed('[{"name": "get_weather"').calls == []
    first = out.feed(', "parameters": {"ci').calls
    assert [(d.index, d.function.name, d.function.arguments) for d in first] == \
        [(0, "get_weather", ""), (0, None, '{"ci')]
    assert first[0].id.startswith("call_") and first[1].id is None
    assert [d.function.arguments for d in out.feed('ty": "Paris"}}').calls] == ['ty": "Paris"}']
    assert out.feed("]", final=True).calls == []
    assert _required(['[{"name": "a", "parameters": {}}, {"name": "b", "parameters": {}}]'],
                     parallel=False)[0] == ("", [("a", "{}")])


PIECES = ["<tool_call>", "</tool_call>", '{"name": "a", "arguments": {"x": 1}}', '{"name": "b"}', "[TOOL_CALLS]",
          "[ARGS]", "<|python_tag|>", ";", "[", "]", "a(x=1)", ", ", " ", "\n", "hi", "{", "}", '"', "<", "b",
          '{"name": "a", "parameters": {}}', "<tool", "_call>", "[TOOL", "_CALLS]", ","]


@pytest.mark.parametrize("name", sorted(TOOL_PARSERS))
def test_any_text_streams_as_it_extracts(name):
    """Property: for any text and any way of cutting it, the stream gives what extract() gives."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    make = TOOL_PARSERS[name]

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(st.sampled_from(PIECES), max_size=12), st.lists(st.integers(0, 200), max_size=6))
    def check(pieces, cuts):
        text = "".join(pieces)
        content, calls = make().extract(text)
        points = sorted({min(c, len(text)) for c in cuts})
        parts = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])] + [""]
        streamed_content, streamed = _stream(make(), parts)
        assert _calls(streamed) == _calls(calls)
        assert streamed_content == (content or "")

    check()


def test_required_streams_as_it_reads():
    """Property: for any text and any way of cutting it, tool_choice "required"'s stream assembles
    what the whole answer has."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    pieces_of = st.lists(st.sampled_from(['[', ']', '{', '}', ',', ' ', '"name": "a"', '"parameters": ', '"x"', ':',
                                          '{"name": "b", "parameters": {"s": "}"}}', '"\\"', '1', 'z']),
                         max_size=14)

    @settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
    @given(pieces_of, st.lists(st.integers(0, 120), max_size=6))
    def check(pieces, cuts):
        text = "".join(pieces)
        points = sorted({min(c, len(text)) for c in cuts})
        parts = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])] + [""]
        (content, calls), whole = _required(parts)
        assert calls == [(c.function.name, c.function.arguments) for c in whole.tool_calls or []]
        assert content == (whole.content or "")

    check()
