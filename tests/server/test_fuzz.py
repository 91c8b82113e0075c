"""Property-based fuzzing of the HTTP API: random bodies never produce a 5xx, and the server
stays up and keeps answering correctly afterwards."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.serving import MODEL, PROMPT, http_request, metric_values

FIELDS = ["model", "prompt", "messages", "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
          "max_tokens", "max_completion_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty",
          "logprobs", "top_logprobs", "echo", "suffix", "user", "stream", "stream_options", "cache_salt",
          "ignore_eos", "min_tokens", "best_of", "tools"]

json_scalar = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.integers(-3, 600),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20), st.just(MODEL))
json_value = st.recursive(json_scalar, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=10)
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "developer", "tool", 3]),
                                 "content": st.one_of(st.text(max_size=30), json_value)})
prompt = st.one_of(st.text(max_size=40), st.lists(st.integers(-5, 400), max_size=12),
                   st.lists(st.text(max_size=10), max_size=3), st.lists(st.lists(st.integers(0, 299), max_size=5),
                                                                       max_size=3), json_value)
# A valid request, then up to two fields overwritten with random JSON: most bodies get
# past the schema into SamplingParams, the prompt checks and the engine itself.
sampling = {
    "n": st.integers(1, 3), "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "min_p": st.floats(0, 1),
    "top_k": st.sampled_from([-1, 1, 5, 50]), "seed": st.integers(0, 2**63 - 1),
    "stop": st.one_of(st.text(min_size=1, max_size=4), st.lists(st.text(min_size=1, max_size=4), max_size=3)),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}), "user": st.text(max_size=8),
    "cache_salt": st.text(max_size=8), "ignore_eos": st.booleans(), "min_tokens": st.integers(0, 3)}
valid_prompt = st.one_of(st.text(min_size=1, max_size=40), st.lists(st.integers(0, 299), min_size=1, max_size=12))
completion_body = st.fixed_dictionaries(
    {"model": st.just(MODEL), "prompt": valid_prompt, "max_tokens": st.integers(1, 12)},
    optional={**sampling, "logprobs": st.integers(0, 5), "echo": st.booleans()})
chat_body = st.fixed_dictionaries(
    {"model": st.just(MODEL), "messages": st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=30)}),
        min_size=1, max_size=3), "max_completion_tokens": st.integers(1, 12)},
    optional={**sampling, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5)})
mutations = st.dictionaries(st.sampled_from(FIELDS + ["prompt", "messages"]), json_value, max_size=2)
request = st.one_of(st.tuples(st.just("/v1/completions"), completion_body, mutations, prompt),
                    st.tuples(st.just("/v1/chat/completions"), chat_body, mutations, st.lists(message, max_size=3)))


def _post(server: str, path: str, raw: bytes) -> int:
    status, data, _ = http_request("POST", f"{server}{path}", raw, timeout=120)
    if status == 200 and b"data: " in data:  # a stream: an in-band error must not be a 5xx either
        for line in data.decode().splitlines():
            if line.startswith("data: {") and '"error"' in line:
                assert json.loads(line[6:])["error"]["code"] < 500, line
    return status


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=request, swap_prompt=st.integers(0, 3))
def test_random_bodies_never_5xx(server, case, swap_prompt):
    path, payload, mutated, odd_prompt = case
    payload = {**payload, **mutated}
    if swap_prompt == 0:  # odd prompts and message lists: wrong types, special ids, empty, nested
        payload["prompt" if path == "/v1/completions" else "messages"] = odd_prompt
    raw = json.dumps(payload).encode()  # NaN / Infinity go out as JSON extensions, as a sloppy client sends
    status = _post(server, path, raw)
    assert status < 500, (path, payload)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(path=st.sampled_from(["/v1/completions", "/v1/chat/completions", "/v1/models", "/nope"]),
       raw=st.one_of(st.binary(max_size=64), st.text(max_size=64).map(str.encode)))
def test_random_bytes_never_5xx(server, path, raw):
    assert _post(server, path, raw) < 500


def test_server_healthy_after_fuzz(server, client):
    # Runs after the fuzz cases in this module: the engine survived and still answers correctly.
    assert http_request("GET", f"{server}/health")[0] == 200
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 4
    assert metric_values(server)["kvserve:kv_cache_usage_perc"] == 0
