"""Tools, tool calls and reasoning over HTTP with the official client: a server with
--tool-call-parser hermes, --reasoning-parser deepseek_r1 and --chat-template FILE (a template that
renders tools itself); the session's plain server renders them in kvserve's default format; and
LLM.chat renders them as the server does."""

from __future__ import annotations

import json

import pytest

from kvserve.chat_tools import TOOLS_PROMPT
from tests.serving import MODEL, PROMPT, TINY_SERVER_ARGS, http_request, running_server
from tests.server.test_response_format import TOOLS, needs_grammar

openai = pytest.importorskip("openai")

# Renders tools, tool calls and tool results itself (so kvserve passes them through as transformers does).
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% for t in tools %}TOOL {{ t.function.name }}"
    "{% if t.function.parameters %} {{ t.function.parameters | tojson }}{% endif %}\n{% endfor %}<|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
    "CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}{% elif m.role == 'tool' %}"
    "RESULT {{ m.tool_call_id }}: {{ m.content }}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HISTORY = [{"role": "user", "content": "Weather in Paris?"},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
           {"role": "tool", "tool_call_id": "call_1", "content": "12C and rain"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def tools_server(tmp_path_factory):
    """A tiny llama with room for a tool list (4096 positions) behind the chat flags."""
    from tests.conftest import build_tiny_model

    tmp = tmp_path_factory.mktemp("tools-server")
    model = build_tiny_model(tmp / "model", "llama", max_position_embeddings=4096)
    (tmp / "template.jinja").write_text(TEMPLATE)
    args = [str(model), *TINY_SERVER_ARGS, "--num-kv-blocks", "1024", "--tool-call-parser", "hermes",
            "--enable-auto-tool-choice", "--reasoning-parser", "deepseek_r1", "--chat-template",
            str(tmp / "template.jinja")]
    with running_server(args, tmp / "server.log") as srv:
        yield srv


@pytest.fixture(scope="module")
def tools_client(tools_server):
    return openai.OpenAI(base_url=tools_server.v1, api_key="unused", max_retries=0, timeout=120)


def _rendered(base: str, messages: list[dict], tools: list[dict] | None) -> tuple[list[int], str]:
    body = {"model": MODEL, "messages": messages, **({"tools": tools} if tools else {})}
    status, raw, _ = http_request("POST", f"{base}/tokenize", body)
    assert status == 200, raw
    ids = json.loads(raw)["tokens"]
    status, raw, _ = http_request("POST", f"{base}/detokenize", {"model": MODEL, "tokens": ids})
    return ids, json.loads(raw)["prompt"]


def test_template_with_tools_gets_them_natively(tools_server):
    """What the template is given: the tools, and the history with each call's arguments as an object."""
    import jinja2

    _, text = _rendered(tools_server.base, HISTORY, TOOLS)
    history = [HISTORY[0], {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "12C and rain"}]
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)  # transformers' settings
    env.policies["json.dumps_kwargs"] = {"sort_keys": False}  # and its tojson's
    assert text == env.from_string(TEMPLATE).render(messages=history, tools=TOOLS, add_generation_prompt=True)
    assert 'CALL get_weather {"city": "Paris"}' in text and "RESULT call_1: 12C and rain" in text


def test_template_without_tools_gets_the_default_format(server, tiny_server):
    _, text = _rendered(server, [{"role": "system", "content": "Be brief."}, *HISTORY], TOOLS[1:])
    tools_text = TOOLS_PROMPT.format(tools=json.dumps(TOOLS[1]))
    assert text.startswith(f"<|im_start|>system\nBe brief.\n\n{tools_text}<|im_end|>\n")
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n12C and rain\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n") in text
    assert "does not render tools" in tiny_server.log_text()
    # no tools, no system message: one is added for them
    _, text = _rendered(server, HISTORY[:1], TOOLS[1:])
    assert text.startswith(f"<|im_start|>system\n{tools_text}<|im_end|>\n<|im_start|>user\nWeather")


def test_history_with_tool_calls_is_served(tools_client, tools_server):
    ids, _ = _rendered(tools_server.base, HISTORY, TOOLS)
    out = tools_client.chat.completions.create(model=MODEL, messages=HISTORY, tools=TOOLS, tool_choice="none",
                                               max_tokens=4, temperature=0, extra_body=NO_THINKING)
    assert out.usage.prompt_tokens == len(ids)
    assert out.choices[0].message.tool_calls is None


