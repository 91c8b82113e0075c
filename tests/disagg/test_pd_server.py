"""Prefill/decode disaggregation between two real `kvserve serve` processes over HTTP, as a
router drives them: the prefill engine's response names where the K/V wait, the decode engine
fetches them and answers exactly as one engine alone does."""

from __future__ import annotations

import json

import pytest

from kvserve.disagg.auth import sign_params
from tests.router.router_procs import wait_until
from tests.serving import (LONG_PROMPT, MODEL, TINY_SERVER_ARGS, http_request, metric_values, open_stream,
                           running_server, sse_events)

ARGS = [*TINY_SERVER_ARGS, "--block-size", "4"]
KEY = b"pd-server-test-deployment-key"


def key_args(path) -> list[str]:
    """--kv-transfer-config naming a file that holds the deployment's key."""
    path.write_bytes(KEY)
    path.chmod(0o600)
    return ["--kv-transfer-config", json.dumps({"kv_connector_extra_config": {"auth_key_file": str(path)}})]


@pytest.fixture(scope="module")
def servers(tiny_model_factory, tmp_path_factory):
    model = str(tiny_model_factory("llama"))
    logs = tmp_path_factory.mktemp("pd-logs")
    key = key_args(logs / "kv.key")
    with running_server([model, *ARGS, "--kv-role", "prefill", *key], logs / "prefill.log") as p, \
            running_server([model, *ARGS, "--kv-role", "decode", *key], logs / "decode.log") as d:
        yield p, d


def _post(url: str, body: dict) -> dict:
    status, raw, _ = http_request("POST", url, body, timeout=60)
    assert status == 200, raw
    return json.loads(raw)


def _remote_prefill(p, path: str, body: dict) -> dict:
    """The router's prefill call."""
    pre = dict(body, max_tokens=1, stream=False, kv_transfer_params={"do_remote_decode": True})
    pre.pop("n", None)
    out = _post(f"{p.v1}/{path}", pre)
    assert out["kv_transfer_params"]["do_remote_prefill"] is True
    return out["kv_transfer_params"]


def test_completion_and_chat(servers):
    p, d = servers
    body = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 12, "temperature": 0}
    want = _post(f"{p.v1}/completions", body)  # aggregated, on one engine
    assert want["kv_transfer_params"] is None
    got = _post(f"{d.v1}/completions", dict(body, kv_transfer_params=_remote_prefill(p, "completions", body)))
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= got["usage"]["prompt_tokens"] - 4
    assert got["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]["kv_transfer"] == cached

    chat = {"model": MODEL, "messages": [{"role": "user", "content": LONG_PROMPT + " Chat."}], "max_tokens": 10,
            "temperature": 0, "n": 2, "stream": True}
    want = _post(f"{p.v1}/chat/completions", dict(chat, stream=False))
    conn, resp = open_stream(d.base, "/v1/chat/completions",
                             dict(chat, kv_transfer_params=_remote_prefill(p, "chat/completions", chat)))
    text = {0: "", 1: ""}
    for ev in sse_events(resp):
        if ev != "[DONE]":
            for c in ev["choices"]:
                text[c["index"]] += c["delta"].get("content") or ""
    conn.close()
    assert text == {c["index"]: c["message"]["content"] for c in want["choices"]}


def test_decode_refuses_what_it_cannot_serve(servers):
    p, d = servers
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
    status, raw, _ = http_request("POST", f"{d.v1}/completions", dict(body, kv_transfer_params={"do_remote_decode": True}))
    assert status == 400 and b"do_remote_decode needs --kv-role prefill" in raw
    status, raw, _ = http_request("POST", f"{d.v1}/completions",
                                  dict(body, kv_transfer_params={"do_remote_prefill": True}))
    assert status == 400 and b"kv_transfer_params.remote_host" in raw
    status, raw, _ = http_request("POST", f"{p.v1}/completions",
                                  dict(body, prompt=["a", "b"], kv_transfer_params={"do_remote_decode": True}))
    assert status == 400 and b"single prompt" in raw
    # a prefill engine that is gone: the decode engine prefills itself (the default policy)
    params = sign_params(KEY, {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 9,
                               "remote_request_id": "x", "remote_num_blocks": 20})
    body = {"model": MODEL, "prompt": "Gone away. " + LONG_PROMPT, "max_tokens": 5, "temperature": 0}
    want = _post(f"{p.v1}/completions", body)
    got = _post(f"{d.v1}/completions", dict(body, kv_transfer_params=params))
    assert got["choices"][0]["text"] == want["choices"][0]["text"]
    def counted(server, outcome: str, n: int) -> bool:  # /metrics shows the engine's latest snapshot
        return metric_values(server.base).get(f'kvserve:kv_transfer_requests_total{{outcome="{outcome}"}}', 0) >= n

    wait_until("the failed fetch in /metrics", lambda: counted(d, "failed", 1))
    assert counted(d, "received", 1) and counted(p, "sent", 2)


def test_a_client_cannot_name_where_kv_come_from(servers):
    """The probe's attack over HTTP (test_transfer_security.py has the rest): kv_transfer_params
    that point the decode engine at a sender of the client's choosing are refused, naming the
    field, unless a prefill engine holding the deployment's key signed them."""
    p, d = servers
    body = {"model": MODEL, "prompt": "The capital of France is " + LONG_PROMPT, "max_tokens": 8, "temperature": 0}
    want = _post(f"{p.v1}/completions", body)["choices"][0]["text"]  # no params: a plain engine's answer
    forged = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 9, "remote_request_id": "x",
              "remote_num_blocks": 8}
    for params, why in [(forged, b"kv_transfer_params.remote_auth is missing"),
                        (sign_params(b"a-key-the-client-made-up", forged), b"kv_transfer_params.remote_auth is wrong")]:
        status, raw, _ = http_request("POST", f"{d.v1}/completions", dict(body, kv_transfer_params=params))
        assert status == 400 and why in raw, raw
    assert _post(f"{d.v1}/completions", body)["choices"][0]["text"] == want
