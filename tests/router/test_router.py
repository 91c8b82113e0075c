"""`kvserve router` over real `kvserve serve` replicas of the default model, plus a scripted fake
replica (a thread here) for the failures a real one cannot produce on cue: a 5xx, a reset
connection, a stream that dies half-way, settings that differ.

Three replicas start once for the module; the routers over them run as real processes too.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from kvserve.router.policies import LeastLoad, RoundRobin, SessionAffinity, load_policies, make_policy
from kvserve.router.policy import ReplicaView, RouteRequest
from tests.router.router_procs import (
    FIRST_EVENT,
    REPLICA,
    REPLICA_ARGS,
    START_TIMEOUT,
    FakeReplica,
    Replica,
    Router,
    gone,
    spawn_router,
    stop_all,
    wait_router,
    wait_until,
)
from tests.serving import child_pids, http_request, metric_values, open_stream, sse_events


def complete(base: str, prompt: str = "Hello, my name is", headers: dict[str, str] | None = None,
             **extra: Any) -> tuple[int, dict, dict[str, str]]:
    status, body, hdrs = http_request("POST", f"{base}/v1/completions",
                                      {"prompt": prompt, "max_tokens": 2, "temperature": 0, **extra}, headers)
    return status, json.loads(body), hdrs


# ---- fixtures ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fake() -> Iterator[FakeReplica]:
    f = FakeReplica()
    yield f
    f.close()


@pytest.fixture(scope="module")
def routers(cluster, fake, tmp_path_factory) -> Iterator[dict[str, Router]]:
    """All the routers of the module, started at once (each takes seconds to import)."""
    logs = tmp_path_factory.mktemp("routers")
    urls = [a for r in cluster for a in ("--replica", r.url)]
    specs = {"rr": [*urls, "--policy", "round_robin", "--health-interval", "1"],
             "session": [*urls, "--policy", "session", "--health-interval", "1"],
             "mixed": ["--replica", cluster[0].url, "--replica", fake.url, "--policy", "round_robin"],
             "fake": ["--replica", fake.url, "--policy", "least_load", "--health-interval", "0.5"]}
    specs["kv_aware"] = [*urls, "--health-interval", "1"]  # the default policy
    started = {name: spawn_router(args, logs / f"{name}.log") for name, args in specs.items()}
    try:
        yield {name: wait_router(r) for name, r in started.items()}
    finally:
        stop_all([r.proc for r in started.values()])


@pytest.fixture(autouse=True)
def _fake_ok(fake):
    fake.mode, fake.health = "ok", 200


# ---- the policies, without processes -------------------------------------------------------------

def views(*urls: str) -> list[ReplicaView]:
    return [ReplicaView(u) for u in urls]


def test_registry_has_the_load_policies_and_names_them_on_error():
    assert {"round_robin", "least_load", "session", "kv_aware", "approx"} <= set(load_policies())
    with pytest.raises(ValueError, match=r"--policy: unknown router policy 'nope'; known: .*least_load.*round_robin"):
        make_policy("nope")
    assert isinstance(make_policy("session", load_factor=2.0), SessionAffinity)


def test_round_robin_and_least_load():
    reps = views("a", "b", "c")
    rr = RoundRobin()
    assert [rr.choose(RouteRequest("completion", {}), reps).replica.url for _ in range(6)] == list("abcabc")
    reps[0].pending_prefill_tokens, reps[1].decode_streams = 100, 1  # loads 100, 16, 0
    ll = LeastLoad(seed=0)
    assert ll.choose(RouteRequest("completion", {}), reps).replica.url == "c"
    reps[2].pending_prefill_tokens = 16  # b and c tie on load; c has fewer requests in flight
    reps[1].in_flight = 1
    assert ll.choose(RouteRequest("completion", {}), reps).replica.url == "c"
    reps[2].in_flight = 1  # a full tie: both get picked
    assert {ll.choose(RouteRequest("completion", {}), reps).replica.url for _ in range(40)} == {"b", "c"}


def test_session_ring_moves_only_the_leaving_replicas_sessions():
    urls = [f"http://10.0.0.{i}:8000" for i in range(4)]
    pol = SessionAffinity()
    keys = [f"user-{i}" for i in range(2000)]
    home = {k: pol.choose(RouteRequest("chat", {}, session_key=k), views(*urls)).replica.url for k in keys}
    shares = {u: sum(h == u for h in home.values()) / len(keys) for u in urls}
    assert all(0.12 < s < 0.38 for s in shares.values()), shares  # 100 virtual nodes spread the keys
    left = urls[1]
    after = {k: pol.choose(RouteRequest("chat", {}, session_key=k), views(*urls[:1], *urls[2:])).replica.url
             for k in keys}
    moved = [k for k in keys if after[k] != home[k]]
    assert moved and all(home[k] == left for k in moved)
    assert len({after[k] for k in moved}) == 3  # the leaver's sessions spread over the others
    again = SessionAffinity()  # another router process: the same ring (hashlib, not hash())
    assert all(again.choose(RouteRequest("chat", {}, session_key=k), views(*reversed(urls))).replica.url == home[k]
               for k in keys[:200])


def test_session_bounded_load_and_no_key():
    pol = SessionAffinity(load_factor=1.25)
    reps = views("a", "b", "c")
    req = RouteRequest("chat", {}, session_key="alice")
    first = pol.choose(req, reps)
    assert first.reason == "session"
    # alice's replica holds 4 of 4 requests: ceil(1.25 * 5 / 3) = 3 <= 4, so the ring moves on
    first.replica.in_flight = 4
    second = pol.choose(req, reps)
    assert second.reason == "bounded_load" and second.replica is not first.replica
    assert second.replica.url == pol.walk("alice", ("a", "b", "c"))[1]
    reps[0].pending_prefill_tokens = 50
    assert pol.choose(RouteRequest("chat", {}), reps).reason == "no_session"


# ---- a scripted replica: what a real one cannot do on cue ----------------------------------------

def test_body_and_authorization_reach_the_replica_unchanged(routers, fake):
    raw = b'{"prompt":  "odd   spacing",\n "max_tokens": 1, "user": "u1"}'
    status, body, hdrs = http_request("POST", f"{routers['fake'].base}/v1/completions", raw,
                                      {"Authorization": "Bearer sk-client"})
    assert (status, json.loads(body), hdrs[REPLICA]) == (200, {"ok": True}, fake.url)
    path, seen, got = fake.posts[-1]
    assert (path, got, seen["authorization"]) == ("/v1/completions", raw, "Bearer sk-client")


def test_tokenize_routes_forward_to_a_replica_unchanged(routers, fake):
    base = routers["fake"].base
    for path in ("/tokenize", "/detokenize"):
        raw = b'{"prompt":  "odd   spacing",\n "tokens": [1]}'
        status, body, hdrs = http_request("POST", f"{base}{path}", raw, {"Authorization": "Bearer sk-client"})
        assert (status, json.loads(body), hdrs[REPLICA]) == (200, {"ok": True}, fake.url)
        got_path, seen, got = fake.posts[-1]
        assert (got_path, got, seen["authorization"]) == (path, raw, "Bearer sk-client")
    fake.mode = "503"  # the replica's own error comes back as it is: not retried, not rewritten
    status, body, _ = http_request("POST", f"{base}/tokenize", {"prompt": "x"})
    assert (status, json.loads(body)["error"]["message"]) == (503, "fake overloaded")
    fake.mode = "reset"  # the only replica cannot be reached
    status, body, hdrs = http_request("POST", f"{base}/detokenize", {"tokens": [1]})
    err = json.loads(body)["error"]
    assert (status, err["type"], err["code"], hdrs["retry-after"]) == (503, "service_unavailable", 503, "1")
    assert err["message"].startswith(f"no replica could detokenize: {fake.url}: "), err


def test_5xx_and_reset_are_retried_on_another_replica(routers, fake, cluster):
    mixed = routers["mixed"]
    for mode in ("503", "reset"):
        fake.mode = mode
        before = len(fake.posts)
        for _ in range(2):  # round robin over [real, fake]: one of two tries the fake first
            status, body, hdrs = complete(mixed.base)
            assert status == 200 and body["choices"][0]["text"], body
            assert hdrs[REPLICA] == cluster[0].url
        assert len(fake.posts) > before
    m = metric_values(mixed.base)
    assert m['kvserve_router:retries_total{reason="status_503"}'] >= 1
    assert m['kvserve_router:retries_total{reason="connection"}'] >= 1
    assert m[f'kvserve_router:requests_total{{replica="{fake.url}",status="503"}}'] >= 1
    assert m[f'kvserve_router:requests_total{{replica="{fake.url}",status="error"}}'] >= 1
    assert mixed.replicas()[fake.url]["healthy"]  # it still answers /health: failures alone keep it in


def test_stream_that_breaks_off_ends_with_one_clean_error_event(routers, fake):
    fake.mode = "stream_dies"
    conn, resp = open_stream(routers["fake"].base, "/v1/completions", {"prompt": "x", "stream": True})
    try:
        assert resp.status == 200 and resp.getheader("content-type").startswith("text/event-stream")
        events = list(sse_events(resp))  # every line parses: the half event was held back
    finally:
        conn.close()
    assert events[0] == FIRST_EVENT
    err = events[1]["error"]
    assert (err["type"], err["param"], err["code"]) == ("internal_server_error", None, 500)
    assert fake.url in err["message"]
    assert events[2:] == ["[DONE]"]


def test_no_replica_left_is_503_in_the_openai_shape(routers, fake):
    base = routers["fake"].base
    fake.mode = "503"
    status, body, hdrs = http_request("POST", f"{base}/v1/chat/completions",
                                      {"messages": [{"role": "user", "content": "hi"}]})
    err = json.loads(body)["error"]
    assert (status, err["type"], err["code"], hdrs["retry-after"]) == (503, "service_unavailable", 503, "1")
    assert fake.url in err["message"] and "fake overloaded" in err["message"]
    assert http_request("GET", f"{base}/health")[0] == 200
    fake.health = 503  # the health loop (every 0.5 s) takes it out
    wait_until("the router's /health to fail", lambda: http_request("GET", f"{base}/health")[0] == 503)
    status, body, _ = http_request("GET", f"{base}/health")
    assert set(json.loads(body)["error"]) == {"message", "type", "param", "code"}
    status, body, _ = complete(base)
    assert status == 503 and "no replica is healthy" in body["error"]["message"]
    status, body, _ = http_request("POST", f"{base}/tokenize", {"prompt": "x"})
    assert (status, json.loads(body)) == (503, {"error": {"message": "no healthy replica to tokenize",
                                                          "type": "service_unavailable", "param": None, "code": 503}})
    fake.health = 200
    wait_until("the fake to be taken back", lambda: routers["fake"].replicas()[fake.url]["healthy"])


def test_replicas_with_other_block_sizes_are_refused(cluster, tmp_path):
    other = FakeReplica(kv_events={"enabled": False, "block_size": 32, "model": "x"})
    try:
        r = spawn_router(["--replica", cluster[0].url, "--replica", other.url, "--policy", "round_robin"],
                         tmp_path / "router.log")
        assert r.proc.wait(120) == 2
        out = r.log.read_text()
        assert "block_size differs" in out and cluster[0].url in out and other.url in out and "32" in out, out
    finally:
        other.close()


# ---- real replicas --------------------------------------------------------------------------------

def test_round_robin_spreads_requests(routers, cluster):
    rr = routers["rr"]
    before = {u: r["requests_routed"] for u, r in rr.replicas().items()}
    served = []
    for i in range(6):
        status, body, hdrs = complete(rr.base, f"Request number {i} says")
        assert status == 200 and body["usage"]["completion_tokens"] == 2, body
        served.append(hdrs[REPLICA])
    assert sorted(served) == sorted(r.url for r in cluster for _ in range(2))
    after = rr.replicas()
    assert all(after[r.url]["requests_routed"] - before[r.url] == 2 for r in cluster)
    assert all(r["in_flight"] == 0 and r["pending_prefill_tokens"] == 0 and r["decode_streams"] == 0
               for r in after.values())
    assert all(r["role"] == "both" and r["kv_events"]["enabled"] for r in after.values())
    wait_until("every replica's KV events to sync",
               lambda: all(r["kv_events"]["synced"] for r in rr.replicas().values()))


def read_stream(base: str, path: str, body: dict) -> tuple[list, dict[str, str]]:
    conn, resp = open_stream(base, path, body)
    try:
        assert resp.status == 200
        return list(sse_events(resp)), {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


def test_streaming_passes_through_event_by_event(routers, cluster):
    body = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 4, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    # The two streams compared must compute alike: a prompt prefilled whole (int8 codes from 16 rows
    # where tuning took them) and the same prompt's uncached tail after a prefix-cache hit (the
    # decode kernel's int16 codes) can part at a near-tie of this small model (seen on a Xeon with
    # AMX). So every replica holds the prompt in its prefix cache first, and both streams hit it.
    for r in cluster:
        assert read_stream(r.url, "/v1/chat/completions", body)[0][-1] == "[DONE]"
    events, hdrs = read_stream(routers["rr"].base, "/v1/chat/completions", body)
    assert hdrs["content-type"].startswith("text/event-stream")
    direct, _ = read_stream(hdrs[REPLICA], "/v1/chat/completions", body)  # the replica it went to
    assert events[-1] == "[DONE]" and direct[-1] == "[DONE]"
    text = ["".join(c["delta"].get("content") or "" for e in evs[:-1] for c in e["choices"]) for evs in (events, direct)]
    assert text[0] == text[1] and text[0]
    usage = [evs[-2]["usage"] for evs in (events, direct)]
    assert usage[0]["completion_tokens"] == usage[1]["completion_tokens"] == 4
    assert usage[0]["prompt_tokens"] == usage[1]["prompt_tokens"]
    assert len(events) == len(direct) >= 6  # role + 4 tokens (+ usage), each its own event


def test_client_leaving_a_stream_frees_the_replica(routers):
    rr = routers["rr"]
    conn, resp = open_stream(rr.base, "/v1/completions", {"prompt": "Count to a thousand:", "max_tokens": 400,
                                                          "ignore_eos": True, "stream": True})
    url = resp.getheader(REPLICA)
    try:
        assert resp.status == 200 and "choices" in next(sse_events(resp))
        rep = rr.replicas()[url]  # past its first byte: decoding, its prompt no longer pending
        assert (rep["in_flight"], rep["decode_streams"], rep["pending_prefill_tokens"]) == (1, 1, 0)
        assert metric_values(url)["kvserve:num_requests_running"] == 1
    finally:
        conn.close()
    # 400 tokens would take minutes here: the router must close its own stream to the replica at once.
    wait_until("the router to drop the request", lambda: rr.replicas()[url]["in_flight"] == 0, 10)
    wait_until("the replica to abort it", lambda: metric_values(url)["kvserve:num_requests_running"] == 0, 10)


@pytest.mark.parametrize("path, raw", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}),
    ("/v1/completions", {"prompt": "hi", "model": "no-such-model"}),
    ("/v1/chat/completions", {"messages": "not a list"}),
    ("/v1/completions", b"{not json"),
])
def test_errors_pass_through_verbatim(routers, cluster, path, raw):
    via = http_request("POST", f"{routers['rr'].base}{path}", raw)
    direct = http_request("POST", f"{cluster[0].url}{path}", raw)
    assert via[0] == direct[0] and 400 <= via[0] < 500
    assert via[1] == direct[1]  # byte for byte
    assert via[2]["content-type"] == direct[2]["content-type"] == "application/json"


def test_models_health_and_metrics(routers, cluster):
    rr = routers["rr"]
    status, body, _ = http_request("GET", f"{rr.base}/v1/models")
    assert status == 200 and body == http_request("GET", f"{cluster[0].url}/v1/models")[1]
    status, body, _ = http_request("GET", f"{rr.base}/health")
    assert status == 200 and json.loads(body)["healthy_replicas"] == 3
    complete(rr.base)
    m = metric_values(rr.base)
    assert m['kvserve_router:decisions_total{policy="round_robin",reason="round_robin"}'] >= 1
    for r in cluster:
        for name in ("in_flight_requests", "in_flight_tokens", "decode_streams", "estimated_hit_rate"):
            assert m[f'kvserve_router:{name}{{replica="{r.url}"}}'] == 0
        assert m[f'kvserve_router:replica_healthy{{replica="{r.url}"}}'] == 1
    assert sum(v for k, v in m.items() if k.startswith("kvserve_router:requests_total") and 'status="200"' in k) >= 1
    text = http_request("GET", f"{rr.base}/metrics")[1].decode()
    assert "# TYPE kvserve_router:retries_total counter" in text


def test_tokenize_and_detokenize_through_the_router(routers, cluster):
    rr, urls = routers["rr"], {r.url for r in cluster}
    chat = {"messages": [{"role": "user", "content": "Name a colour."}], "return_token_strs": True}
    for body in ({"prompt": "Hello, my name is"}, chat, {"prompt": "x", "suffix": "y"}):
        via = http_request("POST", f"{rr.base}/tokenize", body)
        direct = http_request("POST", f"{cluster[0].url}/tokenize", body)
        assert via[:2] == direct[:2] and via[0] in (200, 400), via  # status and body byte for byte
        assert via[2]["content-type"] == direct[2]["content-type"] == "application/json"
    served = set()
    for _ in range(3):  # any replica answers; they take turns
        status, body, hdrs = http_request("POST", f"{rr.base}/tokenize",
                                          {"prompt": "Hello, my name is", "add_special_tokens": False})
        assert status == 200, body
        served.add(hdrs[REPLICA])
    assert served == urls
    status, back, _ = http_request("POST", f"{rr.base}/detokenize", {"tokens": json.loads(body)["tokens"]})
    assert (status, json.loads(back)) == (200, {"prompt": "Hello, my name is"})
    via, direct = (http_request("POST", f"{b}/detokenize", {"tokens": [-1]}) for b in (rr.base, cluster[0].url))
    assert via[:2] == direct[:2] and via[0] == 400


def session_homes(cluster: list[Replica], keys: list[str], without: str | None = None) -> dict[str, str]:
    """Where the router's session policy should send each key (the same ring, computed here)."""
    pol = SessionAffinity()
    urls = tuple(r.url for r in cluster if r.url != without)
    return {k: pol.walk(k, urls)[0] for k in keys}


