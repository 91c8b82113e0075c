"""What the server does with each field the official `openai` client can send to /v1/chat/completions
and /v1/completions: the one table the request models (protocol.py) and the tests read.

- HONOURED: it does what the OpenAI API says (some only for the values we can serve; the
  others get a 400 that says so).
- IGNORED: accepted and dropped, because dropping it changes no answer (stored-completion
  metadata, a service tier, a cache-routing key); the server logs one line per field name per
  process the first time a request sends it.
- REFUSED: a non-null value gets a 400 naming the field and why; null counts as not sent.

A field the table does not name and the request model does not declare gets a 400 naming it.
tests/server/test_openai_fields.py enumerates the installed client's fields, so a client version
that adds one fails until the field is classified here.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)

HONOURED, IGNORED, REFUSED = "honoured", "ignored", "refused"

Policy = tuple[str, str]  # (HONOURED | IGNORED | REFUSED, what the server does and why)

_SHARED: dict[str, Policy] = {
    "model": (HONOURED, "must be the served model's id (404 otherwise); may be omitted"),
    "n": (HONOURED, "samples per prompt, at most --max-n"),
    "temperature": (HONOURED, ""),
    "top_p": (HONOURED, ""),
    "seed": (HONOURED, "per-request sampling seed"),
    "stop": (HONOURED, ""),
    "presence_penalty": (HONOURED, ""),
    "frequency_penalty": (HONOURED, ""),
    "max_tokens": (HONOURED, ""),
    "stream": (HONOURED, ""),
    "stream_options": (HONOURED, "include_usage; vLLM's continuous_usage_stats"),
    "logprobs": (HONOURED, "at most --max-logprobs"),
    "user": (IGNORED, "an end-user id for the provider's abuse monitoring; this server keeps no per-user record"),
    "logit_bias": (REFUSED, "logit_bias is not supported yet"),
}

CHAT_FIELDS: dict[str, Policy] = {
    **_SHARED,
    "messages": (HONOURED, "text content only, through the model's chat template; tool calls and tool results "
                           "too"),
    "max_completion_tokens": (HONOURED, "wins over max_tokens"),
    "top_logprobs": (HONOURED, "needs logprobs: true"),
    "response_format": (HONOURED, "text, json_object or json_schema: the output is constrained to it "
                                  "(structured_fields.py)"),
    "modalities": (HONOURED, 'only ["text"], the default; this server has no audio output'),
    "metadata": (IGNORED, "tags for stored completions; nothing is stored here"),
    "store": (IGNORED, "stores the completion at the provider for evals or distillation; nothing is stored here"),
    "service_tier": (IGNORED, "a provider's processing tier; this server has one"),
    "parallel_tool_calls": (HONOURED, "false: at most one tool call (tools.py)"),
    "prompt_cache_key": (IGNORED, "a provider's cache-routing hint; prefix caching here is automatic "
                                  "(cache_salt keeps a tenant's cache apart)"),
    "prompt_cache_retention": (IGNORED, "how long a provider keeps a cached prefix; here the KV tiers decide"),
    "prompt_cache_options": (IGNORED, "a provider's prompt-cache settings; here the KV tiers decide"),
    "safety_identifier": (IGNORED, "an end-user id for the provider's abuse monitoring; this server keeps no "
                                   "per-user record"),
    "prediction": (HONOURED, "predicted output: with --speculative-config ngram, drafts come from it too "
                             "(usage counts accepted / rejected prediction tokens); otherwise checked and "
                             "dropped, since the answer is the same without it"),
    "tools": (HONOURED, "function tools, rendered by the chat template or kvserve's default format "
                        "(kvserve/chat_tools.py)"),
    "tool_choice": (HONOURED, "none, auto (needs --tool-call-parser), required, or a named function "
                              "(constrained to the call's JSON)"),
    "functions": (REFUSED, "function calling (deprecated form of tools) is not supported"),
    "function_call": (REFUSED, "function calling (deprecated form of tool_choice) is not supported"),
    "audio": (REFUSED, "audio output is not supported"),
    "reasoning_effort": (REFUSED, "reasoning_effort is not supported; a model's thinking switch, if its "
                                  "template has one, goes in chat_template_kwargs"),
    "verbosity": (REFUSED, "verbosity is not supported"),
    "web_search_options": (REFUSED, "web search is not supported"),
    "moderation": (REFUSED, "moderation is not supported"),
}

COMPLETION_FIELDS: dict[str, Policy] = {
    **_SHARED,
    "prompt": (HONOURED, "text, token ids, or a list of either"),
    "echo": (HONOURED, ""),
    "best_of": (HONOURED, "only equal to n (the same as omitting it); more candidates than returned are "
                          "not supported, as in vLLM's V1 engine"),
    "suffix": (REFUSED, "suffix (insertion) is not supported"),
}

STREAM_OPTIONS_FIELDS: dict[str, Policy] = {
    "include_usage": (HONOURED, "a last chunk with the request's usage"),
    "include_obfuscation": (IGNORED, "random padding of chunks against a network observer; chunks here are "
                                     "not padded"),
}

_logged: set[str] = set()


def note_ignored(name: str, why: str) -> None:
    """One log line per ignored field name per process, the first time a request sends it."""
    if name not in _logged:
        _logged.add(name)
        logger.warning("kvserve: request field %r accepted and ignored: %s (logged once)", name, why)
