"""Reasoning parsers (deepseek_r1, qwen3) split <think>...</think> from the answer, streaming and
not alike; with tools, the calls are read from the answer alone (tools.ChoiceOutput)."""

from __future__ import annotations

import json

import pytest

from kvserve.server import protocol as P
from kvserve.server.reasoning_parsers import REASONING_PARSERS, ReasoningStream
from kvserve.server.serving import ChatSettings
from kvserve.server.tools import ChoiceOutput, ToolPlan, thinking_on

CASES = [
    ("deepseek_r1", "<think>\nLet me add.\n</think>\n\n4", "\nLet me add.\n", "\n\n4"),
    ("deepseek_r1", "The prompt opened it.</think>Answer", "The prompt opened it.", "Answer"),
    ("deepseek_r1", "Still thinking when cut off", "Still thinking when cut off", ""),  # as vLLM: all reasoning
    ("deepseek_r1", "<think></think>", "", ""),
    ("qwen3", "<think>\nhm\n</think>\n\nHello", "\nhm\n", "\n\nHello"),
    ("qwen3", "Hello, no thinking", None, "Hello, no thinking"),
    ("qwen3", "Hi <think>x</think> there", "x", "Hi  there"),
    ("qwen3", "<think>cut off", "cut off", ""),
    ("qwen3", "a < b and </think> alone", None, "a < b and </think> alone"),
]


def _pieces(text: str) -> list[list[str]]:
    return [[text, ""], [*text, ""], [text[i:i + 3] for i in range(0, len(text), 3)] + [""]]


@pytest.mark.parametrize("name,text,reasoning,content", CASES)
def test_split_and_stream(name, text, reasoning, content):
    parser = REASONING_PARSERS[name]()
    assert parser.split(text, final=True) == (reasoning, content)
    for pieces in _pieces(text):
        s, got_r, got_c = ReasoningStream(parser), "", ""
        for i, p in enumerate(pieces):
            r, c = s.feed(p, final=i == len(pieces) - 1)
            got_r, got_c = got_r + r, got_c + c
        assert (got_r, got_c) == (reasoning or "", content), pieces
        assert s.found == (reasoning is not None)


def test_stream_holds_a_half_written_tag():
    s = ReasoningStream(REASONING_PARSERS["qwen3"]())
    assert s.feed("<thi") == ("", "")
    assert s.feed("nk>abc</th") == ("abc", "")
    assert s.feed("ink>ok") == ("", "ok")


def test_thinking_switch():
    assert thinking_on(None) and thinking_on({"enable_thinking": True})
    assert not thinking_on({"enable_thinking": False}) and not thinking_on({"thinking": False})


def _assemble(out: ChoiceOutput, pieces: list[str]) -> dict:
    """A stream's deltas put together as a client does."""
    msg: dict = {"reasoning": "", "content": "", "calls": {}}
    for i, p in enumerate(pieces):
        parts = out.feed(p, final=i == len(pieces) - 1)
        msg["reasoning"] += parts.reasoning
        msg["content"] += parts.content
        for d in parts.calls:
            call = msg["calls"].setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = d.id or call["id"]
            call["name"] = d.function.name or call["name"]
            call["arguments"] += d.function.arguments or ""
    return msg


OUTPUT = '<think>Need weather.</think>Checking.<tool_call>{"name": "w", "arguments": {"c": "P"}}</tool_call>'


@pytest.mark.parametrize("pieces", [[OUTPUT, ""], [*OUTPUT, ""]])
def test_reasoning_then_tool_calls_stream_as_whole(pieces):
    settings = ChatSettings(tool_call_parser="hermes", reasoning_parser="deepseek_r1")
    plan = ToolPlan(mode="auto", tools=[])
    whole = ChoiceOutput(plan, settings).whole(OUTPUT)
    assert whole.reasoning_content == "Need weather." and whole.content == "Checking."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.tool_calls] == [("w", {"c": "P"})]
    streamed = _assemble(ChoiceOutput(plan, settings), pieces)
    assert streamed["reasoning"] == whole.reasoning_content and streamed["content"] == whole.content
    assert [(c["name"], c["arguments"]) for c in streamed["calls"].values()] == \
        [(c.function.name, c.function.arguments) for c in whole.tool_calls]
    assert all(c["id"].startswith("call_") for c in streamed["calls"].values())
    assert ChoiceOutput(plan, settings).finish_reason("stop") == "stop"  # no call yet
    out = ChoiceOutput(plan, settings)
    out.whole(OUTPUT)
    assert out.finish_reason("stop") == "tool_calls" and out.finish_reason("length") == "length"


def test_thinking_off_means_no_reasoning():
    settings = ChatSettings(reasoning_parser="qwen3")
    msg = ChoiceOutput(ToolPlan(), settings, thinking=False).whole("<think>x</think>y")
    assert msg.reasoning_content is None and msg.content == "<think>x</think>y"
    msg = ChoiceOutput(ToolPlan(), settings).whole("<think>x</think>")
    assert msg.reasoning_content == "x" and msg.content is None


def test_named_function_output_is_the_arguments():
    plan = ToolPlan(mode="named", name="w", tools=[])
    msg = ChoiceOutput(plan, ChatSettings()).whole('{"c": "P"}')
    assert msg.content is None and msg.tool_calls[0].function.name == "w"
    assert msg.tool_calls[0].function.arguments == '{"c": "P"}'
    streamed = _assemble(ChoiceOutput(plan, ChatSettings()), ['{"c"', ': "P"}', ""])
    assert streamed["calls"][0]["arguments"] == '{"c": "P"}' and streamed["content"] == ""


def test_parallel_tool_calls_false_keeps_the_first():
    plan = ToolPlan(mode="auto", tools=[], parallel=False)
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    msg = ChoiceOutput(plan, ChatSettings(tool_call_parser="hermes")).whole(text)
    assert [c.function.name for c in msg.tool_calls] == ["a"]
    assert isinstance(msg, P.ChatResponseMessage)


@pytest.mark.parametrize("name", sorted(REASONING_PARSERS))
def test_any_text_streams_as_it_splits(name):
    """Property: for any text and any way of cutting it, the stream gives what split() gives."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    pieces_of = st.lists(st.sampled_from(["<think>", "</think>", "<th", "ink>", "</th", "x", " ", "\n", "<", ">"]),
                         max_size=10)

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
    @given(pieces_of, st.lists(st.integers(0, 80), max_size=5))
    def check(pieces, cuts):
        text = "".join(pieces)
        reasoning, content = REASONING_PARSERS[name]().split(text, final=True)
        points = sorted({min(c, len(text)) for c in cuts})
        parts = [text[a:b] for a, b in zip([0, *points], [*points, len(text)])] + [""]
        s, got_r, got_c = ReasoningStream(REASONING_PARSERS[name]()), "", ""
        for i, p in enumerate(parts):
            r, c = s.feed(p, final=i == len(parts) - 1)
            got_r, got_c = got_r + r, got_c + c
        assert (got_r, got_c) == (reasoning or "", content)

    check()
