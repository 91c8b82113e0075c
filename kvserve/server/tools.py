"""Tool calling and reasoning output of /v1/chat/completions: what a request's tools and
tool_choice ask for (plan_tools), and what each choice's text becomes (ChoiceOutput).

tool_choice (default "auto" when tools are sent, as in the OpenAI API):
- "none": the tools are rendered, nothing is read back; the answer is text.
- "auto": the model decides; its calls are read by the server's --tool-call-parser. A server
  started without one answers 400 (as vLLM does); --enable-auto-tool-choice is accepted and not
  needed.
- "required": the output is constrained (StructuredOutputsParams(json=...)) to a JSON array of at
  least one {"name": <one of the tools>, "parameters": <that tool's parameters>} (anyOf, as vLLM
  builds it; at most one with parallel_tool_calls false), which becomes tool_calls
  (required_calls.py).
- a named function: the output is constrained to that function's parameters schema and is its
  arguments.
A stream sends a call's index, id and name first, then its arguments: as they are generated under
"required" and a named function (the grammar vouches for them), and in one piece under "auto" once
the parser has the whole call (tool_parsers/base.py says why).
A response with calls has finish_reason "tool_calls" (unless it ran out of max_tokens: "length")
and content null when there is no other text. parallel_tool_calls false keeps the first call.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.sampling_params import StructuredOutputsParams
from kvserve.server import protocol as P
from kvserve.server.reasoning_parsers import REASONING_PARSERS, ReasoningStream
from kvserve.server.required_calls import RequiredCalls
from kvserve.server.serving import APIError, ChatSettings
from kvserve.server.structured_fields import check_schema, make_params
from kvserve.server.tool_parsers import TOOL_PARSERS, ToolCall, ToolCallStream


@dataclass
class ToolPlan:
    mode: str = "none"  # none | auto | required | named
    tools: list[dict[str, Any]] | None = None  # as the template gets them
    name: str | None = None  # the named function
    parallel: bool = True
    constraint: StructuredOutputsParams | None = None


def _parameters(tool: P.ChatTool, i: int) -> dict[str, Any]:
    params = tool.function.parameters
    if params is None:
        return {"type": "object", "properties": {}}
    return check_schema(params, f"tools[{i}].function.parameters")


def required_schema(tools: list[P.ChatTool], parallel: bool) -> dict[str, Any]:
    """The JSON schema of tool_choice "required": an array of calls of the given tools."""
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                               "parameters": _parameters(t, i)},
              "required": ["name", "parameters"]} for i, t in enumerate(tools)]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def plan_tools(req: P.ChatCompletionRequest, settings: ChatSettings) -> ToolPlan:
    """What the request's tools, tool_choice and parallel_tool_calls ask for; 400s name the field."""
    tools, choice = req.tools, req.tool_choice
    if not tools:
        if choice is not None and choice != "none":
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return ToolPlan()
    names = [t.function.name for t in tools]
    if dup := next((n for n in names if names.count(n) > 1), None):
        raise APIError(400, f"tools has two functions named {dup!r}", param="tools")
    for i, t in enumerate(tools):
        _parameters(t, i)
    rendered = [t.model_dump(exclude_none=True, by_alias=True) for t in tools]
    parallel = req.parallel_tool_calls is not False
    plan = ToolPlan(mode=choice if isinstance(choice, str) else "auto", tools=rendered, parallel=parallel)
    if isinstance(choice, P.NamedToolChoice):
        if choice.function.name not in names:
            raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools "
                           f"({', '.join(names)})", param="tool_choice")
        plan.mode, plan.name = "named", choice.function.name
        i = names.index(plan.name)
        plan.constraint = make_params({"json": _parameters(tools[i], i)}, "tool_choice")
    elif plan.mode == "required":
        plan.constraint = make_params({"json": required_schema(tools, parallel)}, "tool_choice")
    elif plan.mode == "auto" and settings.tool_call_parser is None:
        raise APIError(400, f'tool_choice "auto" needs a server started with --tool-call-parser '
                       f'({"|".join(sorted(TOOL_PARSERS))}); "required" and a named function work without one',
                       param="tool_choice")
    return plan


