"""POST /v1/embeddings on a real server (tiny llama, --pooling last): the official client in both
encodings, every input shape, HF parity, usage, errors naming the field, no KV left in use."""

from __future__ import annotations

import base64
import json
import struct

import pytest
import torch

from tests.serving import LONG_PROMPT, MODEL, PROMPT, http_request

HF_ATOL = 1e-4  # float32 rounding between our forward and HF's
SAME_ATOL = 1e-5


def post(base: str, body: dict) -> tuple[int, dict]:
    status, raw, _ = http_request("POST", f"{base}/v1/embeddings", json.dumps(body).encode())
    return status, json.loads(raw)


def kv_blocks_used(base: str) -> int:
    status, raw, _ = http_request("GET", f"{base}/kv_cache/stats")
    assert status == 200
    return json.loads(raw)["kv_blocks_used"]


def test_openai_client_float_and_base64(client, tokenizer, tiny_model_factory):
    from transformers import AutoModelForCausalLM

    floats = client.embeddings.create(model=MODEL, input=[PROMPT, LONG_PROMPT])
    assert floats.object == "list" and floats.model == MODEL
    assert [d.index for d in floats.data] == [0, 1] and all(d.object == "embedding" for d in floats.data)
    ids = [list(tokenizer(t)["input_ids"]) for t in (PROMPT, LONG_PROMPT)]
    n = sum(map(len, ids))
    assert floats.usage.prompt_tokens == n and floats.usage.total_tokens == n
    # Without encoding_format the client asks for base64 and decodes it; asked for base64, it hands
    # the strings over: decode those here, and compare both with the plain float answer.
    b64 = client.embeddings.create(model=MODEL, input=[PROMPT, LONG_PROMPT], encoding_format="base64")
    decoded = [struct.unpack(f"<{len(raw) // 4}f", raw) for raw in (base64.b64decode(d.embedding) for d in b64.data)]
    status, plain = post(client.base_url.scheme + "://" + client.base_url.netloc.decode(),
                         {"input": [PROMPT, LONG_PROMPT], "encoding_format": "float"})
    assert status == 200, plain
    got = torch.tensor([d["embedding"] for d in plain["data"]])
    torch.testing.assert_close(torch.tensor(decoded), got, atol=1e-7, rtol=0)
    torch.testing.assert_close(torch.tensor([d.embedding for d in floats.data]), got, atol=1e-7, rtol=0)
    # LAST pooling of HF's final hidden states, L2-normalized
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_factory("llama")), dtype=torch.float32).eval()
    with torch.no_grad():
        last = torch.stack([model.model(torch.tensor([p])).last_hidden_state[0, -1] for p in ids])
    torch.testing.assert_close(got, torch.nn.functional.normalize(last, dim=-1), atol=HF_ATOL, rtol=0)


def test_token_ids_alone_and_in_a_batch(server, tokenizer):
    ids = list(tokenizer(PROMPT)["input_ids"])
    status, text = post(server, {"input": PROMPT})
    assert status == 200, text
    vec = torch.tensor(text["data"][0]["embedding"])
    for body in ({"input": ids}, {"input": [ids, [5, 6, 7]]}, {"input": [[9, 10] * 40, ids]}):
        status, out = post(server, body)
        assert status == 200, out
        mine = next(d for d in out["data"] if d["index"] == (1 if body["input"][0] == [9, 10] * 40 else 0))
        torch.testing.assert_close(torch.tensor(mine["embedding"]), vec, atol=SAME_ATOL, rtol=0)
        assert len(out["data"]) == (1 if isinstance(body["input"][0], int) else 2)
    status, out = post(server, {"input": [ids, [5, 6, 7]]})
    assert out["usage"] == {"prompt_tokens": len(ids) + 3, "total_tokens": len(ids) + 3}
    assert kv_blocks_used(server) == 0


@pytest.mark.parametrize("body, param, words", [
    ({"input": "x", "dimensions": 8}, "dimensions", "dimensions is not supported"),
    ({"input": ""}, "input", "must not be empty"),
    ({"input": []}, "input", "must not be empty"),
    ({"input": [[5], []]}, "input[1]", "must not be empty"),
    ({"input": [[1, 2], [3, 10**6]]}, "input[1]", "outside the vocabulary"),
    ({"input": [7] * 5000}, "input", "max_model_len"),
    ({"input": "x", "encoding_format": "float16"}, "encoding_format", "float"),
    ({"input": [1.5]}, "input", "must be a string"),
    ({"input": "x", "normalize": False}, "normalize", "unknown field"),
    ({"input": "x", "model": "other"}, "model", "does not exist"),
])
def test_bad_requests_name_the_field(server, body, param, words):
    status, out = post(server, body)
    assert status == (404 if param == "model" else 400), out
    assert out["error"]["param"] == param and words in out["error"]["message"], out


def test_documented_in_openapi(server):
    status, raw, _ = http_request("GET", f"{server}/openapi.json")
    op = json.loads(raw)["paths"]["/v1/embeddings"]["post"]
    assert {"200", "400", "503"} <= set(op["responses"]) and "not a retrieval model" in op["description"]
