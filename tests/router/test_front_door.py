"""The router as a guarded front door, through real router processes over a scripted replica:
its own --api-key checked from the headers before any body is read, the server's body limit and
prompt bound, its own key to the replicas (--upstream-api-key), and bodies that trickle in cut off
after --body-timeout (server/limits.py, shared with `kvserve serve`)."""

from __future__ import annotations

import dataclasses
import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from urllib.parse import quote

import pytest

from kvserve.router.launch import add_router_args, upstream_api_key
from kvserve.server import prompts
from tests.router.router_procs import FakeReplica, Router, spawn_router, stop_all, wait_router
from tests.serving import http_request, trickle_post

KEY, UPSTREAM = "sk-router-7f3a", "sk-replicas-91c2"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 128
BIG = 50 * 1024**2  # the probe's 50 MB body


@pytest.fixture(scope="module")
def fake(tiny_model_factory) -> Iterator[FakeReplica]:
    f = FakeReplica(kv_events={"enabled": False, "model_path": str(tiny_model_factory("llama")),
                               "max_model_len": MAX_MODEL_LEN})
    yield f
    f.close()


@pytest.fixture(scope="module")
def routers(fake, tiny_model_factory, tmp_path_factory) -> Iterator[dict[str, Router]]:
    """"keyed": the router's key, another key upstream, a 1 MiB body limit, 1 s timeouts and the
    replicas' tokenizer (so prompts are bounded); "open_metrics": /health and /metrics open."""
    logs = tmp_path_factory.mktemp("front_door")
    base = ["--replica", fake.url, "--policy", "least_load", "--api-key", KEY]
    specs = {"keyed": [*base, "--upstream-api-key", UPSTREAM, "--max-request-bytes", "1MiB", "--body-timeout", "1",
                       "--header-timeout", "1", "--tokenizer", str(tiny_model_factory("llama"))],
             "open_metrics": [*base, "--allow-unauthenticated-metrics"]}
    started = {name: spawn_router(args, logs / f"{name}.log") for name, args in specs.items()}
    try:
        yield {name: wait_router(r, headers=AUTH) for name, r in started.items()}
    finally:
        stop_all([r.proc for r in started.values()])


@pytest.fixture(autouse=True)
def _fake_ok(fake):
    fake.mode, fake.health = "ok", 200


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length, read off a raw socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    while len(body) < int(headers["content-length"]):
        body += sock.recv(65536)
    return int(status_line.split()[1]), headers, body


def post_big(r: Router, headers: dict[str, str]) -> tuple[int, dict, float, int, float]:
    """POST a 50 MB completion as a client does (headers, then the body at once, from another
    thread): (status, error, seconds to the answer, bytes the router let in, its RSS growth in MB)."""
    host, port = r.base.removeprefix("http://").split(":")
    head = "".join(f"{k}: {v}\r\n" for k, v in {"Host": host, "Content-Type": "application/json",
                                                  "Content-Length": str(BIG), **headers}.items())
    before = rss_mb(r.proc.pid)
    sent = 0

    def send_body() -> None:
        nonlocal sent
        chunk = b"x" * (1024 * 1024)
        try:
            while sent < BIG:
                sent += sock.send(chunk[:BIG - sent])
        except OSError:  # the router closed the connection: the rest of the body goes nowhere
            pass

    with socket.create_connection((host, int(port)), timeout=20) as sock:
        t0 = time.monotonic()
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\n{head}\r\n".encode())
        sender = threading.Thread(target=send_body)
        sender.start()
        status, _, body = read_response(sock)
        took = time.monotonic() - t0
        sender.join(20)
    return status, json.loads(body)["error"], took, sent, rss_mb(r.proc.pid) - before


def test_a_big_body_without_the_key_is_refused_from_its_headers(routers, fake):
    r = routers["keyed"]
    posts = len(fake.posts)
    status, err, took, sent, grew = post_big(r, {})
    print(f"no key: 401 after {took * 1000:.0f} ms; the router let in {sent / 1024**2:.1f} of 50 MB; "
          f"RSS grew {grew:.1f} MB")
    assert (status, err["type"], err["code"]) == (401, "authentication_error", 401)
    assert "API key" in err["message"]
    assert took < 1.5, f"401 took {took:.2f} s"  # the probe measured the body read, parsed, tokenized: 6.5 s
    assert sent < BIG / 2 and grew < 20, (sent, grew)
    assert len(fake.posts) == posts  # nothing reached a replica
    # with the key, the same body is over the limit: 413, also before it is read
    status, err, took, sent, grew = post_big(r, AUTH)
    print(f"with the key: 413 after {took * 1000:.0f} ms; let in {sent / 1024**2:.1f} MB; RSS grew {grew:.1f} MB")
    assert (status, err["code"]) == (413, 413) and "--max-request-bytes" in err["message"]
    assert took < 1.5 and sent < BIG / 2 and grew < 20, (took, sent, grew)
    assert len(fake.posts) == posts


