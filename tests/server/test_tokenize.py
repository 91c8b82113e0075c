"""POST /tokenize and /detokenize (vLLM's routes) on the shared tiny server; the API key in-process."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kvserve.engine.wire import ModelInfo
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


PARTIAL = [*MESSAGES, {"role": "assistant", "content": "The fox"}]  # an answer begun, to continue


def reference_ids(tokenizer, messages: list[dict], add_special_tokens: bool = False, **options) -> list[int]:
    """transformers' own ids for the options (vLLM's /tokenize: the rendered text, tokenized with
    add_special_tokens when asked)."""
    options = {"add_generation_prompt": True, **options}
    if add_special_tokens:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **options)
        return list(tokenizer(text, add_special_tokens=True)["input_ids"])
    return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **options)["input_ids"])


@pytest.mark.parametrize("messages, options", [
    (MESSAGES, {"add_generation_prompt": False}),
    (PARTIAL, {"add_generation_prompt": False, "continue_final_message": True}),
    (MESSAGES, {"add_special_tokens": True}),
    (MESSAGES, {"add_generation_prompt": False, "add_special_tokens": True}),
    (MESSAGES, {"chat_template_kwargs": {"enable_thinking": False}}),
])
def test_tokenize_chat_options_give_transformers_ids(server, tokenizer, messages, options):
    status, body = post(server, "/tokenize", {"model": MODEL, "messages": messages, **options})
    assert status == 200, body
    ref_options = {k: v for k, v in options.items() if k != "chat_template_kwargs"}
    expected = reference_ids(tokenizer, messages, **ref_options, **options.get("chat_template_kwargs", {}))
    assert body["tokens"] == expected and body["count"] == len(expected)
    assert body["tokens"] == chat_prompt_ids(tokenizer, messages, **options)


def test_chat_options_change_the_ids_as_transformers_does(tokenizer):
    """Without a server, on a tokenizer whose options all make a difference: one that adds a BOS and
    a template that reads a variable (the tiny model's adds none and reads none)."""
    import copy

    tok = copy.deepcopy(tokenizer)
    tok.add_bos_token = True
    tok.chat_template = "{% if think %}<think>{% endif %}" + tok.chat_template
    default = chat_prompt_ids(tok, MESSAGES)
    assert default == reference_ids(tok, MESSAGES) == chat_prompt_ids(tokenizer, MESSAGES)  # no BOS, no think
    assert tok.decode(default).endswith("<|im_start|>assistant\n")
    cases = [({"add_generation_prompt": False}, MESSAGES, {"add_generation_prompt": False}),
             ({"add_generation_prompt": False, "continue_final_message": True}, PARTIAL,
              {"add_generation_prompt": False, "continue_final_message": True}),
             ({"add_special_tokens": True}, MESSAGES, {"add_special_tokens": True}),
             ({"chat_template_kwargs": {"think": True}}, MESSAGES, {"think": True})]
    seen = [default]
    for options, messages, ref in cases:
        ids = chat_prompt_ids(tok, messages, **options)
        assert ids == reference_ids(tok, messages, **ref), options
        seen.append(ids)
    assert len({tuple(ids) for ids in seen}) == len(seen)  # every option made a difference
    assert tok.decode(seen[1]).endswith("<|im_end|>\n") and tok.decode(seen[2]).endswith("The fox")
    assert seen[3] == [tok.bos_token_id, *default]
    assert tok.decode(seen[4]).startswith("<think>")


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
    ("/tokenize", {"messages": MESSAGES, "continue_final_message": True}, 400, "continue_final_message",
     "add_generation_prompt and continue_final_message cannot both be true"),
    ("/tokenize", {"messages": MESSAGES, "chat_template": "{{ messages }}"}, 400, "chat_template",
     "chat_template is not supported"),
    ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": {"tokenize": False, "messages": []}}, 400,
     "chat_template_kwargs", "chat_template_kwargs may not set messages, tokenize"),
    ("/tokenize", {"messages": MESSAGES, "chat_template_kwargs": ["x"]}, 400, "chat_template_kwargs",
     "Input should be a valid dictionary"),
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
