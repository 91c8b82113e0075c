"""POST /tokenize and /detokenize (vLLM's routes) on the shared tiny server; the API key in-process."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kvserve.engine.engine_proc import ModelInfo
from kvserve.server.prompts import chat_prompt_ids
from tests.serving import MODEL, PROMPT, http_request

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]


def post(base: str, path: str, body: dict | list, headers: dict | None = None) -> tuple[int, dict]:
    status, raw, _ = http_request("POST", f"{base}{path}", json.dumps(body).encode(), headers)
    return status, json.loads(raw)


def max_model_len(base: str) -> int:
    status, raw, _ = http_request("GET", f"{base}/v1/models")
    return json.loads(raw)["data"][0]["max_model_len"]


def test_tokenize_prompt(server, tokenizer):
    expected = list(tokenizer(PROMPT)["input_ids"])
    status, body = post(server, "/tokenize", {"model": MODEL, "prompt": PROMPT})
    assert status == 200, body
    assert body == {"count": len(expected), "max_model_len": max_model_len(server), "tokens": expected,
                    "token_strs": None}
    status, body = post(server, "/tokenize", {"prompt": PROMPT, "return_token_strs": True,
                                               "add_special_tokens": False})
    assert status == 200, body
    assert body["tokens"] == list(tokenizer(PROMPT, add_special_tokens=False)["input_ids"])
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(body["tokens"])
    # The count is what /v1/completions bills for the same prompt.
    status, done = post(server, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 1})
    assert done["usage"]["prompt_tokens"] == len(expected)


def test_tokenize_chat_gives_the_chat_endpoints_ids(server, tokenizer):
    status, body = post(server, "/tokenize", {"model": MODEL, "messages": MESSAGES, "return_token_strs": True})
    assert status == 200, body
    toks = body["tokens"]
    assert toks == chat_prompt_ids(tokenizer, MESSAGES) and body["count"] == len(toks)
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(toks)
    # The same ids through /v1/completions continue exactly as the chat does.
    greedy = {"model": MODEL, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    _, chat = post(server, "/v1/chat/completions", {**greedy, "messages": MESSAGES})
    _, completion = post(server, "/v1/completions", {**greedy, "prompt": toks})
    assert chat["usage"]["prompt_tokens"] == len(toks)
    assert chat["choices"][0]["message"]["content"] == completion["choices"][0]["text"]


def test_detokenize_round_trip(server, tokenizer):
    toks = list(tokenizer(PROMPT)["input_ids"])
    status, body = post(server, "/detokenize", {"model": MODEL, "tokens": toks})
    assert status == 200 and body == {"prompt": PROMPT}
    assert post(server, "/detokenize", {"tokens": []}) == (200, {"prompt": ""})


@pytest.mark.parametrize("path, body, status, param, message", [
    ("/detokenize", {"tokens": [5, 10**6]}, 400, "tokens", "token id 1000000 is outside the vocabulary [0, 320)"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens", "token id -1 is outside the vocabulary"),
    ("/detokenize", {"tokens": ["a"]}, 400, "tokens.0", "tokens.0: Input should be a valid integer"),
    ("/detokenize", {}, 400, "tokens", "tokens: Field required"),
    ("/detokenize", {"tokens": [1], "model": "other"}, 404, "model", "the model 'other' does not exist"),
    ("/tokenize", {}, 400, "prompt", "prompt: Field required"),
    ("/tokenize", {"prompt": ["a"]}, 400, "prompt", "prompt: Input should be a valid string"),
    ("/tokenize", {"prompt": "a", "suffix": "b"}, 400, "suffix", "unknown field 'suffix'"),
    ("/tokenize", {"prompt": "a", "model": "other"}, 404, "model", "the model 'other' does not exist"),
    ("/tokenize", {"messages": []}, 400, "messages", "messages: List should have at least 1 item"),
    ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages.0.role", "messages.0.role"),
    ("/tokenize", {"messages": MESSAGES, "prompt": "a"}, 400, "prompt", "unknown field 'prompt'"),
    ("/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}, 400, "add_generation_prompt",
     "add_generation_prompt=false is not supported"),
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, 400, "continue_final_message",
     "continue_final_message=true is not supported"),
    ("/tokenize", {"messages": MESSAGES, "add_special_tokens": True}, 400, "add_special_tokens",
     "add_special_tokens=true is not supported"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400,
     "messages", "only text content parts are supported"),
    ("/tokenize", ["not", "an", "object"], 400, None, "Input should be a valid dictionary"),
])
def test_errors_in_openai_shape(server, path, body, status, param, message):
    got, err = post(server, path, body)
    assert got == status, err
    assert set(err) == {"error"} and err["error"]["code"] == status
    assert err["error"]["param"] == param or (param is None and err["error"]["param"] in (None, "body"))
    assert message in err["error"]["message"]


def test_malformed_json(server):
    status, raw, _ = http_request("POST", f"{server}/tokenize", b"{oops")
    assert status == 400 and "malformed JSON body" in json.loads(raw)["error"]["message"]


def test_api_key_guards_both_routes(tokenizer):
    """In-process app over a stand-in engine: the routes only tokenize, they never reach it."""
    from fastapi.testclient import TestClient

    from kvserve.server.openai_api import build_app

    info = ModelInfo(model=None, model_path="/tiny", max_model_len=512, vocab_size=320, block_size=16,
                     num_kv_blocks=64, eos_token_id=2, pid=0)
    app = build_app(SimpleNamespace(model_info=info, is_alive=lambda: True), tokenizer, MODEL, api_key="sk-k")
    with TestClient(app) as c:
        for path, body in (("/tokenize", {"prompt": PROMPT}), ("/detokenize", {"tokens": [5, 6]})):
            r = c.post(path, json=body)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            assert c.post(path, json=body, headers={"authorization": "Bearer wrong"}).status_code == 401
            assert c.post(path, json=body, headers={"authorization": "Bearer sk-k"}).status_code == 200