def test_session_affinity_keeps_a_session_on_its_replica(routers, cluster):
    base = routers["session"].base
    keys = [f"session-{i}" for i in range(40)]
    homes = session_homes(cluster, keys)
    picked = [next(k for k in keys if homes[k] == r.url) for r in cluster]  # one session per replica
    for key in picked:
        for turn in range(2):
            status, body, hdrs = complete(base, f"Turn {turn} of {key}:", {"X-Session-ID": key})
            assert status == 200, body
            assert hdrs[REPLICA] == homes[key], (key, turn)
    status, _, hdrs = complete(base, "From a user field:", user=picked[1])  # body["user"] when no header
    assert status == 200 and hdrs[REPLICA] == homes[picked[1]]
    m = metric_values(base)
    assert m['kvserve_router:decisions_total{policy="session",reason="session"}'] >= 7


def test_kv_aware_sends_a_repeated_prompt_where_its_blocks_are(routers):
    base = routers["kv_aware"].base
    prompt = "A unique preamble for the KV-aware router test: " + " ".join(f"w{random.randrange(10**6)}"
                                                                           for _ in range(30))
    status, first, hdrs = complete(base, prompt)
    assert status == 200, first
    home = hdrs[REPLICA]

    time.sleep(0.5)  # the replica's KV events reach the router's mirror within milliseconds
    status, body, hdrs = complete(base, prompt)
    assert status == 200 and hdrs[REPLICA] == home
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
    m = metric_values(base)
    assert m['kvserve_router:decisions_total{policy="kv_aware",reason="cache_hit"}'] >= 1
    assert m[f'kvserve_router:estimated_hit_rate{{replica="{home}"}}'] > 0


