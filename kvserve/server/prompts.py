"""How a request becomes prompt token ids: the one copy the server and the router share.

The router hashes a prompt's blocks to find the replica that caches them, so it must get
exactly the token ids the replica will compute; both call these functions with the same
tokenizer. They take plain JSON values (a chat body's messages as dicts, a completion
body's prompt), so the router can pass a raw body, and import neither torch nor FastAPI.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.chat_tools import ChatToolsError, conversation, template_takes_tools


class PromptError(ValueError):
    """The request cannot become a prompt; the server answers 400 with this message and param."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message, self.param = message, param


@dataclass(frozen=True)
class TextLimits:
    """Characters beyond which prompt text is refused before it is tokenized. No token stands for
    more characters than its vocabulary entry is long (byte-level and SentencePiece entries spell
    each byte or character at least once), so a prompt over `per_prompt` = max_model_len x the
    longest entry cannot fit in the context, and a request's prompts over `per_request` = the KV
    cache's tokens x the longest entry could not all be held at once. An oversized request costs
    nothing: neither the tokenizer's time nor its memory."""

    per_prompt: int
    per_request: int


def text_limits(tokenizer: Any, max_model_len: int, kv_capacity_tokens: int) -> TextLimits:
    longest = max(max((len(t) for t in tokenizer.get_vocab()), default=1), 1)
    return TextLimits(max_model_len * longest, max(kv_capacity_tokens, max_model_len) * longest)


def unpaired_surrogate(value: Any) -> str | None:
    """Where a JSON value holds a string with an unpaired surrogate ("\\ud800": valid in JSON and in
    a Python str, but not Unicode, so no tokenizer or UTF-8 encoder takes it): "" for the value
    itself, "[1]" or ".key" inside it; None if nowhere."""
    if type(value) is str:
        try:
            value.encode()
        except UnicodeEncodeError:
            return ""
        return None
    if type(value) is list:
        if set(map(type, value)) <= _NOT_TEXT:  # token ids: nothing to look at
            return None
        items: Any = enumerate(value)
    elif type(value) is dict:
        if any(unpaired_surrogate(k) is not None for k in value):
            return " (a key)"
        items = value.items()
    else:
        return None
    for k, v in items:
        where = unpaired_surrogate(v)
        if where is not None:
            return (f"[{k}]" if isinstance(k, int) else f".{k}") + where
    return None


_NOT_TEXT = frozenset({int, float, bool, type(None)})


def check_prompt_text(texts: list[str], names: list[str], limits: TextLimits | None, field: str) -> None:
    """The one check of prompt text before it is tokenized (completions, chat, /tokenize, the router):
    valid Unicode, and within `limits` each and together; errors name the prompt (`names`)."""
    for text, name in zip(texts, names):
        if limits is not None and len(text) > limits.per_prompt:
            raise PromptError(f"{name} is {len(text)} characters long; no text over {limits.per_prompt} characters "
                              "fits in the model's context (max-model-len tokens)", name)
    total = sum(map(len, texts))
    if limits is not None and total > limits.per_request:
        raise PromptError(f"the request's prompts are {total} characters together; over {limits.per_request} they "
                          "cannot fit in the KV cache at once: send fewer or shorter prompts per request", field)
    for text, name in zip(texts, names):
        if unpaired_surrogate(text) is not None:
            raise PromptError(f"{name} contains an unpaired surrogate; text must be valid Unicode", name)


def _message_text(content: Any) -> str:
    """A message's content as one string: text parts joined, the only kind of part we take."""
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise PromptError("only text content parts are supported", "messages")
        return "".join(p["text"] for p in content)
    if content is not None and not isinstance(content, str):
        raise PromptError("a message's content must be a string or a list of text parts", "messages")
    return content or ""


# Names apply_chat_template or its template renderer take for themselves: a template variable
# (chat_template_kwargs) by one of these names would change what is computed, not the template's input.
_RESERVED_TEMPLATE_VARS = frozenset({
    "messages", "conversation", "conversations", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens"})


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, Any]], limits: TextLimits | None = None, *,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    add_special_tokens: bool = False, chat_template_kwargs: dict[str, Any] | None = None,
                    as_text: bool = False, tools: list[dict[str, Any]] | None = None,
                    chat_template: str | None = None) -> Any:
    """Token ids of a chat: the model's chat template over the messages, with the generation
    prompt. Messages are dicts with "role" and "content" (str, text parts, or None), and an
    assistant's "tool_calls" or a tool message's "tool_call_id"; their text together is one prompt
    to `limits` (check_prompt_text).

    The defaults are what /v1/chat/completions computes (and the router hashes). /tokenize also
    takes vLLM's other options, with apply_chat_template's meaning: `continue_final_message`
    leaves the last message open for the model to go on with (instead of the generation prompt;
    not both), `add_special_tokens` has the tokenizer add its own (BOS...) to the rendered text,
    `chat_template_kwargs` are extra variables for the template (e.g. enable_thinking).
    `tools` (function tools as the OpenAI API sends them) are rendered by the template if it takes
    them, else in kvserve's default format (kvserve/chat_tools.py); `chat_template` replaces the
    model's (--chat-template). `as_text`: the rendered text instead of its tokens."""
    if add_generation_prompt and continue_final_message:
        raise PromptError("add_generation_prompt and continue_final_message cannot both be true: the first "
                          "starts a new assistant message, the second continues the last one", "continue_final_message")
    extra = dict(chat_template_kwargs or {})
    if reserved := sorted(_RESERVED_TEMPLATE_VARS.intersection(extra)):
        raise PromptError(f"chat_template_kwargs may not set {', '.join(reserved)}: only variables for the "
                          "template itself (add_generation_prompt and continue_final_message are fields of "
                          "the request)", "chat_template_kwargs")
    if continue_final_message:
        extra["continue_final_message"] = True
    msgs = _template_messages(messages)
    texts = [m["content"] for m in msgs]
    check_prompt_text(texts, [f"messages[{i}].content" for i in range(len(texts))], None, "messages")
    check_prompt_text(["".join(texts)], ["messages"], limits, "messages")
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise PromptError("the model has no chat template; use /v1/completions", "messages")
    native = template_takes_tools(template)
    try:
        msgs = conversation(msgs, tools, native)
    except ChatToolsError as e:
        raise PromptError(e.message, e.where) from None
    if tools and native:
        extra["tools"] = tools
    if chat_template is not None:
        extra["chat_template"] = chat_template
    return _apply_template(tokenizer, msgs, add_generation_prompt, add_special_tokens, as_text, extra)


