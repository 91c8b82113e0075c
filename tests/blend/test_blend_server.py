"""Blending through `kvserve serve --enable-blending`: separators and listed chunks on completions
and chat, the usage fields, /metrics, and 400s that name the field while the server stays up."""

from __future__ import annotations

import json

import pytest

from tests.blend.test_blend_engine import DOCS, SEP, rag
from tests.conftest import build_tiny_model
from tests.serving import MODEL, http_request, metric_values, running_server

ARGS = ["--dtype", "float32", "--num-kv-blocks", "400", "--served-model-name", MODEL, "--block-size", "4",
        "--enable-blending", "--blend-max-deviation", "1e9", "--blend-max-chunk-tokens", "64"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = build_tiny_model(tmp_path_factory.mktemp("tiny-blend-srv"), "llama", num_hidden_layers=4)
    with running_server([str(model), *ARGS], tmp_path_factory.mktemp("blend-logs") / "serve.log") as s:
        yield s


def _post(server, path: str, body: dict) -> tuple[int, dict]:
    status, raw, _ = http_request("POST", f"{server.v1}/{path}", {"model": MODEL, "temperature": 0, **body},
                                  timeout=60)
    return status, json.loads(raw)


def test_separators_and_listed_chunks(server):
    status, first = _post(server, "completions", {"prompt": rag([0, 1, 2]), "max_tokens": 4})
    assert status == 200, first
    status, out = _post(server, "completions", {"prompt": rag([2, 0, 1]), "max_tokens": 4})
    assert status == 200, out
    details = out["usage"]["prompt_tokens_details"]
    assert details["blended_tokens"] > 0 and details["recomputed_tokens"] > 0
    assert details["cached_tokens"] == details["cached_tokens_by_tier"]["device"] > 0  # the system prompt
    assert "blended" not in details["cached_tokens_by_tier"]

    # chat, chunks listed instead of separated
    content = "Notes: " + " ".join(DOCS[i] for i in (1, 2, 0)) + " Question?"
    status, chat = _post(server, "chat/completions", {
        "messages": [{"role": "user", "content": content}], "max_tokens": 4,
        "blend": {"chunks": [DOCS[1], DOCS[2], DOCS[0]], "recompute_ratio": 0.3}})
    assert status == 200, chat
    assert chat["usage"]["prompt_tokens_details"]["blended_tokens"] > 0

    metrics = metric_values(server.base)
    assert metrics["kvserve:blend_requests_total"] >= 3
    assert metrics["kvserve:blend_blended_tokens_total"] > 0


@pytest.mark.parametrize("body, param, match", [
    ({"prompt": f"question{SEP}"}, "prompt", "marks no chunk"),
    ({"prompt": f"sys{SEP} {SEP}question"}, "prompt", "is empty"),
    ({"prompt": "abc", "blend": {"chunks": []}}, "blend", "non-empty list"),
    ({"prompt": "abc", "blend": {"chunks": [""]}}, "blend", r"blend.chunks\[0\] is empty"),
    ({"prompt": "abc", "blend": {"chunks": ["zzz"]}}, "blend", "does not occur"),
    ({"prompt": "x" + SEP + " ".join(DOCS) * 2 + SEP + "q"}, "blend", "more than blend_max_chunk_tokens=64"),
    ({"prompt": rag([0, 1]), "blend": {"recompute_ratio": 2}}, "blend", "recompute_ratio"),
    ({"prompt": "abc", "blend": {"chunks": ["abc"], "bogus": 1}}, None, "bogus"),
])
def test_bad_input_is_a_400_naming_the_field(server, body, param, match):
    status, out = _post(server, "completions", {"max_tokens": 2, **body})
    assert status == 400, out
    assert pytest.importorskip("re").search(match, out["error"]["message"]), out
    if param is not None:
        assert out["error"]["param"] == param
    status, ok = _post(server, "completions", {"prompt": rag([1, 0]), "max_tokens": 2})
    assert status == 200, ok  # and the server serves on
