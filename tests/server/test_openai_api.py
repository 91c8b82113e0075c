"""The OpenAI-compatible server, driven by the official `openai` client against a real
server process serving a tiny random llama."""

from __future__ import annotations

import json

import pytest

from tests.serving import LONG_PROMPT, MODEL, PROMPT, http_request

openai = pytest.importorskip("openai")


def _http(method: str, url: str, body: bytes | None = None) -> tuple[int, bytes]:
    return http_request(method, url, body)[:2]


def test_models_version_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert json.loads(_http("GET", f"{server}/version")[1])["version"]
    assert _http("GET", f"{server}/health")[0] == 200


def test_completion_greedy_and_usage(client, tokenizer):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.choices[0].text
    assert r.choices[0].finish_reason in ("length", "stop")
    n_prompt = len(tokenizer(PROMPT)["input_ids"])
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.total_tokens == n_prompt + r.usage.completion_tokens
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == 8
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_completion_stream_matches_non_stream(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0.8, seed=123)
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completion_token_ids_and_prompt_list(client, tokenizer):
    ids = tokenizer(PROMPT)["input_ids"]
    by_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    many = client.completions.create(model=MODEL, prompt=[PROMPT, "Prefix caching"], max_tokens=4, temperature=0)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0).choices[0].text


def test_n2_and_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, n=2, temperature=1.0, seed=7,
                                  logprobs=3)
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert len(c.logprobs.tokens) == len(c.logprobs.token_logprobs) == len(c.logprobs.top_logprobs)
        assert all(lp <= 0 for lp in c.logprobs.token_logprobs)
        assert all(1 <= len(t) <= 3 for t in c.logprobs.top_logprobs)
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)


def test_stop_string(client):
    base = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0).choices[0].text
    assert len(base) >= 3
    stop = base[2:4] if base[2:4].strip() else base[1:3]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop])
    assert stop not in r.choices[0].text
    assert base.startswith(r.choices[0].text)
    assert r.choices[0].finish_reason == "stop"


def test_chat_and_stream(client, tokenizer):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=8, temperature=0,
                                       logprobs=True, top_logprobs=2)
    assert r.choices[0].message.content
    n_prompt = len(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=True)
                   ["input_ids"])
    assert r.usage.prompt_tokens == n_prompt
    assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_cached_tokens_and_cache_salt(client, tokenizer):
    n_prompt = len(tokenizer(LONG_PROMPT)["input_ids"])
    assert n_prompt >= 40
    client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2, temperature=0)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached > 0 and cached % 16 == 0 and cached < n_prompt
    salted = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=2, temperature=0,
                                       extra_body={"cache_salt": "tenant-b"})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0


def test_errors(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body={"best_of_magic": 3})
    assert "best_of_magic" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=-1)
    assert "temperature" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=100_000)
    assert "max_model_len" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # over the server's --max-logprobs (20)
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       logprobs=True, top_logprobs=21)
    assert e.value.body["param"] == "top_logprobs" and "at most 20" in e.value.message
    status, raw = _http("POST", f"{server}/v1/completions", b"{not json")
    assert status == 400
    body = json.loads(raw)["error"]
    assert set(body) == {"message", "type", "param", "code"}
    assert _http("GET", f"{server}/health")[0] == 200