def _template_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """The messages with their content as text, OpenAI's developer role as system (which templates
    know), and what tool calling adds (tool_calls, tool_call_id, a tool's name)."""
    msgs = []
    for m in messages:
        if not isinstance(m, dict):
            raise PromptError("each message must be an object with a role and a content", "messages")
        role = m.get("role")
        msg = {"role": "system" if role == "developer" else role, "content": _message_text(m.get("content"))}
        for key in ("tool_calls", "tool_call_id", "name"):
            if m.get(key) is not None:
                msg[key] = m[key]
        msgs.append(msg)
    return msgs


def _apply_template(tokenizer: Any, msgs: list[dict[str, Any]], add_generation_prompt: bool,
                    add_special_tokens: bool, as_text: bool, extra: dict[str, Any]) -> Any:
    try:
        if as_text:
            return tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, tokenize=False,
                                                 **extra)
        if add_special_tokens:  # vLLM: render the text, then tokenize it as a prompt is
            text = tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, tokenize=False,
                                                 **extra)
            return list(tokenizer(text, add_special_tokens=True)["input_ids"])
        out = tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, tokenize=True, **extra)
    except Exception as e:  # noqa: BLE001 - templates raise their own errors (e.g. role order)
        raise PromptError(f"the chat template rejected the messages: {e}", "messages") from None
    # Newer transformers return a BatchEncoding here, older ones a plain list.
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def completion_prompts(prompt: Any, limits: TextLimits | None = None) -> list[str | list[int]]:
    """The prompts of a completion request (a string, a list of strings, token ids, or a list of
    token id lists), each a text or token ids, their text checked (check_prompt_text)."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt, list) and _is_int(prompt[0])):
        prompt = [prompt]
    if not prompt:
        raise PromptError("prompt must not be empty", "prompt")
    if not isinstance(prompt, list) or not all(
            isinstance(p, str) or (isinstance(p, list) and all(map(_is_int, p))) for p in prompt):
        # The server's schema rejects these first; a router reading a raw body may meet them.
        raise PromptError("prompt must be a string, a list of strings, a list of token ids "
                          "or a list of lists of token ids", "prompt")
    texts = _named_texts(prompt)
    check_prompt_text([t for t, _ in texts], [n for _, n in texts], limits, "prompt")
    return [p if isinstance(p, str) else list(p) for p in prompt]


def _named_texts(prompts: list[Any]) -> list[tuple[str, str]]:
    """The text prompts of a completion's list of prompts, each with the name its errors give."""
    return [(p, "prompt" if len(prompts) == 1 else f"prompt[{i}]") for i, p in enumerate(prompts) if isinstance(p, str)]


def prompt_texts(kind: str, body: dict[str, Any]) -> list[tuple[str, str]] | None:
    """The prompt text of a raw request body ("chat" or "completion") as check_prompt_text sees it,
    each with the name its errors give: a chat's message contents joined ("messages"), each text
    prompt of a completion. For the router, which checks before it tokenizes; None when the prompt
    has another shape (the replica refuses that with its own error)."""
    if kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            return None
        try:
            return [("".join(_message_text(m.get("content")) for m in messages), "messages")]
        except PromptError:
            return None
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and not isinstance(prompt[0], (str, list))):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt or not all(isinstance(p, (str, list)) for p in prompt):
        return None
    return _named_texts(prompt)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def encode_prompt(tokenizer: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    """A completion prompt's token ids (the tokenizer's special tokens, e.g. BOS, unless told not to)."""
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def completion_prompt_ids(tokenizer: Any, prompt: Any,
                          limits: TextLimits | None = None) -> tuple[list[list[int]], list[str | None]]:
    """Token ids of each prompt of a completion request, and its text when given as text."""
    prompts = completion_prompts(prompt, limits)
    ids = [encode_prompt(tokenizer, p) if isinstance(p, str) else p for p in prompts]
    return ids, [p if isinstance(p, str) else None for p in prompts]
