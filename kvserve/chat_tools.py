"""How a chat with tools becomes a chat template's input: one copy for the server (server/prompts.py)
and the offline `LLM.chat`, so both render the same prompt. No torch and nothing else of kvserve.

A template that takes `tools` (its source uses the variable, as Qwen2.5's, Qwen3's, Llama 3.1's and
Mistral's do) gets them as transformers' apply_chat_template passes them: `tools=[...]`, assistant
messages with their `tool_calls` (each call's arguments as an object, not a JSON string) and `tool`
messages with their `tool_call_id`.

A template without (SmolLM2-135M-Instruct's, the default model's; any plain ChatML one) gets kvserve's
default format, the Hermes format as Qwen2.5 writes it, which the `hermes` tool-call parser reads back:

- the tool list goes at the end of the first system message (a system message is added first when
  there is none): TOOLS_PROMPT, each tool one JSON line between <tools> and </tools>;
- an assistant message's tool calls are appended to its content, each as
  "<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>";
- a `tool` message becomes a user message "<tool_response>\\n{content}\\n</tool_response>" (the
  results of consecutive tool messages in one user message, as Qwen's template does).

That this happened is logged once per process.
"""

from __future__ import annotations

import json
import logging
from typing import Any

logger = logging.getLogger(__name__)

TOOLS_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>')

_logged: list[bool] = []


class ChatToolsError(ValueError):
    """A message or tool that cannot be rendered; `where` names it (e.g. messages[2].tool_calls[0])."""

    def __init__(self, message: str, where: str) -> None:
        super().__init__(f"{where}: {message}")
        self.message, self.where = message, where


def template_takes_tools(template: Any) -> bool:
    """Whether a chat template's source uses the `tools` variable (jinja2's own analysis)."""
    if not isinstance(template, str):
        return False
    import jinja2
    from jinja2 import meta

    try:
        return "tools" in meta.find_undeclared_variables(jinja2.Environment().parse(template))
    except jinja2.TemplateSyntaxError:
        return "tools" in template


def _arguments(call: dict[str, Any], where: str) -> tuple[str, dict[str, Any]]:
    """A tool call's function name and its arguments as an object."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ChatToolsError("a tool call needs a function with a name", where)
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise ChatToolsError("function.arguments must be a JSON object (as text)", where) from None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise ChatToolsError("function.arguments must be a JSON object", where)
    return fn["name"], args


def _with_tool_calls(msg: dict[str, Any], calls: list[Any], i: int, native: bool) -> dict[str, Any]:
    """An assistant message with its tool calls, as the template takes them (native) or as text."""
    if not isinstance(calls, list):
        raise ChatToolsError("tool_calls must be a list", f"messages[{i}].tool_calls")
    parsed = [_arguments(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(calls)]
    if native:
        msg["tool_calls"] = [{"id": c.get("id"), "type": "function", "function": {"name": n, "arguments": a}}
                             for c, (n, a) in zip(calls, parsed)]
        return msg
    text = "\n".join("<tool_call>\n" + json.dumps({"name": n, "arguments": a}, ensure_ascii=False) + "\n</tool_call>"
                     for n, a in parsed)
    msg["content"] = f"{msg['content']}\n{text}" if msg["content"] else text
    return msg


def conversation(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                 native: bool) -> list[dict[str, Any]]:
    """The messages as the template gets them. `messages` have role and content as text already
    (developer mapped to system), and may carry `tool_calls` (assistant) or `tool_call_id` (tool);
    `native`: the template takes tools itself (template_takes_tools)."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role, content = m["role"], m["content"]
        msg: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant" and m.get("tool_calls"):
            out.append(_with_tool_calls(msg, m["tool_calls"], i, native))
        elif role == "tool" and native:
            out.append({**msg, "tool_call_id": m.get("tool_call_id"), **({"name": m["name"]} if m.get("name") else {})})
        elif role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append(msg)
    for m in out:
        m.pop("_tool_results", None)
    if tools and not native:
        out = _tools_in_system(out, tools)
    return out


def _tools_in_system(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    text = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
    if not _logged:
        _logged.append(True)
        logger.warning("kvserve: the chat template does not render tools; the tool list goes into the system "
                       "message in kvserve's default (Hermes) format (README: Tools) (logged once)")
    if messages and messages[0]["role"] == "system":
        first = messages[0]["content"]
        return [{**messages[0], "content": f"{first}\n\n{text}" if first else text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]
