"""The model's sampling defaults (--generation-config) in the server: a field the request omits
takes the model's value, one it sends wins. One server on a tiny model with a generation_config.json."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

from kvserve.engine.wire import ModelInfo
from kvserve.sampling_params import SamplingParams
from kvserve.server import protocol as P
from kvserve.server.serving import Serving
from tests.serving import MODEL, PROMPT, TINY_SERVER_ARGS, http_request, running_server

GENERATION_CONFIG = {"temperature": 0.0, "top_k": 5, "repetition_penalty": 1.3, "max_new_tokens": 12,
                     "do_sample": True, "bos_token_id": 1, "eos_token_id": 2}
DEFAULTS = {"temperature": 0.0, "top_k": 5, "repetition_penalty": 1.3, "max_tokens": 12}
MESSAGES = [{"role": "user", "content": PROMPT}]


def serving(defaults: dict, max_model_len: int = 64) -> Serving:
    info = ModelInfo(model=None, model_path="/tiny", max_model_len=max_model_len, vocab_size=320, block_size=16,
                     num_kv_blocks=64, eos_token_id=2, pid=0, generation_defaults=defaults)
    return Serving(SimpleNamespace(model_info=info), None, MODEL, None, 8)


def chat_params(s: Serving, longest: int = 10, **body) -> SamplingParams:
    req = P.ChatCompletionRequest(messages=MESSAGES, **body)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    return s.sampling_params(req, max_tokens, None, longest_prompt=longest)


def completion_params(s: Serving, **body) -> SamplingParams:
    req = P.CompletionRequest(prompt=PROMPT, **body)
    return s.sampling_params(req, req.max_tokens, None, longest_prompt=10)


# ---- resolved SamplingParams (no server) -------------------------------------------


def test_omitted_fields_take_the_model_defaults():
    s = serving(DEFAULTS)
    assert chat_params(s) == SamplingParams(**DEFAULTS)
    assert completion_params(s) == SamplingParams(**DEFAULTS)  # not OpenAI's 16: the client sent none
    # null counts as omitted, as in vLLM
    assert chat_params(s, temperature=None, max_tokens=None) == SamplingParams(**DEFAULTS)


def test_sent_fields_win():
    s = serving(DEFAULTS)
    p = chat_params(s, temperature=0.8, top_k=-1, max_completion_tokens=3)
    assert (p.temperature, p.top_k, p.repetition_penalty, p.max_tokens) == (0.8, -1, 1.3, 3)
    assert chat_params(s, max_tokens=30).max_tokens == 30
    p = completion_params(s, max_tokens=16, repetition_penalty=1.0)
    assert (p.temperature, p.max_tokens, p.repetition_penalty) == (0.0, 16, 1.0)


def test_default_max_tokens_fits_the_prompt():
    s = serving(DEFAULTS, max_model_len=64)
    assert chat_params(s, longest=60).max_tokens == 4
    assert chat_params(s, longest=60, max_tokens=12).max_tokens == 12  # sent: checked as it is, later


def test_no_defaults():
    s = serving({})
    assert chat_params(s) == SamplingParams(max_tokens=None)
    assert completion_params(s) == SamplingParams(max_tokens=16)


# ---- through a server --------------------------------------------------------------


@pytest.fixture(scope="module")
def gen_server(tiny_model_factory, tmp_path_factory):
    path = tmp_path_factory.mktemp("gen-config") / "model"
    shutil.copytree(tiny_model_factory("llama"), path)
    (path / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    with running_server([str(path), *TINY_SERVER_ARGS], path.parent / "server.log") as srv:
        yield srv


def post(base: str, path: str, body: dict) -> dict:
    status, raw, _ = http_request("POST", f"{base}{path}", body)
    assert status == 200, raw
    return json.loads(raw)


def test_server_applies_model_defaults(gen_server):
    base = gen_server.base
    omitted = post(base, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "ignore_eos": True})
    explicit = post(base, "/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "ignore_eos": True,
                                                    **{**DEFAULTS, "temperature": 0}})
    assert omitted["usage"]["completion_tokens"] == 12  # the model's max_new_tokens
    assert omitted["choices"][0]["message"]["content"] == explicit["choices"][0]["message"]["content"]
    # A completion that omits max_tokens gets the model's 12, not OpenAI's 16; one that sends it, its own.
    body = {"model": MODEL, "prompt": PROMPT, "ignore_eos": True}
    omitted = post(base, "/v1/completions", body)
    assert omitted["usage"]["completion_tokens"] == 12
    explicit = post(base, "/v1/completions", {**body, "temperature": 0, "max_tokens": 5})
    assert explicit["usage"]["completion_tokens"] == 5
    assert omitted["choices"][0]["text"].startswith(explicit["choices"][0]["text"])
    log = gen_server.log_text()
    assert "sampling defaults from the model's" in log and "temperature=0.0, top_k=5" in log
