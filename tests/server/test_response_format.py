"""response_format, structured_outputs and vLLM's deprecated guided_* fields map onto
SamplingParams.structured_outputs, with a 400 naming the field for a bad or conflicting value;
tool_choice "required" / a named function map onto the tool call's JSON schema."""

from __future__ import annotations

import importlib.util
import json
import logging

import pytest
from pydantic import ValidationError

from kvserve.sampling_params import StructuredOutputsParams
from kvserve.server import protocol as P
from kvserve.server.serving import APIError, ChatSettings
from kvserve.server.structured_fields import structured_outputs
from kvserve.server.tools import plan_tools, required_schema
from tests.serving import MODEL, PROMPT, http_request

MSGS = [{"role": "user", "content": "hi"}]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "the weather",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "enum": ["Paris", "Rome"]}},
                                               "required": ["city"]}}},
         {"type": "function", "function": {"name": "now"}}]
# The grammar is enforced by the engine's kvserve/structured/; without it the constraint is carried, not held.
needs_grammar = pytest.mark.skipif(importlib.util.find_spec("kvserve.structured") is None,
                                   reason="constrained decoding (kvserve/structured/) is not in this tree yet")


def chat(**fields) -> P.ChatCompletionRequest:
    return P.ChatCompletionRequest.model_validate({"messages": MSGS, **fields})


def _error(fn, *args) -> APIError:
    with pytest.raises(APIError) as e:
        fn(*args)
    assert e.value.status == 400
    return e.value


@pytest.mark.parametrize("fields,expected", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA, "strict": True}}},
     StructuredOutputsParams(json=SCHEMA)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}},
     StructuredOutputsParams(json_object=True)),
    ({"structured_outputs": {"regex": "[0-9]+"}}, StructuredOutputsParams(regex="[0-9]+")),
    ({"structured_outputs": {"json": json.dumps(SCHEMA), "whitespace_pattern": " ?"}},
     StructuredOutputsParams(json=SCHEMA, whitespace_pattern=" ?")),
    ({"guided_json": SCHEMA}, StructuredOutputsParams(json=SCHEMA)),
    ({"guided_json": json.dumps(SCHEMA)}, StructuredOutputsParams(json=SCHEMA)),
    ({"guided_regex": "a|b"}, StructuredOutputsParams(regex="a|b")),
    ({"guided_choice": ["yes", "no"]}, StructuredOutputsParams(choice=["yes", "no"])),
    ({"guided_grammar": 'root ::= "x"'}, StructuredOutputsParams(grammar='root ::= "x"')),
])
def test_fields_map_to_structured_outputs(fields, expected):
    got, field = structured_outputs(chat(**fields))
    assert got == expected
    assert (field is None) == (expected is None)


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": "x"}}},
     "response_format"),  # the schema's type: pydantic names the field
    ({"response_format": {"type": "text", "json_schema": {"name": "a"}}}, "response_format.json_schema"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"json": [1]}}, "structured_outputs.json"),
    ({"structured_outputs": {"regexp": "a"}}, "structured_outputs.regexp"),
    ({"guided_json": "[1, 2"}, "guided_json"),
    ({"guided_json": "[1, 2]"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
])
def test_bad_or_conflicting_values_name_the_field(fields, param):
    try:
        req = chat(**fields)
    except ValidationError as e:  # the schema's own check (a 400 naming the field over HTTP)
        assert ".".join(map(str, e.errors()[0]["loc"])).startswith(param)
        return
    assert _error(structured_outputs, req).param == param


def test_guided_fields_log_a_deprecation_once(caplog):
    from kvserve.server import structured_fields

    structured_fields._warned.discard("guided_regex")
    with caplog.at_level(logging.WARNING, logger="kvserve.server.structured_fields"):
        for _ in range(3):
            structured_outputs(chat(guided_regex="a"))
    lines = [r.getMessage() for r in caplog.records if "guided_regex" in r.getMessage()]
    assert len(lines) == 1 and "deprecated" in lines[0] and "structured_outputs" in lines[0]