@pytest.mark.slow
def test_failover_sigkill_retry_and_recovery(routers, cluster):
    rr, session = routers["rr"], routers["session"]
    victim = cluster[2]
    keys = [f"failover-{i}" for i in range(60)]
    homes, homes_after = session_homes(cluster, keys), session_homes(cluster, keys, without=victim.url)
    stay = [k for k in keys if homes[k] != victim.url][:2]
    moving = next(k for k in keys if homes[k] == victim.url)
    engine = child_pids(victim.proc.pid)
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(10)
    with ThreadPoolExecutor(3) as ex:  # at once, before any health check: one is routed to the dead replica
        results = list(ex.map(lambda i: complete(rr.base, f"Failover {i}:"), range(3)))
    assert all(status == 200 for status, _, _ in results), results
    assert all(h[REPLICA] != victim.url for _, _, h in results)
    for router in (rr, session):
        wait_until("the router to mark the killed replica", lambda: not router.replicas()[victim.url]["healthy"], 10)
    assert rr.replicas()[victim.url]["error"]
    # Sessions: only the dead replica's move, to the next replica on the ring.
    for key in [*stay, moving]:
        status, _, hdrs = complete(session.base, "Where am I?", {"X-Session-ID": key})
        assert status == 200 and hdrs[REPLICA] == homes_after[key], key
    assert homes_after[moving] != homes[moving] and all(homes_after[k] == homes[k] for k in stay)
    wait_until("the killed replica's engine to exit", lambda: all(gone(p) for p in engine), 30)

    victim.start()  # the same ports: the router knows it by its URL
    victim.wait_healthy()
    for router in (rr, session):
        wait_until("the router to take the replica back", lambda: router.replicas()[victim.url]["healthy"], 15)
    wait_until("its KV events to sync again", lambda: rr.replicas()[victim.url]["kv_events"]["synced"], 15)
    status, _, hdrs = complete(session.base, "Back home?", {"X-Session-ID": moving})
    assert status == 200 and hdrs[REPLICA] == victim.url


