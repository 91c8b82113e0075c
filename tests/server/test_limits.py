"""What probing a running server found, each through a real server process: oversized bodies
and prompts are refused before they cost memory, connections that never finish their headers
are closed, and routes that ask the engine answer in bounded time even when it cannot answer."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import time

import pytest

from tests.serving import MODEL, TINY_SERVER_ARGS, engine_pid, http_request, running_server

LIMIT = 64 * 1024


@pytest.fixture(scope="module")
def srv(tiny_model_factory, tmp_path_factory):
    args = [str(tiny_model_factory("llama")), *TINY_SERVER_ARGS, "--max-request-bytes", "64KiB",
            "--header-timeout", "1", "--max-model-len", "128"]
    with running_server(args, tmp_path_factory.mktemp("limits") / "log") as s:
        yield s


def _error(body: bytes) -> dict:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


def _chunked_post(base: str, path: str, body: bytes, piece: int = 8192) -> tuple[int, bytes]:
    """POST `body` chunked, as urllib3 and httpcore send one: a server that answers before the
    body ends and closes with it unread makes the next send fail (EPIPE / reset); the client then
    stops sending and reads the answer, which arrived before the reset."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     "Transfer-Encoding: chunked\r\n\r\n".encode())
        try:
            for i in range(0, len(body), piece):
                part = body[i:i + piece]
                sock.sendall(b"%x\r\n%s\r\n" % (len(part), part))
            sock.sendall(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        resp = http.client.HTTPResponse(sock)
        resp.begin()
        return resp.status, resp.read()


def test_body_over_the_limit_is_refused_unread(srv):
    body = json.dumps({"model": MODEL, "prompt": "x" * (2 * LIMIT)}).encode()
    status, raw, _ = http_request("POST", f"{srv.v1}/completions", body)
    assert status == 413, raw
    err = _error(raw)
    assert "--max-request-bytes" in err["message"] and err["code"] == 413
    # without a Content-Length (chunked), refused at the first byte past the limit
    status, raw = _chunked_post(srv.base, "/v1/completions", body)
    assert status == 413 and "--max-request-bytes" in _error(raw)["message"], raw
    ok = http_request("POST", f"{srv.v1}/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 2})
    assert ok[0] == 200, ok[1]


def test_prompt_longer_than_the_context_can_hold_is_refused_untokenized(srv, tokenizer):
    longest = max(len(t) for t in tokenizer.get_vocab())
    text = "a" * (128 * longest + 1)  # under the body limit, over what 128 tokens can spell
    assert len(text) < LIMIT
    status, raw, _ = http_request("POST", f"{srv.v1}/completions", {"model": MODEL, "prompt": text})
    err = _error(raw)
    assert status == 400 and err["param"] == "prompt" and "characters" in err["message"], raw
    status, raw, _ = http_request("POST", f"{srv.v1}/completions", {"model": MODEL, "prompt": ["hi", text]})
    assert status == 400 and _error(raw)["param"] == "prompt[1]", raw
    status, raw, _ = http_request("POST", f"{srv.v1}/chat/completions",
                                  {"model": MODEL, "messages": [{"role": "user", "content": text}]})
    assert status == 400 and _error(raw)["param"] == "messages", raw


def test_connections_that_never_finish_their_headers_are_closed(srv):
    host, port = srv.base.removeprefix("http://").split(":")
    socks = []
    for i in range(60):
        s = socket.create_connection((host, int(port)), timeout=10)
        if i % 2:  # half send part of a request's headers, half send nothing at all
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        socks.append(s)
    # the server answers meanwhile
    assert http_request("GET", f"{srv.base}/health")[0] == 200
    closed = 0
    for s in socks:
        try:
            closed += s.recv(1) == b""  # EOF: the server closed it (--header-timeout 1)
        except TimeoutError:
            pass  # still open after 10 s
        except ConnectionResetError:
            closed += 1
        finally:
            s.close()
    assert closed == len(socks), f"{len(socks) - closed} of {len(socks)} idle connections still open"
    # a keep-alive client whose next request comes late is closed too, after its first answer
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    conn.request("GET", "/health")
    assert conn.getresponse().read()
    conn.sock.sendall(b"GET /health HTTP/1.1\r\n")
    assert conn.sock.recv(1) == b""
    conn.close()


def test_routes_that_ask_a_stalled_engine_answer_in_bounded_time(srv):
    """A step that takes long (here: the engine process stopped with SIGSTOP) must not turn
    /kv_cache/stats into a 30 s wait and a 500: the latest snapshot answers, or a shaped 503."""
    status, raw, _ = http_request("GET", f"{srv.base}/kv_cache/stats")
    assert status == 200 and "kv_usage" in json.loads(raw), raw
    engine = engine_pid(srv.proc.pid)
    os.kill(engine, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        status, raw, _ = http_request("GET", f"{srv.base}/kv_cache/stats", timeout=30)
        assert status == 200, raw
        stats = json.loads(raw)
        assert "kv_usage" in stats and stats["stats_age_s"] >= 0
        status, raw, _ = http_request("GET", f"{srv.base}/metrics", timeout=30)
        assert status == 200 and b"kvserve:kv_cache_usage_perc" in raw
        status, raw, headers = http_request("POST", f"{srv.base}/kv_cache/clear", timeout=30)
        assert status == 503 and _error(raw)["type"] == "service_unavailable" and "retry-after" in headers, raw
        assert time.monotonic() - t0 < 25  # bounded: stats 2 s, metrics 2 s, clear 10 s
    finally:
        os.kill(engine, signal.SIGCONT)
    assert "Traceback" not in srv.log_text()
    status, raw, _ = http_request("GET", f"{srv.base}/kv_cache/stats")
    assert status == 200 and "stats_age_s" not in json.loads(raw), raw
