"""Server life: API key, --max-waiting, a dying engine, SIGTERM. Each case owns a server process."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tests.serving import (MODEL, PROMPT, TINY_SERVER_ARGS, engine_pid, http_request, is_alive, open_stream,
                           running_server, sse_events)

KEY = "sk-test-key"
LONG = {"model": MODEL, "prompt": PROMPT, "max_tokens": 480, "temperature": 0, "ignore_eos": True,
        "stream": True}


@pytest.fixture
def model_dir(tiny_model_factory):
    return str(tiny_model_factory("llama"))


def test_api_key_and_max_waiting(model_dir, tmp_path):
    args = [model_dir, *TINY_SERVER_ARGS, "--api-key", KEY, "--max-waiting", "2", "--max-num-seqs", "1"]
    auth = {"authorization": f"Bearer {KEY}"}
    with running_server(args, tmp_path / "log") as srv:
        url = f"{srv.v1}/completions"
        small = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": KEY}):
            status, body, _ = http_request("POST", url, small, headers)
            assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"
        assert http_request("GET", f"{srv.v1}/models")[0] == 401
        assert http_request("GET", f"{srv.base}/health")[0] == 200  # health and metrics need no key
        assert http_request("POST", url, small, auth)[0] == 200

        # One request runs (max-num-seqs 1); two more wait for it; the next one is refused.
        running = open_stream(srv.base, "/v1/completions", LONG, auth)
        assert next(sse_events(running[1]))["choices"]  # it has its first token: no longer waiting
        waiting = [open_stream(srv.base, "/v1/completions", {**LONG, "max_tokens": 2}, auth) for _ in range(2)]
        assert all(r.status == 200 for _, r in waiting)
        status, body, headers = http_request("POST", url, small, auth)
        assert status == 503, body
        assert json.loads(body)["error"]["code"] == 503 and int(headers["retry-after"]) >= 1
        running[0].sock.close()  # leave: the waiting ones run and finish
        for conn, resp in waiting:
            events = list(sse_events(resp))
            assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
            conn.close()
        assert http_request("POST", url, small, auth)[0] == 200  # admission freed every slot


def test_engine_death_fails_open_streams_and_health(model_dir, tmp_path):
    with running_server([model_dir, *TINY_SERVER_ARGS], tmp_path / "log") as srv:
        streams = [open_stream(srv.base, "/v1/completions", LONG) for _ in range(8)]
        events = [sse_events(resp) for _, resp in streams]
        for ev in events:
            assert next(ev)["choices"]
        t0 = time.monotonic()
        os.kill(engine_pid(srv.proc.pid), signal.SIGKILL)
        for ev in events:
            rest = list(ev)  # must end, not hang
            errors = [e for e in rest if isinstance(e, dict) and "error" in e]
            assert errors and errors[0]["error"]["code"] == 503 and rest[-1] == "[DONE]"
        assert time.monotonic() - t0 < 10  # the liveness check runs every 0.5 s; a hang would be 60 s
        for conn, _ in streams:
            conn.close()
        assert http_request("GET", f"{srv.base}/health")[0] == 503
        status, body, headers = http_request("POST", f"{srv.v1}/completions", {"model": MODEL, "prompt": PROMPT})
        assert status == 503 and "engine" in json.loads(body)["error"]["message"] and "retry-after" in headers
        assert srv.proc.poll() is None  # the server itself stays up and answers


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stop_signal_ends_streams_and_leaves_no_process(model_dir, tmp_path, sig):
    """SIGTERM (kill, systemd) and SIGINT (Ctrl-C) both stop the server cleanly."""
    with running_server([model_dir, *TINY_SERVER_ARGS], tmp_path / "log") as srv:
        engine = engine_pid(srv.proc.pid)
        conn, resp = open_stream(srv.base, "/v1/completions", LONG)
        events = sse_events(resp)
        assert next(events)["choices"]
        t0 = time.monotonic()
        srv.proc.send_signal(sig)
        rest = list(events)  # the in-flight request ends with an error, not after 480 tokens
        assert any(isinstance(e, dict) and "error" in e for e in rest), rest[-3:]
        conn.close()
        assert srv.proc.wait(30) == 0, srv.log_text()
        assert time.monotonic() - t0 < 15
        deadline = time.monotonic() + 10
        while is_alive(engine) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not is_alive(engine), "the engine process outlived the server"