def test_completions_take_structured_outputs_not_response_format():
    req = P.CompletionRequest.model_validate({"prompt": "x", "structured_outputs": {"choice": ["a", "b"]}})
    assert structured_outputs(req) == (StructuredOutputsParams(choice=["a", "b"]), "structured_outputs")
    with pytest.raises(ValidationError):
        P.CompletionRequest.model_validate({"prompt": "x", "response_format": {"type": "json_object"}})


# ---- tool_choice -> schema ------------------------------------------------------------------

PARSER = ChatSettings(tool_call_parser="hermes")


def test_required_is_an_array_of_the_tools_calls():
    plan = plan_tools(chat(tools=TOOLS, tool_choice="required"), ChatSettings())
    schema = plan.constraint.json
    assert plan.mode == "required" and schema == required_schema(chat(tools=TOOLS).tools, True)
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    first, second = schema["items"]["anyOf"]
    assert first["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
    assert first["properties"]["parameters"] == TOOLS[0]["function"]["parameters"]
    assert second["properties"]["parameters"] == {"type": "object", "properties": {}}  # no parameters given
    assert all(item["required"] == ["name", "parameters"] for item in (first, second))
    one = plan_tools(chat(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), ChatSettings())
    assert one.constraint.json["maxItems"] == 1


def test_named_function_is_its_parameters():
    plan = plan_tools(chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                      ChatSettings())
    assert (plan.mode, plan.name) == ("named", "get_weather")
    assert plan.constraint == StructuredOutputsParams(json=TOOLS[0]["function"]["parameters"])
    assert plan.tools == TOOLS


def test_auto_and_none():
    assert plan_tools(chat(tools=TOOLS), PARSER).mode == "auto"
    assert plan_tools(chat(tools=TOOLS), PARSER).constraint is None
    none = plan_tools(chat(tools=TOOLS, tool_choice="none"), ChatSettings())
    assert none.mode == "none" and none.constraint is None and none.tools == TOOLS
    assert plan_tools(chat(), ChatSettings()).tools is None


@pytest.mark.parametrize("fields,settings,param", [
    ({"tools": TOOLS}, ChatSettings(), "tool_choice"),  # auto without --tool-call-parser
    ({"tool_choice": "required"}, PARSER, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, PARSER, "tool_choice"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, PARSER, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
                {"type": "function", "function": {"name": "g", "parameters": {"properties": "x"}}}],
      "tool_choice": "required"}, PARSER, None),  # a schema the grammar backend judges
])
def test_tool_choice_errors_name_the_field(fields, settings, param):
    req = chat(**fields)
    if param is None:
        assert plan_tools(req, settings).constraint is not None
        return
    err = _error(plan_tools, req, settings)
    assert err.param == param
    if "nope" in json.dumps(fields):
        assert "'nope'" in err.message and "get_weather" in err.message


@pytest.mark.parametrize("fields,loc", [
    ({"tool_choice": "sometimes", "tools": TOOLS}, "tool_choice"),
    ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools"),
    ({"messages": [{"role": "tool", "content": "12C"}]}, "messages"),  # no tool_call_id
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]}, "messages"),
])
def test_bad_tool_fields_fail_the_schema(fields, loc):
    with pytest.raises(ValidationError) as e:
        P.ChatCompletionRequest.model_validate({"messages": MSGS, **fields})
    assert str(e.value.errors()[0]["loc"][0]) == loc


def test_a_response_message_goes_back_into_the_history():
    msg = P.ChatResponseMessage(content=None, reasoning_content="r", tool_calls=[P.ResponseToolCall(
        id="call_1", function=P.ResponseFunctionCall(name="now", arguments="{}"))])
    back = P.ChatMessage.model_validate(msg.model_dump())
    assert back.role == "assistant" and back.tool_calls[0].function.name == "now"
    P.ChatMessage.model_validate({"role": "tool", "tool_call_id": "call_1", "content": "12:00"})


# ---- over HTTP --------------------------------------------------------------------------------

def _post(server: str, **fields) -> tuple[int, dict]:
    status, body, _ = http_request("POST", f"{server}/v1/chat/completions",
                                   {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}],
                                    "max_tokens": 4, **fields})
    return status, json.loads(body)


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"guided_json": "{", "response_format": {"type": "json_object"}}, "guided_json"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"tools": TOOLS}, "tool_choice"),  # the test server has no --tool-call-parser
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tool_choice": "auto"}, "tool_choice"),
])
def test_http_errors_name_the_field(server, fields, param):
    status, body = _post(server, **fields)
    assert status == 400, body
    assert body["error"]["param"] == param, body


