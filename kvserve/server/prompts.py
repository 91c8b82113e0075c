"""How a request becomes prompt token ids: the one copy the server and the router share.

The router hashes a prompt's blocks to find the replica that caches them, so it must get
exactly the token ids the replica will compute; both call these functions with the same
tokenizer. They take plain JSON values (a chat body's messages as dicts, a completion
body's prompt), so the router can pass a raw body, and import neither torch nor FastAPI.
"""

from __future__ import annotations

from typing import Any


class PromptError(ValueError):
    """The request cannot become a prompt; the server answers 400 with this message and param."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message, self.param = message, param


def max_prompt_chars(tokenizer: Any, max_model_len: int) -> int:
    """Characters beyond which a text cannot fit in `max_model_len` tokens: no token stands for
    more characters than its vocabulary entry is long (byte-level and SentencePiece entries spell
    each byte or character at least once). Checked before tokenizing, so an oversized prompt
    costs nothing."""
    longest = max((len(t) for t in tokenizer.get_vocab()), default=1)
    return max_model_len * max(longest, 1)


def check_prompt_chars(n: int, max_chars: int | None, param: str) -> None:
    if max_chars is not None and n > max_chars:
        raise PromptError(f"{param} is {n} characters long; no text over {max_chars} characters fits in the "
                          "model's context (max-model-len tokens)", param)


def _message_text(content: Any) -> str:
    """A message's content as one string: text parts joined, the only kind of part we take."""
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise PromptError("only text content parts are supported", "messages")
        return "".join(p["text"] for p in content)
    return content or ""


# Names apply_chat_template or its template renderer take for themselves: a template variable
# (chat_template_kwargs) by one of these names would change what is computed, not the template's input.
_RESERVED_TEMPLATE_VARS = frozenset({
    "messages", "conversation", "conversations", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "sanitize_control_tokens"})


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, Any]], max_chars: int | None = None, *,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    add_special_tokens: bool = False,
                    chat_template_kwargs: dict[str, Any] | None = None, as_text: bool = False) -> Any:
    """Token ids of a chat: the model's chat template over the messages, with the generation
    prompt. Messages are dicts with "role" and "content" (str, text parts, or None); their
    text together may have at most `max_chars` characters (max_prompt_chars).

    The defaults are what /v1/chat/completions computes (and the router hashes). /tokenize also
    takes vLLM's other options, with apply_chat_template's meaning: `continue_final_message`
    leaves the last message open for the model to go on with (instead of the generation prompt;
    not both), `add_special_tokens` has the tokenizer add its own (BOS...) to the rendered text,
    `chat_template_kwargs` are extra variables for the template (e.g. enable_thinking).
    `as_text`: the rendered text instead of its tokens."""
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
    msgs = []
    for m in messages:
        if not isinstance(m, dict):
            raise PromptError("each message must be an object with a role and a content", "messages")
        role = m.get("role")
        # OpenAI's "developer" role is the system prompt under another name; templates know "system".
        msgs.append({"role": "system" if role == "developer" else role, "content": _message_text(m.get("content"))})
    check_prompt_chars(sum(len(m["content"]) for m in msgs), max_chars, "messages")
    if not getattr(tokenizer, "chat_template", None):
        raise PromptError("the model has no chat template; use /v1/completions", "messages")
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


def completion_prompt_ids(tokenizer: Any, prompt: Any,
                          max_chars: int | None = None) -> tuple[list[list[int]], list[str | None]]:
    """Token ids of each prompt of a completion request (a string, a list of strings, token
    ids, or a list of token id lists), and each prompt's text when it was given as text; a
    text may have at most `max_chars` characters (max_prompt_chars)."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt, list) and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise PromptError("prompt must not be empty", "prompt")
    if not isinstance(prompt, list) or not all(
            isinstance(p, str) or (isinstance(p, list) and all(isinstance(t, int) for t in p)) for p in prompt):
        # The server's schema rejects these first; a router reading a raw body may meet them.
        raise PromptError("prompt must be a string, a list of strings, a list of token ids "
                          "or a list of lists of token ids", "prompt")
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            check_prompt_chars(len(p), max_chars, "prompt" if len(prompt) == 1 else f"prompt[{i}]")
    ids = [list(tokenizer(p)["input_ids"]) if isinstance(p, str) else list(p) for p in prompt]
    return ids, [p if isinstance(p, str) else None for p in prompt]