def test_bad_history_is_a_400_naming_it(tools_server):
    bad = [*HISTORY[:1], {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]
    status, raw, _ = http_request("POST", f"{tools_server.base}/v1/chat/completions",
                                  {"model": MODEL, "messages": bad, "max_tokens": 2})
    body = json.loads(raw)
    assert status == 400 and body["error"]["param"] == "messages[1].tool_calls[0]", body


def test_auto_without_a_call_is_the_plain_answer(tools_client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": PROMPT}], tools=TOOLS, max_tokens=12,
              temperature=0, extra_body={**NO_THINKING, "ignore_eos": True})
    plain = tools_client.chat.completions.create(tool_choice="none", **kw).choices[0]
    auto = tools_client.chat.completions.create(tool_choice="auto", **kw).choices[0]
    assert auto.message.tool_calls is None and auto.message.content == plain.message.content
    assert auto.finish_reason == plain.finish_reason == "length"
    chunks = list(tools_client.chat.completions.create(tool_choice="auto", stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain.message.content


def test_streamed_logprobs_of_held_text_are_not_lost(tools_client):
    """Text a parser holds back (it might start a call) keeps its tokens' logprobs for a later chunk."""
    kw = dict(model=MODEL, messages=[{"role": "user", "content": PROMPT}], tools=TOOLS, max_tokens=12,
              temperature=0, logprobs=True, stream=True, extra_body={"ignore_eos": True})
    chunks = [c for c in tools_client.chat.completions.create(tool_choice="auto", **kw) if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices[0].logprobs) == 12
    assert chunks[-1].choices[0].finish_reason == "length"


def test_reasoning_parser_splits_the_output(tools_client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=12, temperature=0)
    plain = tools_client.chat.completions.create(extra_body={**NO_THINKING, "ignore_eos": True}, **kw)
    text = plain.choices[0].message.content
    assert plain.choices[0].message.model_extra.get("reasoning_content") is None
    # deepseek_r1: an output that never closes </think> is all reasoning
    out = tools_client.chat.completions.create(extra_body={"ignore_eos": True}, **kw).choices[0].message
    assert out.content is None and out.model_extra["reasoning_content"] == text
    chunks = list(tools_client.chat.completions.create(stream=True, extra_body={"ignore_eos": True}, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == text
    assert not any(d.content for d in deltas)


def test_llm_chat_renders_tools_as_the_server_does(server, tiny_model_factory):
    from kvserve import LLM, SamplingParams

    llm = LLM(str(tiny_model_factory("llama")), dtype="float32", num_kv_blocks=64)
    ids, _ = _rendered(server, HISTORY, TOOLS[1:])
    assert llm.apply_chat_template(HISTORY, tools=TOOLS[1:]) == ids
    short, _ = _rendered(server, HISTORY[:1], TOOLS[1:])  # what fits the tiny model's 512 positions
    out = llm.chat(HISTORY[:1], SamplingParams(max_tokens=2, temperature=0), tools=TOOLS[1:], use_tqdm=False)
    assert out[0].prompt_token_ids == short
    with pytest.raises(ValueError, match=r"messages\[1\]\.tool_calls\[0\]"):
        llm.apply_chat_template([HISTORY[0], {"role": "assistant", "tool_calls": [{"function": {}}]}])


# ---- what needs the grammar (kvserve/structured/) to hold ----------------------------------------

def _calls(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def _assembled(chunks) -> tuple[str | None, list[tuple[str, str, str]]]:
    """A stream's content and its tool calls (id, name, arguments) put together by index."""
    content, calls = "", {}
    for ch in chunks:
        for d in ch.choices[0].delta.tool_calls or [] if ch.choices else []:
            c = calls.setdefault(d.index, ["", "", ""])
            c[0] += d.id or ""
            c[1] += (d.function.name or "") if d.function else ""
            c[2] += (d.function.arguments or "") if d.function else ""
        if ch.choices:
            content += ch.choices[0].delta.content or ""
    return content, [tuple(c) for _, c in sorted(calls.items())]


@needs_grammar
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_calls_validate_and_stream_the_same(tools_client, choice):
    jsonschema = pytest.importorskip("jsonschema")
    kw = dict(model=MODEL, messages=[{"role": "user", "content": PROMPT}], tools=TOOLS, tool_choice=choice,
              max_tokens=200, temperature=0, extra_body=NO_THINKING)
    out = tools_client.chat.completions.create(**kw).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content is None, out
    calls = _calls(out.message)
    assert calls and all(out.message.tool_calls[i].id.startswith("call_") for i in range(len(calls)))
    params = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in TOOLS}
    for name, args in calls:
        jsonschema.validate(args, params[name])
    if isinstance(choice, dict):
        assert [n for n, _ in calls] == ["get_weather"]
    chunks = list(tools_client.chat.completions.create(stream=True, **kw))
    content, streamed = _assembled(chunks)
    assert content == ""
    assert [(n, a) for _, n, a in streamed] == [(c.function.name, c.function.arguments) for c in out.message.tool_calls]
    assert all(i.startswith("call_") for i, _, _ in streamed)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the arguments come as they are generated: more pieces than calls
    pieces = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or [] if d.function.arguments]
    assert len(pieces) > len(calls)


@needs_grammar
def test_second_turn_with_the_tool_result(tools_client):
    kw = dict(model=MODEL, tools=TOOLS, max_tokens=16, temperature=0, extra_body=NO_THINKING)
    first = tools_client.chat.completions.create(
        messages=HISTORY[:1], tool_choice={"type": "function", "function": {"name": "get_weather"}}, **kw)
    msg = first.choices[0].message
    history = [*HISTORY[:1], msg, {"role": "tool", "tool_call_id": msg.tool_calls[0].id, "content": "12C"}]
    second = tools_client.chat.completions.create(messages=history, tool_choice="none", **kw)
    assert second.choices[0].message.tool_calls is None and second.usage.prompt_tokens > first.usage.prompt_tokens


@needs_grammar
def test_auto_reads_the_models_calls_and_keeps_malformed_ones_as_text(tools_client):
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": </tool_call>'
    kw = dict(model=MODEL, messages=[{"role": "user", "content": PROMPT}], tools=TOOLS, tool_choice="auto",
              max_tokens=100, temperature=0)
    out = tools_client.chat.completions.create(
        extra_body={**NO_THINKING, "structured_outputs": {"choice": [call]}}, **kw).choices[0]
    assert out.finish_reason == "tool_calls" and _calls(out.message) == [("get_weather", {"city": "Rome"})]
    chunks = list(tools_client.chat.completions.create(
        stream=True, extra_body={**NO_THINKING, "structured_outputs": {"choice": [call]}}, logprobs=True,
        stream_options={"include_usage": True}, **kw))
    assert [(n, json.loads(a)) for _, n, a in _assembled(chunks)[1]] == [("get_weather", {"city": "Rome"})]
    # every token was held until the call was whole; their logprobs come with it
    lps = sum(len(c.choices[0].logprobs.content) for c in chunks if c.choices and c.choices[0].logprobs)
    assert lps == chunks[-1].usage.completion_tokens > 5
    out = tools_client.chat.completions.create(
        extra_body={**NO_THINKING, "structured_outputs": {"choice": [broken]}}, **kw).choices[0]
    assert out.message.tool_calls is None and out.message.content == broken and out.finish_reason == "stop"


def test_chat_flags_are_checked_before_anything_starts(tmp_path, capsys):
    from kvserve.server import launch

    assert launch.main(["--enable-auto-tool-choice"]) == 2
    assert "--enable-auto-tool-choice needs --tool-call-parser" in capsys.readouterr().err
    assert launch.main(["--chat-template", str(tmp_path / "missing.jinja")]) == 2
    assert "--chat-template: no such file" in capsys.readouterr().err
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}")
    assert launch.main(["--chat-template", str(tmp_path / "bad.jinja")]) == 2
    assert "not a valid Jinja template" in capsys.readouterr().err
    assert launch.load_chat_template(TEMPLATE) == TEMPLATE  # the template's text itself, as vLLM takes it
    with pytest.raises(SystemExit):
        launch.main(["--tool-call-parser", "nope"])


@needs_grammar
def test_client_parse_with_a_pydantic_tool(tools_client):
    """The official client's strict pydantic tools: parse() validates the arguments into the model."""
    from typing import Literal

    from pydantic import BaseModel

    class GetWeather(BaseModel):
        city: Literal["Paris", "Rome"]
        metric: bool

    out = tools_client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Rome?"}], max_tokens=100, temperature=0,
        tools=[openai.pydantic_function_tool(GetWeather)], tool_choice="required",
        extra_body=NO_THINKING).choices[0]
    assert out.finish_reason == "tool_calls"
    call = out.message.tool_calls[0]
    assert call.function.name == "GetWeather" and isinstance(call.function.parsed_arguments, GetWeather)


@needs_grammar
def test_langchain_bind_tools(tools_server):
    """langchain-openai's tool calling (a client this project did not write) gets the same call."""
    langchain_openai = pytest.importorskip("langchain_openai")
    chat = langchain_openai.ChatOpenAI(model=MODEL, base_url=tools_server.v1, api_key="unused", temperature=0,
                                       max_tokens=100, max_retries=0, timeout=120,
                                       extra_body=NO_THINKING)
    bound = chat.bind_tools(TOOLS[:1], tool_choice="get_weather")
    msg = bound.invoke("Weather in Paris?")
    assert [c["name"] for c in msg.tool_calls] == ["get_weather"]
    assert msg.tool_calls[0]["args"]["city"] in ("Paris", "Rome") and msg.tool_calls[0]["id"].startswith("call_")
    streamed = None
    for chunk in bound.stream("Weather in Paris?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(c["name"], c["args"]) for c in msg.tool_calls]


@needs_grammar
def test_a_constraint_applies_after_the_reasoning(tools_client):
    """Under --reasoning-parser the grammar starts once the reasoning ends (as vLLM does): a model
    that never writes </think> reasons unconstrained to max_tokens; an assistant turn continued
    after </think> is constrained from its first token and has no reasoning; with thinking off the
    constraint holds from the start."""
    msgs = [{"role": "user", "content": PROMPT}]
    kw = dict(model=MODEL, max_tokens=12, temperature=0)
    choice = {"structured_outputs": {"choice": ["yes", "no"]}}
    out = tools_client.chat.completions.create(messages=msgs, extra_body={**choice, "ignore_eos": True},
                                               **kw).choices[0]
    assert out.finish_reason == "length" and out.message.model_extra.get("reasoning_content")
    after = msgs + [{"role": "assistant", "content": "<think>Easy.</think>"}]
    out = tools_client.chat.completions.create(
        messages=after, extra_body={**choice, "continue_final_message": True, "add_generation_prompt": False},
        **kw).choices[0]
    assert out.message.content in ("yes", "no") and out.message.model_extra.get("reasoning_content") is None
    out = tools_client.chat.completions.create(messages=msgs, tools=TOOLS, tool_choice="required",
                                               extra_body=NO_THINKING, **{**kw, "max_tokens": 200}).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.tool_calls
    assert out.message.model_extra.get("reasoning_content") is None


@needs_grammar
def test_each_choice_has_its_own_calls(tools_client):
    """n > 1: every choice is read on its own, streamed or not."""
    kw = dict(model=MODEL, messages=[{"role": "user", "content": PROMPT}], tools=TOOLS, n=2, seed=7,
              tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=100, temperature=1,
              extra_body=NO_THINKING)
    out = tools_client.chat.completions.create(**kw)
    assert [c.index for c in out.choices] == [0, 1]
    for c in out.choices:
        assert c.finish_reason == "tool_calls" and c.message.tool_calls[0].function.name == "get_weather"
        assert json.loads(c.message.tool_calls[0].function.arguments)["city"] in ("Paris", "Rome")
    chunks = list(tools_client.chat.completions.create(stream=True, **kw))
    for i, choice in enumerate(out.choices):
        mine = [c for c in chunks if c.choices and c.choices[0].index == i]
        _, calls = _assembled(mine)
        assert [(n, a) for _, n, a in calls] == [("get_weather", choice.message.tool_calls[0].function.arguments)]