@pytest.mark.slow
def test_launch_starts_and_stops_its_replicas(tmp_path):
    r = spawn_router(["--launch", "2", "--policy", "least_load", "--health-interval", "1", "--",
                      *REPLICA_ARGS], tmp_path / "router.log")
    try:
        wait_router(r, START_TIMEOUT)
        reps = r.replicas()
        assert len(reps) == 2 and all(x["healthy"] and x["pid"] and x["kv_events"]["enabled"] for x in reps.values())
        pids = [x["pid"] for x in reps.values()]
        log = r.log.read_text()
        cpus = sorted(os.sched_getaffinity(0))
        for i, (url, x) in enumerate(reps.items()):
            cores = cpus[i::2] or [cpus[i % len(cpus)]]
            assert sorted(os.sched_getaffinity(x["pid"])) == cores
            assert f"replica {url} (pid {x['pid']}, cores {','.join(map(str, cores))}" in log, log
        assert f"serving at {r.base}/v1" in log
        wait_until("the launched replicas' KV events to sync",
                   lambda: all(x["kv_events"]["synced"] for x in r.replicas().values()), 30)
        status, body, hdrs = complete(r.base)
        assert status == 200 and hdrs[REPLICA] in reps, body
        family = pids + [c for p in pids for c in child_pids(p)]
        r.proc.send_signal(signal.SIGTERM)
        assert r.proc.wait(60) == 0
        wait_until("every launched process to exit", lambda: all(gone(p) for p in family), 30)
    finally:
        r.stop()


