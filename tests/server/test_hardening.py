"""Issue 31: bounded work per request, strict request types, clean errors, and a non-streaming
request aborted when its client leaves. What depends on processes (disconnect, dead engine, n
limits, tokenizing off the event loop) runs against a real `kvserve serve`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from kvserve.engine.wire import ModelInfo
from tests.conftest import build_tiny_model
from tests.serving import (MODEL, PROMPT, TINY_SERVER_ARGS, engine_pid, http_request, metric_values, open_stream,
                           running_server, sse_events, trickle_post)

MAX_MODEL_LEN = 262144  # a long context: its text bound lets through prompts that take seconds to tokenize
LONGEST_TOKEN = 13  # characters of the tiny tokenizer's longest vocabulary entry
PER_PROMPT_CHARS = MAX_MODEL_LEN * LONGEST_TOKEN
STREAM = {"model": MODEL, "prompt": PROMPT, "temperature": 0, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    """One engine slot (--max-num-seqs 1), 4 sequences may wait, n at most 4, 64 KV blocks (1024 tokens)
    over a disk KV tier; a request body must be complete 2 s after its headers."""
    tmp = tmp_path_factory.mktemp("hardening")
    model = build_tiny_model(tmp / "model", "llama", max_position_embeddings=MAX_MODEL_LEN)
    args = [str(model), *TINY_SERVER_ARGS, "--max-model-len", str(MAX_MODEL_LEN), "--max-waiting", "4",
            "--max-n", "4", "--max-num-seqs", "1", "--num-kv-blocks", "64", "--kv-offload-disk", str(tmp / "kv"),
            "--body-timeout", "2"]
    with running_server(args, tmp / "log") as s:
        s.disk = tmp / "kv"
        yield s


def post(base: str, path: str, body: dict, timeout: float = 60) -> tuple[int, dict, dict]:
    status, raw, headers = http_request("POST", f"{base}{path}", json.dumps(body).encode(), timeout=timeout)
    return status, json.loads(raw) if raw else {}, headers


def error(status: int, body: dict, code: int, param: str | None, *words: str) -> str:
    assert status == code, body
    err = body["error"]
    assert err["code"] == code and err["param"] == param, err
    for w in words:
        assert w in err["message"], err
    return err["message"]


def wait_for(cond, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"{what} not within {timeout} s"
        time.sleep(0.1)
    return time.monotonic() - t0


# ---- strict request types and text (the shared tiny server) ------------------------------------

@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": "10"}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 10.0}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "n": "2"}, "n"),
    ("/v1/completions", {"prompt": PROMPT, "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": PROMPT, "echo": 1}, "echo"),
    ("/v1/completions", {"prompt": PROMPT, "temperature": "0.5"}, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "logprobs": True}, "logprobs"),
    ("/v1/completions", {"prompt": [True, False]}, "prompt"),
    ("/v1/completions", {"prompt": [[1, True]]}, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "stop": [1]}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": None}, {"role": "user", "content": "x"}]},
     "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": "true"}, "logprobs"),
    ("/tokenize", {"prompt": PROMPT, "add_special_tokens": "false"}, "add_special_tokens"),
    ("/detokenize", {"tokens": [1, True]}, "tokens.1"),
])
def test_no_type_coercion(server, path, body, param):
    status, err, _ = post(server, path, {"model": MODEL, **body})
    error(status, err, 400, param)


def test_assistant_message_may_omit_content(server):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant"}, {"role": "user", "content": [
        {"type": "text", "text": "again"}]}]
    status, body, _ = post(server, "/v1/chat/completions", {"model": MODEL, "messages": msgs, "max_tokens": 2,
                                                              "temperature": 1})  # an int where a float goes: fine
    assert status == 200, body


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", {"prompt": "ok \ud800"}, "prompt"),
    ("/v1/completions", {"prompt": ["fine", "bad \udfff"]}, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "stop": ["\ud800"]}, "stop"),
    ("/v1/completions", {"prompt": PROMPT, "cache_salt": "\ud800"}, "cache_salt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
    ("/tokenize", {"prompt": "\ud800"}, "prompt"),
    ("/tokenize", {"prompt": "\ud800", "add_special_tokens": False}, "prompt"),
    ("/tokenize", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "messages.0.content"),
])
def test_unpaired_surrogate_is_a_400_naming_the_field(server, path, body, param):
    raw = json.dumps({"model": MODEL, **body}).encode()  # json.dumps writes it as the escape \ud800
    assert b"\\ud" in raw
    status, out, _ = http_request("POST", f"{server}{path}", raw)
    error(status, json.loads(out), 400, param, "unpaired surrogate")


def test_engine_refusal_of_a_stream_is_an_http_status(server):
    """The engine alone knows it has no --kv-role; a stream it refuses must not be a 200."""
    body = {**STREAM, "max_tokens": 4, "kv_transfer_params": {"do_remote_decode": True}}
    conn, resp = open_stream(server, "/v1/completions", body)
    assert resp.status == 400, resp.read()
    assert "--kv-role" in json.loads(resp.read())["error"]["message"]
    conn.close()
    chat = {**body, "messages": [{"role": "user", "content": "hi"}]}
    del chat["prompt"]
    status, err, _ = post(server, "/v1/chat/completions", chat)
    error(status, err, 400, None, "--kv-role")
    status, raw, _ = http_request("POST", f"{server}/v1/completions", {**STREAM, "max_tokens": 2})
    assert status == 200 and raw.endswith(b"data: [DONE]\n\n")


def test_api_key_bearer_in_any_case():
    """In-process, over a stand-in engine (the routes here only tokenize)."""
    from fastapi.testclient import TestClient

    from kvserve.server.openai_api import build_app
    from tests.conftest import make_tokenizer

    info = ModelInfo(model=None, model_path="/tiny", max_model_len=512, vocab_size=320, block_size=16,
                     num_kv_blocks=64, eos_token_id=2, pid=0)
    app = build_app(SimpleNamespace(model_info=info, is_alive=lambda: True), make_tokenizer(), MODEL, api_key="sk-k")
    with TestClient(app) as c:
        for auth, code in (("Bearer sk-k", 200), ("bearer sk-k", 200), ("BEARER  sk-k ", 200), ("Bearer sk-K", 401),
                           ("sk-k", 401), ("Basic sk-k", 401), ("Bearer sk-k2", 401), ("Bearer", 401)):
            r = c.post("/tokenize", json={"prompt": PROMPT}, headers={"authorization": auth})
            assert r.status_code == code, (auth, r.text)


# ---- n and admission, counted in sequences ----------------------------------------------------

def test_n_over_max_n_is_refused_at_once(srv):
    for n in (5, 1_000_000):
        t0 = time.monotonic()
        status, err, _ = post(srv.base, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "n": n})
        error(status, err, 400, "n", "--max-n", f"got {n}")
        assert time.monotonic() - t0 < 5
    status, err, _ = post(srv.base, "/v1/chat/completions",
                          {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "n": 5})
    error(status, err, 400, "n", "--max-n")
    status, ok, _ = post(srv.base, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "n": 4, "max_tokens": 2})
    assert status == 200 and len(ok["choices"]) == 4


def test_more_sequences_than_max_waiting_is_a_400_not_a_503(srv):
    status, err, _ = post(srv.base, "/v1/completions", {"model": MODEL, "prompt": [PROMPT] * 5, "max_tokens": 2})
    error(status, err, 400, "prompt", "5 sequences", "--max-waiting 4", "fewer")
    status, err, _ = post(srv.base, "/v1/completions", {"model": MODEL, "prompt": [PROMPT] * 2, "n": 3})
    error(status, err, 400, "prompt", "6 sequences")
    status, ok, _ = post(srv.base, "/v1/completions", {"model": MODEL, "prompt": [PROMPT] * 2, "n": 2,
                                                        "max_tokens": 2})
    assert status == 200 and len(ok["choices"]) == 4


def test_admission_counts_sequences_not_requests(srv):
    """One engine slot: a long stream runs; a stream of n=3 then waits with 3 sequences; n=2 more would
    make 5 > --max-waiting 4 (503), n=1 fits."""
    long = open_stream(srv.base, "/v1/completions", {**STREAM, "max_tokens": 960})
    opened = [long]
    try:
        assert long[1].status == 200, long[1].read()
        assert next(sse_events(long[1]))["choices"]  # running: no longer waiting
        waiting = open_stream(srv.base, "/v1/completions", {**STREAM, "max_tokens": 2, "n": 3})
        opened.append(waiting)
        assert waiting[1].status == 200
        status, err, headers = post(srv.base, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "n": 2})
        msg = error(status, err, 503, None, "3 sequences are waiting", "--max-waiting 4")
        assert int(headers["retry-after"]) >= 1, msg
        fits = open_stream(srv.base, "/v1/completions", {**STREAM, "max_tokens": 2})
        opened.append(fits)
        assert fits[1].status == 200
    finally:
        for conn, _ in opened:
            conn.close()
    wait_for(lambda: metric_values(srv.base)["kvserve:num_requests_running"] == 0, 30, "the engine idle")


# ---- a non-streaming request whose client leaves ------------------------------------------------

def test_non_streaming_request_is_aborted_when_its_client_leaves(srv):
    def aborted() -> float:
        return metric_values(srv.base).get('kvserve:request_success_total{finished_reason="abort"}', 0.0)

    before = aborted()
    host, port = srv.base.removeprefix("http://").split(":")
    import http.client

    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/completions", body=json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 900,
                                                              "temperature": 0, "ignore_eos": True}),
                 headers={"content-type": "application/json"})
    wait_for(lambda: metric_values(srv.base)["kvserve:num_requests_running"] == 1, 30, "the request running")
    m = metric_values(srv.base)
    assert m["kvserve:kv_cache_usage_perc"] > 0
    conn.sock.close()  # the client leaves without reading its answer
    took = wait_for(lambda: (lambda m: m["kvserve:num_requests_running"] == 0
                             and m["kvserve:kv_cache_usage_perc"] == 0)(metric_values(srv.base)), 5,
                    "running requests and KV blocks back to 0")
    print(f"non-streaming request aborted {took:.2f} s after its client left")
    assert aborted() == before + 1  # aborted, not finished: 900 tokens take far longer
    conn.close()
    assert "Traceback" not in srv.log_text()


# ---- tokenizing: one text check, off the event loop, a bounded queue -----------------------------

def health_during(base: str, work) -> tuple[object, float, float]:
    """Run `work()` while polling /health; (its result, its seconds, the slowest /health answer)."""
    worst, codes, done = [0.0], set(), threading.Event()

    def poll() -> None:
        while not done.is_set():
            t = time.perf_counter()
            codes.add(http_request("GET", f"{base}/health", timeout=60)[0])
            worst[0] = max(worst[0], time.perf_counter() - t)
            time.sleep(0.02)

    th = threading.Thread(target=poll)
    th.start()
    t0 = time.perf_counter()
    try:
        out = work()
    finally:
        took = time.perf_counter() - t0
        done.set()
        th.join()
    assert codes == {200}, codes
    return out, took, worst[0]


def test_prompt_text_bound_holds_on_every_path(srv):
    """/tokenize without special tokens used to skip it: 15 MB took 12-25 s with /health blocked."""
    huge = "The quick brown fox. " * 750_000  # 15.75 M characters, under the 16 MiB body limit
    for path, body, param in (("/tokenize", {"prompt": huge, "add_special_tokens": False}, "prompt"),
                              ("/tokenize", {"prompt": huge}, "prompt"),
                              ("/v1/completions", {"prompt": huge}, "prompt"),
                              ("/tokenize", {"messages": [{"role": "user", "content": huge}]}, "messages")):
        (status, err, _), took, worst = health_during(srv.base, lambda: post(srv.base, path, {"model": MODEL, **body}))
        print(f"{path} {list(body)[0]} 15.75M chars: {status} in {took:.2f} s, slowest /health {worst:.3f} s")
        error(status, err, 400, param, "characters")
        assert took < 5
    # per request too: prompts that each fit but together exceed it
    part = "a" * (PER_PROMPT_CHARS // 2 + 1)
    status, err, _ = post(srv.base, "/v1/completions", {"model": MODEL, "prompt": [part, part]})
    error(status, err, 400, "prompt", "together")


def test_tokenizing_runs_off_the_event_loop_with_a_bounded_queue(srv):
    text = "The quick brown fox. " * 60_000  # 1.26 M characters: seconds to tokenize here
    body = {"model": MODEL, "prompt": text, "add_special_tokens": False}
    (status, out, _), took, worst = health_during(srv.base, lambda: post(srv.base, "/tokenize", body, timeout=300))
    assert status == 200 and out["count"] > MAX_MODEL_LEN, out.get("error")
    print(f"/tokenize of {len(text)} chars ({out['count']} tokens) took {took:.2f} s; slowest /health {worst:.3f} s")
    assert worst < max(1.0, took / 3)  # on the event loop, /health waited the whole time
    # the tokenizer's queue holds --max-waiting (4) requests; more at once get 503 with Retry-After
    body["prompt"] = text[:300_000]
    with ThreadPoolExecutor(8) as ex:
        results = list(ex.map(lambda _: post(srv.base, "/tokenize", body, timeout=300), range(8)))
    codes = sorted(r[0] for r in results)
    print(f"8 such /tokenize at once: {codes}")
    busy = [r for r in results if r[0] == 503]
    assert busy and codes.count(200) >= 4, codes
    for status, err, headers in busy:
        error(status, err, 503, None, "tokenizer is busy")
        assert int(headers["retry-after"]) >= 1


# ---- KV tier write failures in /metrics ----------------------------------------------------------

def test_failed_tier_writes_and_a_degraded_tier_are_metrics(srv):
    def tier(m: dict, name: str) -> float:
        return m[f'kvserve:{name}{{tier="disk"}}']

    m = metric_values(srv.base)
    assert tier(m, "kv_tier_degraded") == 0 and tier(m, "kv_tier_write_failures_total") == 0
    assert "kvserve:kv_tier_writes_dropped_total" in m
    shutil.rmtree(srv.disk)
    srv.disk.write_text("not a directory")  # every write now fails
    try:
        for i in range(40):  # distinct prompts evict cached blocks, which go down to the disk tier
            status, _, _ = post(srv.base, "/v1/completions", {"model": MODEL, "prompt": f"{i} {PROMPT * 20}",
                                                               "max_tokens": 1})
            assert status == 200
            m = metric_values(srv.base)
            if tier(m, "kv_tier_write_failures_total") > 0:
                break
        print(f"disk tier: {tier(m, 'kv_tier_write_failures_total'):.0f} failed writes after {i + 1} requests")
        assert tier(m, "kv_tier_write_failures_total") > 0 and tier(m, "kv_tier_degraded") == 1
    finally:
        srv.disk.unlink()
        srv.disk.mkdir()


# ---- a dead engine -------------------------------------------------------------------------------

def test_dead_engine_answers_503_with_retry_after(tiny_model_factory, tmp_path):
    with running_server([str(tiny_model_factory("llama")), *TINY_SERVER_ARGS], tmp_path / "log") as s:
        os.kill(engine_pid(s.proc.pid), signal.SIGKILL)
        wait_for(lambda: http_request("GET", f"{s.base}/health")[0] == 503, 10, "/health 503")
        status, _, headers = http_request("GET", f"{s.base}/health")
        assert int(headers["retry-after"]) >= 1
        for path, body in (("/v1/completions", {"prompt": PROMPT}),
                           ("/v1/completions", {"prompt": PROMPT, "stream": True}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            status, err, headers = post(s.base, path, {"model": MODEL, **body})
            error(status, err, 503, None, "engine")
            assert err["error"]["type"] == "service_unavailable" and int(headers["retry-after"]) >= 1
        assert s.proc.poll() is None and "Traceback" not in s.log_text()


def test_a_trickling_body_gets_408_after_body_timeout(srv):
    """--body-timeout on `kvserve serve` (the protocol is server/limits.py's, shared with the router)."""
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 1}).encode()
    took, head, raw = trickle_post(srv.base, "/v1/completions", body, pause=0.5)  # ~40 s for the whole body
    print(f"--body-timeout 2: answered after {took:.2f} s")
    assert head.startswith(b"HTTP/1.1 408 "), head
    assert "--body-timeout" in json.loads(raw)["error"]["message"]
    assert 1.9 <= took < 8, took
    assert http_request("GET", f"{srv.base}/health")[0] == 200
