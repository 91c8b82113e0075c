"""Every field the installed `openai` client can send is honoured, ignored (logged once) or refused
with a reason (kvserve/server/openai_fields.py); GET /v1/models/{id}; per-chunk usage (vLLM's
continuous_usage_stats); vLLM's prompt extras; `kvserve tokenizer export`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvserve.server import openai_fields as F
from kvserve.server import protocol as P
from tests.serving import MODEL, PROMPT, http_request

openai = pytest.importorskip("openai")
from openai.types import completion_create_params as completion_params  # noqa: E402
from openai.types.chat import ChatCompletionStreamOptionsParam  # noqa: E402
from openai.types.chat import completion_create_params as chat_params  # noqa: E402

CHAT = ("/v1/chat/completions", P.ChatCompletionRequest, F.CHAT_FIELDS,
        {"messages": [{"role": "user", "content": PROMPT}]})
COMPLETION = ("/v1/completions", P.CompletionRequest, F.COMPLETION_FIELDS, {"prompt": PROMPT})
# A valid value for each ignored field (a new ignored field needs one here)
IGNORED_VALUES = {"user": "u-1", "metadata": {"k": "v"}, "store": True, "service_tier": "auto",
                  "parallel_tool_calls": False, "prompt_cache_key": "k", "prompt_cache_retention": "24h",
                  "prompt_cache_options": {"x": 1}, "safety_identifier": "s",
                  "prediction": {"type": "content", "content": "x"}}


def _client_fields(params_module) -> set[str]:
    """The keys the client's create() takes: the base TypedDict's and `stream`."""
    return set(params_module.CompletionCreateParamsBase.__annotations__) | {"stream"}


@pytest.mark.parametrize("params_module,endpoint", [(chat_params, CHAT), (completion_params, COMPLETION)],
                         ids=["chat", "completions"])
def test_every_client_field_is_classified(params_module, endpoint):
    _, model, table, _ = endpoint
    unclassified = _client_fields(params_module) - set(table)
    assert not unclassified, f"classify these openai-client fields in openai_fields.py: {sorted(unclassified)}"
    for name, (policy, why) in table.items():
        assert policy in (F.HONOURED, F.IGNORED, F.REFUSED), name
        assert name in model.model_fields, f"{name} is in the table but not a field of {model.__name__}"
        assert policy == F.HONOURED or why, f"{name}: an ignored or refused field needs its reason"
    schema = set(model.model_json_schema()["properties"])
    assert {n for n, (p, _) in table.items() if p == F.REFUSED}.isdisjoint(schema)
    opts = set(ChatCompletionStreamOptionsParam.__annotations__)
    assert opts <= set(F.STREAM_OPTIONS_FIELDS) <= set(P.StreamOptions.model_fields)


def _post(server: str, endpoint, **fields) -> tuple[int, dict]:
    import json

    path, _, _, base = endpoint
    status, body, headers = http_request("POST", server + path, {"model": MODEL, **base, "max_tokens": 2, **fields})
    return status, (json.loads(body) if headers["content-type"] == "application/json" else body)


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETION], ids=["chat", "completions"])
def test_refused_fields_say_why_and_unknown_ones_are_named(server, endpoint):
    _, _, table, _ = endpoint
    refused = {n: why for n, (p, why) in table.items() if p == F.REFUSED}
    assert refused
    for name, why in refused.items():
        status, body = _post(server, endpoint, **{name: [1]})
        assert status == 400, (name, body)
        assert body["error"]["param"] == name and why in body["error"]["message"], body
        assert _post(server, endpoint, **{name: None})[0] == 200, name  # null: not sent
    status, body = _post(server, endpoint, made_up_field=1)
    assert status == 400 and body["error"]["param"] == "made_up_field", body
    assert "unknown field 'made_up_field'" in body["error"]["message"]


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETION], ids=["chat", "completions"])
def test_ignored_fields_are_accepted_and_logged_once(tiny_server, endpoint):
    _, _, table, _ = endpoint
    ignored = {n for n, (p, _) in table.items() if p == F.IGNORED}
    assert ignored <= set(IGNORED_VALUES)
    fields = {n: IGNORED_VALUES[n] for n in ignored}
    opts = {"include_usage": True, "include_obfuscation": True}
    for _ in range(2):
        assert _post(tiny_server.base, endpoint, **fields)[0] == 200
        assert _post(tiny_server.base, endpoint, stream=True, stream_options=opts)[0] == 200
    log = tiny_server.log_text().splitlines()
    for name in [*ignored, "stream_options.include_obfuscation"]:
        lines = [line for line in log if f"request field {name!r} accepted and ignored" in line]
        assert len(lines) == 1, (name, lines)


def test_value_checked_fields(server):
    assert _post(server, CHAT, response_format={"type": "text"}, modalities=["text"])[0] == 200
    assert _post(server, CHAT, response_format={"type": "json_object"})[0] == 200  # constrained (issue 34)
    for fields, param in (({"response_format": {"type": "yaml"}}, "response_format.type"),
                          ({"modalities": ["text", "audio"]}, "modalities"),
                          ({"response_format": {"type": "json_schema", "json_schema": {}}},
                           "response_format.json_schema.name")):
        status, body = _post(server, CHAT, **fields)
        assert status == 400 and body["error"]["param"] == param, body
    assert _post(server, COMPLETION, best_of=2, n=2)[0] == 200
    status, body = _post(server, COMPLETION, best_of=3, n=1)
    assert status == 400 and body["error"]["param"] == "best_of" and "best_of=3" in body["error"]["message"]


def test_models_retrieve(client):
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    assert card.model_dump() == client.models.list().data[0].model_dump()
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such/model")
    assert "'no-such/model' does not exist" in str(e.value)


def _check_usage_per_chunk(chunks, content) -> None:
    """Each chunk with choices carries the usage so far; the last chunk the final usage."""
    final = chunks[-1].usage
    assert not chunks[-1].choices and final.completion_tokens == 8
    counts = []
    for c in chunks[:-1]:
        assert c.usage is not None and c.usage.prompt_tokens == final.prompt_tokens
        assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
        counts.append(c.usage.completion_tokens)
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == final.completion_tokens
    assert len(set(counts)) > 1  # it grows as tokens come
    assert all(content(c) is not None for c in chunks[:-1])


def test_continuous_usage_stats(client):
    opts = {"include_usage": True, "continuous_usage_stats": True}
    kw = dict(model=MODEL, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(messages=[{"role": "user", "content": PROMPT}], **kw)
    chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": PROMPT}], stream=True,
                                                 stream_options=opts, **kw))
    _check_usage_per_chunk(chunks, lambda c: c.choices[0].delta)
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    chunks = list(client.completions.create(prompt=PROMPT, stream=True, stream_options=opts, **kw))
    _check_usage_per_chunk(chunks, lambda c: c.choices[0].text)
    # include_usage alone: usage only at the end, as before
    chunks = list(client.completions.create(prompt=PROMPT, stream=True, stream_options={"include_usage": True}, **kw))
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].usage.completion_tokens == 8


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, tokenizer):
    ids = tokenizer(PROMPT)["input_ids"]
    kw = dict(model=MODEL, max_tokens=6, temperature=0)
    cut = client.completions.create(prompt=ids, extra_body={"truncate_prompt_tokens": 5}, echo=True, **kw)
    last = client.completions.create(prompt=ids[-5:], echo=True, **kw)
    assert cut.usage.prompt_tokens == 5 and cut.choices[0].text == last.choices[0].text
    chat = client.chat.completions.create(messages=[{"role": "user", "content": PROMPT}],
                                          extra_body={"truncate_prompt_tokens": 4}, **kw)
    assert chat.usage.prompt_tokens == 4
    with pytest.raises(openai.BadRequestError, match="truncate_prompt_tokens"):
        client.completions.create(prompt=ids, extra_body={"truncate_prompt_tokens": 0}, **kw)


def test_chat_template_options_and_priority(server, client):
    import json

    messages = [{"role": "user", "content": PROMPT}]
    for gen in (True, False):
        status, body, _ = http_request("POST", f"{server}/tokenize",
                                       {"messages": messages, "add_generation_prompt": gen})
        expected = json.loads(body)["count"]
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                           extra_body={"add_generation_prompt": gen, "priority": -1})
        assert r.usage.prompt_tokens == expected, gen


@pytest.mark.parametrize("which", ["llama", "default"])
def test_tokenizer_export_round_trip(which, tiny_model_factory, tmp_path):
    from transformers import AutoTokenizer

    from kvserve.models.loader import load_tokenizer

    model = str(tiny_model_factory("llama")) if which == "llama" else None
    out = tmp_path / "tok"
    cmd = [sys.executable, "-m", "kvserve.cli", "tokenizer", "export", str(out)] + (["--model", model] if model else [])
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    served, exported = load_tokenizer(model), AutoTokenizer.from_pretrained(str(out))
    for text in (PROMPT, "héllo wörld 你好 🙂", "  leading spaces\nand\ttabs", "12345 + 678 = ?"):
        assert exported(text)["input_ids"] == served(text)["input_ids"], text
    assert exported.chat_template == served.chat_template
    if served.chat_template:
        messages = [{"role": "user", "content": PROMPT}]
        assert (exported.apply_chat_template(messages, add_generation_prompt=True)
                == served.apply_chat_template(messages, add_generation_prompt=True))
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 2 and "not an empty directory" in again.stderr