def test_every_route_needs_the_key(routers, fake):
    base = routers["keyed"].base
    replica = f"/dashboard/replica_metrics?replica={quote(fake.url)}"
    gets = ["/replicas", replica, "/health", "/metrics", "/version", "/v1/models"]
    for path in gets:
        status, body, headers = http_request("GET", f"{base}{path}")
        err = json.loads(body)["error"]
        assert (status, err["type"], headers["www-authenticate"]) == (401, "authentication_error", "Bearer"), path
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        assert http_request("POST", f"{base}{path}", {"prompt": "hi"})[0] == 401, path
    for bad in ("Bearer sk-router-7f3b", "Bearer", f"Basic {KEY}", f"Bearer {KEY}x", KEY):
        assert http_request("GET", f"{base}/replicas", headers={"Authorization": bad})[0] == 401, bad
    for good in (f"Bearer {KEY}", f"bearer {KEY}", f"BEARER  {KEY}"):  # the scheme in any case (RFC 7235)
        status, body, _ = http_request("GET", f"{base}/replicas", headers={"Authorization": good})
        assert status == 200 and json.loads(body)["replicas"][0]["url"] == fake.url, good
    status, page, _ = http_request("GET", f"{base}/dashboard")  # the page only: it asks for the key
    assert status == 200 and b'id="apikey"' in page
    assert http_request("GET", f"{base}{replica}", headers=AUTH)[0] == 404  # the fake has no /metrics: passed on
    assert http_request("GET", f"{base}/metrics", headers=AUTH)[0] == 200


def test_allow_unauthenticated_metrics_opens_health_and_metrics_only(routers):
    base = routers["open_metrics"].base
    assert http_request("GET", f"{base}/health")[0] == 200
    status, body, _ = http_request("GET", f"{base}/metrics")
    assert status == 200 and b"kvserve_router:replica_healthy" in body
    for path in ("/replicas", "/version", "/v1/models"):
        assert http_request("GET", f"{base}{path}")[0] == 401, path


def test_replicas_get_the_upstream_key_not_the_clients(routers, fake):
    base = routers["keyed"].base
    status, body, _ = http_request("POST", f"{base}/v1/completions", {"prompt": "hi", "max_tokens": 1},
                                   {"Authorization": f"bearer {KEY}"})
    assert (status, json.loads(body)) == (200, {"ok": True})
    assert fake.posts[-1][1]["authorization"] == f"Bearer {UPSTREAM}"
    assert http_request("POST", f"{base}/tokenize", {"prompt": "hi"}, AUTH)[0] == 200
    assert fake.posts[-1][1]["authorization"] == f"Bearer {UPSTREAM}"
    # the router's probes carry it too (the "open_metrics" router's replicas get its own key)
    probes = {(path, h.get("authorization")) for path, h in fake.gets}
    assert ("/v1/models", f"Bearer {UPSTREAM}") in probes and ("/v1/models", f"Bearer {KEY}") in probes


def test_upstream_key_defaults_to_the_routers_key():
    import argparse

    p = argparse.ArgumentParser()
    add_router_args(p)
    assert upstream_api_key(p.parse_args(["--launch", "1", "--api-key", KEY])) == KEY
    assert upstream_api_key(p.parse_args(["--api-key", KEY, "--upstream-api-key", UPSTREAM])) == UPSTREAM
    assert upstream_api_key(p.parse_args(["--replica", "http://x"])) is None


def test_prompt_text_is_checked_as_the_server_does_before_tokenizing(routers, fake, tiny_model_factory):
    from kvserve.models.loader import load_tokenizer

    base, posts = routers["keyed"].base, len(fake.posts)
    # the replicas' bound on one prompt; the KV capacity, bounding a request's prompts together, is theirs to check
    limits = prompts.text_limits(load_tokenizer(str(tiny_model_factory("llama"))), MAX_MODEL_LEN, MAX_MODEL_LEN)
    limits = dataclasses.replace(limits, per_request=sys.maxsize)
    text = "a" * (limits.per_prompt + 1)
    cases = [("/v1/completions", {"prompt": text}, [text], ["prompt"]),
             ("/v1/completions", {"prompt": ["hi", text]}, ["hi", text], ["prompt[0]", "prompt[1]"]),
             ("/v1/completions", {"prompt": "bad \ud800"}, ["bad \ud800"], ["prompt"]),
             ("/v1/chat/completions", {"messages": [{"role": "system", "content": "a"},
                                                    {"role": "user", "content": [{"type": "text", "text": text}]}]},
              ["a" + text], ["messages"])]
    for path, body, texts, names in cases:
        status, raw, _ = http_request("POST", f"{base}{path}", body, AUTH)
        with pytest.raises(prompts.PromptError) as want:  # the server's own check and message
            prompts.check_prompt_text(texts, names, limits, names[-1])
        assert status == 400 and json.loads(raw)["error"] == {
            "message": want.value.message, "type": "invalid_request_error", "param": want.value.param,
            "code": 400}, raw
    assert len(fake.posts) == posts  # answered by the router
    for body in ({"prompt": "a" * limits.per_prompt}, {"prompt": 5}, {"messages": "not a list"}):
        status, _, _ = http_request("POST", f"{base}/v1/completions", body, AUTH)
        assert status == 200  # at the bound, or a shape the replica refuses in its own words: forwarded
    assert len(fake.posts) == posts + 3


def test_a_trickling_body_is_cut_off_after_body_timeout(routers, fake):
    r = routers["keyed"]
    posts = len(fake.posts)
    body = json.dumps({"prompt": "slow", "max_tokens": 1}).encode()
    # 4 bytes a second, to a router that waits 1 s for the whole body
    took, head, raw = trickle_post(r.base, "/v1/completions", body, AUTH, pause=0.25)
    print(f"--body-timeout 1: answered after {took:.2f} s")
    assert head.startswith(b"HTTP/1.1 408 "), head
    err = json.loads(raw)["error"]
    assert err["code"] == 408 and "--body-timeout" in err["message"]
    assert 0.9 <= took < 5, took
    assert len(fake.posts) == posts
    assert "Traceback" not in r.log.read_text()
    # a body that comes in time is served
    assert http_request("POST", f"{r.base}/v1/completions", body, AUTH)[0] == 200