def test_structured_outputs_and_tools_through_the_router(routers):
    """A JSON-schema request and a forced tool call through the KV-aware router, which renders the
    chat (tools included) to hash it: the replica's constrained answers come back whole."""
    import jsonschema

    base = routers["kv_aware"].base
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "sunny": {"type": "boolean"}},
              "required": ["city", "sunny"], "additionalProperties": False}
    msgs = [{"role": "user", "content": "The weather in Paris, as JSON."}]
    rf = {"type": "json_schema", "json_schema": {"name": "weather", "schema": schema}}
    status, raw, _ = http_request("POST", f"{base}/v1/chat/completions", {
        "messages": msgs, "max_tokens": 100, "temperature": 0, "response_format": rf}, timeout=120)
    assert status == 200, raw
    jsonschema.validate(json.loads(json.loads(raw)["choices"][0]["message"]["content"]), schema)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}]
    status, raw, _ = http_request("POST", f"{base}/v1/chat/completions", {
        "messages": msgs, "tools": tools, "tool_choice": "required", "max_tokens": 100, "temperature": 0}, timeout=120)
    assert status == 200, raw
    choice = json.loads(raw)["choices"][0]
    call = choice["message"]["tool_calls"][0]["function"]
    assert choice["finish_reason"] == "tool_calls" and call["name"] == "get_weather"
    assert isinstance(json.loads(call["arguments"])["city"], str)