@dataclass
class Parts:
    """What a choice's text (or a piece of it) becomes."""

    reasoning: str = ""
    content: str = ""
    calls: list[P.DeltaToolCall] = field(default_factory=list)


class ChoiceOutput:
    """One choice's text, split into reasoning (--reasoning-parser), content and tool calls. The
    stream feeds deltas; a whole answer is one feed with final=True (whole()), so both agree."""

    def __init__(self, plan: ToolPlan, settings: ChatSettings, thinking: bool = True) -> None:
        rp = settings.reasoning_parser if thinking else None
        self.reasoning = ReasoningStream(REASONING_PARSERS[rp]()) if rp else None
        auto = plan.mode == "auto"
        self.tools = ToolCallStream(TOOL_PARSERS[settings.tool_call_parser or ""]()) if auto else None
        self.required = RequiredCalls() if plan.mode == "required" else None
        self.named = plan.name if plan.mode == "named" else None
        self.max_calls = None if plan.parallel else 1
        self.calls: list[ToolCall] = []
        self.sent: list[int] = []  # characters of each call's arguments sent

    @property
    def plain(self) -> bool:
        """The text is all content: no reasoning parser, no tool calls to read."""
        return self.reasoning is None and self.tools is None and self.required is None and self.named is None

    def feed(self, delta: str, final: bool = False) -> Parts:
        out = Parts()
        if self.reasoning is not None:
            out.reasoning, content = self.reasoning.feed(delta, final)
        else:
            content = delta
        if self.named is not None:
            if not self.calls:
                self.calls.append(ToolCall(self.named, ""))
            self.calls[0].arguments += content
            out.calls = self._call_deltas()
        elif self.required is not None:
            self.required.feed(content)
            for c in self.required.calls[len(self.calls):self.max_calls]:
                self.calls.append(c.call)
            out.calls = self._call_deltas()
            # at the end, text that holds no call is content whole (one cut off before its arguments)
            rest = (self.required.content() if self.calls else self.required.text) if final else ""
            out.content = rest if rest.strip() or not self.calls else ""
        elif self.tools is not None:
            out.content, new = self.tools.feed(content, final)
            self.calls += new[:None if self.max_calls is None else max(self.max_calls - len(self.calls), 0)]
            out.calls = self._call_deltas()
        else:
            out.content = content
        return out

    def _call_deltas(self) -> list[P.DeltaToolCall]:
        """Each new call's first part (id, name), then what its arguments gained."""
        out = []
        for i, call in enumerate(self.calls):
            if i == len(self.sent):
                self.sent.append(0)
                out.append(P.DeltaToolCall(index=i, id=call.id, type="function",
                                           function=P.DeltaFunctionCall(name=call.name, arguments="")))
            if len(call.arguments) > self.sent[i]:
                out.append(P.DeltaToolCall(index=i, function=P.DeltaFunctionCall(
                    arguments=call.arguments[self.sent[i]:])))
                self.sent[i] = len(call.arguments)
        return out

    def whole(self, text: str) -> P.ChatResponseMessage:
        parts = self.feed(text, final=True)
        content: str | None = parts.content
        found = self.reasoning is not None and self.reasoning.found
        if (self.calls and not parts.content.strip()) or (found and not parts.content):
            content = None
        calls = [P.ResponseToolCall(id=c.id, function=P.ResponseFunctionCall(name=c.name, arguments=c.arguments))
                 for c in self.calls]
        return P.ChatResponseMessage(content=content, reasoning_content=parts.reasoning if found else None,
                                     tool_calls=calls or None)

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.calls else reason


def thinking_on(kwargs: dict[str, Any] | None) -> bool:
    """False when chat_template_kwargs switch thinking off (Qwen3's enable_thinking, or thinking)."""
    kwargs = kwargs or {}
    return not any(kwargs.get(k) is False for k in ("enable_thinking", "thinking"))