def test_http_constrained_request_is_served(server):
    """The constraint travels to the engine; the answer's shape is the usual one."""
    for fields in ({"response_format": {"type": "json_object"}}, {"structured_outputs": {"choice": ["a", "b"]}}):
        status, body = _post(server, **fields)
        assert status == 200, (fields, body)
        assert body["choices"][0]["message"]["tool_calls"] is None
    status, body, _ = http_request("POST", f"{server}/v1/completions", {
        "model": MODEL, "prompt": PROMPT, "max_tokens": 4, "guided_choice": ["yes", "no"]})
    assert status == 200, body


@needs_grammar
def test_http_constraints_hold(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=64, temperature=0)
    out = client.chat.completions.create(response_format={"type": "json_object"}, **kw).choices[0]
    if out.finish_reason == "stop":
        assert isinstance(json.loads(out.message.content), dict)
    out = client.chat.completions.create(extra_body={"structured_outputs": {"choice": ["yes", "no"]}}, **kw)
    assert out.choices[0].message.content in ("yes", "no")
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0,
                                    extra_body={"structured_outputs": {"regex": "[0-9]{3}"}})
    assert len(out.choices[0].text) == 3 and out.choices[0].text.isdigit()


@needs_grammar
def test_client_parse_returns_the_pydantic_object(client):
    from typing import Literal

    from pydantic import BaseModel

    class Verdict(BaseModel):
        ok: bool
        color: Literal["red", "green"]

    done = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": PROMPT}],
                                         response_format=Verdict, max_tokens=64, temperature=0)
    choice = done.choices[0]
    assert choice.finish_reason == "stop", choice
    assert isinstance(choice.message.parsed, Verdict)
    assert Verdict.model_validate_json(choice.message.content) == choice.message.parsed


@needs_grammar
@pytest.mark.parametrize("path,fields,param", [
    ("/v1/chat/completions", {"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ("/v1/completions", {"guided_regex": "[z-a]"}, "guided_regex"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}}}},
     "response_format"),
])
def test_http_constraint_the_grammar_refuses_names_the_field(server, path, fields, param):
    body = {"model": MODEL, "max_tokens": 4, **fields,
            **({"prompt": PROMPT} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]})}
    for stream in (False, True):
        status, raw, _ = http_request("POST", server + path, {**body, "stream": stream})
        if stream and status == 200:  # refused after the stream started: an in-band error, never a 5xx
            assert b'"error"' in raw and b'"code":400' in raw.replace(b" ", b""), raw
            continue
        assert status == 400, raw
        assert json.loads(raw)["error"]["param"] == param, raw


WEIRD = [
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/definitions/nope"}}}}}], "tool_choice": "required"},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "integer", "minimum": "x"}}}],
     "tool_choice": {"type": "function", "function": {"name": "f"}}},
    {"guided_grammar": "this is not a grammar"},
    {"structured_outputs": {"json": {"type": "object", "properties": {"a": {"type": "string", "format": "nope"}}}}},
    {"structured_outputs": {"regex": "a{99999}"}},
    {"structured_outputs": {"choice": ["", "a"]}},
    {"structured_outputs": {"json_object": False}},
    {"structured_outputs": {"choice": ["x"], "whitespace_pattern": "[ ]*"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "nope"}}}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {"anyOf": []}}}},
]


@needs_grammar
@pytest.mark.parametrize("fields", WEIRD)
def test_odd_constraints_never_get_a_5xx(server, fields):
    """Whatever the grammar backend makes of them: an answer or a 400, streaming or not."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 3, **fields}
    for stream in (False, True):
        status, raw, _ = http_request("POST", f"{server}/v1/chat/completions", {**body, "stream": stream})
        assert status in (200, 400), raw
        if status == 400:
            assert json.loads(raw)["error"]["param"], raw
        for line in raw.decode().splitlines():
            if line.startswith("data: {") and '"error"' in line:
                assert json.loads(line[6:])["error"]["code"] < 500, line
    status, raw, _ = http_request("GET", f"{server}/health")
    assert status == 200
