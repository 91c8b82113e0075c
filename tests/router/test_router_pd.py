"""Prefill/decode disaggregation in the router: the decision rule (pd.py) with injected costs,
the flags and --launch-pd's command lines, and requests through a router running in this
process (its ASGI app called directly) over fake prefill and decode engines (pd_fakes.py)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

import kvserve.router.app as router_app
from kvserve.cli import main as cli_main
from kvserve.router.app import Router, build_app, start_router
from kvserve.router.launch import (
    OWNED_FLAGS,
    _check_args,
    add_router_args,
    launch_commands,
    launch_roles,
    pd_config,
    pd_roles,
)
from kvserve.router.pd import (
    LOCAL,
    PRIOR_PREFILL_TOKENS_PER_S,
    REMOTE,
    CostEstimator,
    Costs,
    PDConfig,
    PDInputs,
    decide,
)
from kvserve.router.pd_proxy import prefill_body
from tests.router.pd_fakes import FakeEngine
from tests.router.router_procs import spawn_router, wait_router
from tests.serving import http_request

# ---- the decision rule -------------------------------------------------------------------------

COSTS = Costs(prefill_tokens_per_s=1000.0, transfer_s_per_token=1e-4, prefill_latency_s=0.5)


def inputs(uncached_decode: int, prompt: int | None = None, uncached_prefill: int | None = -1,
           **kw: Any) -> PDInputs:
    prompt = uncached_decode if prompt is None else prompt
    return PDInputs(prompt, uncached_decode, uncached_prefill=prompt if uncached_prefill == -1 else uncached_prefill,
                    **kw)


def test_forced_modes_and_threshold():
    assert decide(PDConfig("never"), inputs(5000), COSTS) == (LOCAL, "forced_never")
    assert decide(PDConfig("always"), inputs(1), COSTS) == (REMOTE, "forced_always")
    assert decide(PDConfig("always"), inputs(5000, uncached_prefill=None), COSTS) == (LOCAL, "no_prefill_replica")
    cfg = PDConfig("threshold", max_local_prefill_length=100)
    # Dynamo's rule counts what the decode replica does not hold, not the prompt
    assert decide(cfg, inputs(100, prompt=5000), COSTS) == (LOCAL, "threshold")
    assert decide(cfg, inputs(101, prompt=101), COSTS) == (REMOTE, "threshold")
    assert decide(cfg, inputs(101, prefill_in_flight=1000), COSTS) == (REMOTE, "threshold")  # load is not its concern


def test_conditional_weighs_stall_queue_and_transfer():
    cfg = PDConfig("conditional", local_budget_s=0.05)
    # 50 uncached tokens at 1000 tokens/s: a 50 ms stall, within the budget
    assert decide(cfg, inputs(50, prompt=4000), COSTS) == (LOCAL, "short_prompt")
    # 1000 tokens: 1 s local; remote 1 s + 0.1 s transfer, an idle prefill replica
    assert decide(cfg, inputs(1000), COSTS) == (REMOTE, "remote_cheaper")
    # the prefill replica holds none of the 4000-token prompt, the decode replica all but 1000 of it:
    # remote = 4 s + 0.4 s > 2 x 1 s
    assert decide(cfg, inputs(1000, prompt=4000), COSTS) == (LOCAL, "remote_slower")
    # a queue of 2 x 0.5 s on the prefill replica: 1.1 + 1.0 s is still within 2 x 1 s; 3 is not
    assert decide(cfg, inputs(1000, prefill_in_flight=1), COSTS) == (REMOTE, "remote_cheaper")
    assert decide(cfg, inputs(1000, prefill_in_flight=3), COSTS) == (LOCAL, "prefill_queue")
    # prompts already waiting on the decode replica make local slower too
    assert decide(cfg, inputs(1000, prefill_in_flight=3, decode_queued_tokens=2000), COSTS) == (REMOTE,
                                                                                                "remote_cheaper")
    # streams decoding on the decode replica: a local prefill would stall each of them for 1 s,
    # so the prompt waits in the prefill queue instead (1.1 + 1.5 s <= 2 x 1 + 4 x 1 s) ...
    assert decide(cfg, inputs(1000, prefill_in_flight=3, decode_streams=4), COSTS) == (REMOTE, "remote_cheaper")
    # ... but not behind any queue: 10 x 0.5 s + 1.1 s > 2 + 4 s
    assert decide(cfg, inputs(1000, prefill_in_flight=10, decode_streams=4), COSTS) == (LOCAL, "prefill_queue")
    # the measured rate moves the short-prompt line: 1000 tokens are 10 ms at 100k tokens/s
    fast = Costs(prefill_tokens_per_s=100_000.0)
    assert decide(cfg, inputs(1000), fast) == (LOCAL, "short_prompt")
    assert decide(cfg, inputs(1000, uncached_prefill=None), COSTS) == (LOCAL, "no_prefill_replica")


def test_priors_make_conditional_cut_where_threshold_does():
    cfg = PDConfig("conditional")
    assert decide(cfg, inputs(512), Costs()) == (LOCAL, "short_prompt")
    assert decide(cfg, inputs(513), Costs()) == (REMOTE, "remote_cheaper")


def test_cost_estimator_starts_from_priors_then_averages():
    est = CostEstimator(alpha=0.5)
    assert est.costs == Costs() and est.costs.prefill_tokens_per_s == PRIOR_PREFILL_TOKENS_PER_S
    est.prefill_done(1000, 0.5)  # the first measurement replaces the prior
    assert (est.costs.prefill_tokens_per_s, est.costs.prefill_latency_s) == (2000.0, 0.5)
    est.prefill_done(1000, 0.25)
    assert (est.costs.prefill_tokens_per_s, est.costs.prefill_latency_s) == (3000.0, 0.375)
    est.prefill_done(0, 0.1)  # all of it cached: a latency, no rate
    assert (est.costs.prefill_tokens_per_s, est.costs.prefill_latency_s) == (3000.0, 0.2375)
    est.prefill_done(1000, 0.2875, alone=False)  # shared with other requests: mostly a wait
    assert (est.costs.prefill_tokens_per_s, est.costs.prefill_latency_s) == (3000.0, pytest.approx(0.2625))
    assert est.costs.transfer_s_per_token == Costs().transfer_s_per_token
    est.transfer_done(200, 0.02)
    est.transfer_done(200, 0.04)
    assert est.costs.transfer_s_per_token == pytest.approx(1.5e-4)


def test_pd_config_names_the_bad_flag():
    for kwargs, flag in [({"decision": "sometimes"}, "--pd-decision"), ({"max_local_prefill_length": -1},
                         "--max-local-prefill-length"), ({"local_budget_s": -0.001}, "--pd-local-budget-ms"),
                         ({"prefill_timeout_s": 0}, "--pd-prefill-timeout")]:
        with pytest.raises(ValueError, match=flag):
            PDConfig(**kwargs)


def test_prefill_body_asks_for_one_token_of_the_same_prompt():
    body = {"prompt": [1, 2, 3], "max_tokens": 50, "n": 3, "stream": True, "stream_options": {"include_usage": True},
            "logprobs": 2, "echo": True, "stop": ["\n"], "min_tokens": 5, "temperature": 0.7, "cache_salt": "t1",
            "kv_transfer_params": {"do_remote_prefill": True}}
    assert prefill_body(body) == {"prompt": [1, 2, 3], "max_tokens": 1, "n": 1, "stream": False, "temperature": 0.7,
                                  "cache_salt": "t1", "kv_transfer_params": {"do_remote_decode": True}}
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9, "logprobs": True,
            "top_logprobs": 2, "stop": "x"}
    assert prefill_body(chat) == {"messages": chat["messages"], "max_tokens": 1, "n": 1, "stream": False,
                                  "kv_transfer_params": {"do_remote_decode": True}}


# ---- flags and launch command lines ------------------------------------------------------------

def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_router_args(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize("argv, message", [
    (["--prefill", "http://a"], "--prefill without --decode: a prefill/decode router needs both"),
    (["--decode", "http://a", "--launch-pd", "1", "1"], "--decode without --prefill"),
    (["--prefill", "http://a", "--decode", "http://b", "--replica", "http://c"], "cannot be mixed with --replica"),
    (["--launch-pd", "1", "1", "--launch", "2"], "cannot be mixed with --replica or --launch"),
    (["--launch-pd", "0", "1"], r"--launch-pd P D starts P >= 1 prefill and D >= 1 decode engines, got 0 1"),
    (["--prefill", "http://a", "--decode", "http://b", "--", "--max-model-len", "64"], "engine flags after `--`"),
    (["--launch-pd", "1", "1", "--", "--kv-role", "both"], "--kv-role after `--`: the router sets it"),
    (["--launch", "2", "--", "--kv-transfer-config={}"], "--kv-transfer-config after `--`"),
    ([], "--prefill URL --decode URL or --launch-pd P D"),
])
def test_argument_errors(argv, message):
    with pytest.raises(ValueError, match=message):
        _check_args(parse(*argv))


def test_argument_error_exits_2_with_the_message(capsys):
    assert cli_main(["router", "--prefill", "http://127.0.0.1:1"]) == 2
    assert "kvserve: error: --prefill without --decode" in capsys.readouterr().err
    assert cli_main(["router", "--prefill", "http://a", "--decode", "http://b", "--pd-local-budget-ms", "-1"]) == 2
    assert "--pd-local-budget-ms must be >= 0" in capsys.readouterr().err


def test_pd_flags_and_roles():
    args = parse("--prefill", "http://p/", "--decode", "http://d", "--decode", "http://p", "--pd-decision",
                 "threshold", "--max-local-prefill-length", "64", "--pd-local-budget-ms", "20")
    assert _check_args(args) == []
    assert pd_config(args) == PDConfig("threshold", 64, 0.02)
    assert pd_roles(args.prefill, args.decode) == {"http://p": "both", "http://d": "decode"}
    assert pd_config(parse("--replica", "http://a", "--pd-decision", "always")) is None
    assert {"--kv-role", "--kv-transfer-config"} <= set(OWNED_FLAGS)


def test_launch_pd_command_lines():
    args = parse("--launch-pd", "1", "2", "--", "--max-model-len", "1024")
    engine_args = _check_args(args)
    roles = launch_roles(args)
    assert roles == ["prefill", "decode", "decode"]
    cmds = launch_commands(roles, engine_args, api_key="sk-1", kv_key_file="/run/kv.key")
    ports = []
    for (url, cmd), role in zip(cmds, roles):
        assert cmd[cmd.index("serve") + 1:cmd.index("serve") + 3] == ["--max-model-len", "1024"]
        flag = {a: b for a, b in itertools.pairwise(cmd) if a.startswith("--")}
        assert url == f"http://127.0.0.1:{flag['--port']}" and flag["--api-key"] == "sk-1"
        assert flag["--kv-role"] == role
        transfer = json.loads(flag["--kv-transfer-config"])
        ports += [int(flag["--port"]), int(flag["--kv-events-endpoint"].rsplit(":", 1)[1]),
                  int(flag["--kv-events-replay-endpoint"].rsplit(":", 1)[1])]
        if role == "prefill":
            assert transfer == {"kv_connector": "PDConnector", "kv_role": "kv_producer", "kv_ip": "127.0.0.1",
                                "kv_port": transfer["kv_port"],
                                "kv_connector_extra_config": {"auth_key_file": "/run/kv.key"}}
            ports.append(transfer["kv_port"])
        else:  # the launched prefill engine is a decode engine's only peer
            assert transfer == {"kv_connector": "PDConnector", "kv_role": "kv_consumer", "kv_connector_extra_config": {
                "auth_key_file": "/run/kv.key", "peers": [f"127.0.0.1:{ports[3]}"]}}
    assert len(set(ports)) == len(ports) == 10  # every port its own
    plain = launch_commands(launch_roles(parse("--launch", "2")), [])
    assert all("--kv-role" not in cmd and "--api-key" not in cmd for _, cmd in plain)


# ---- requests through a router over fake engines -----------------------------------------------

@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, FakeEngine]]:
    fakes = {"p0": FakeEngine("prefill", cached_tokens=2), "p1": FakeEngine("prefill"),
             "d0": FakeEngine("decode"), "d1": FakeEngine("decode"), "plain": FakeEngine(None)}
    yield fakes
    for f in fakes.values():
        f.close()


@pytest.fixture(autouse=True)
def _reset(request, monkeypatch):
    if "engines" in request.fixturenames:
        for f in request.getfixturevalue("engines").values():
            f.reset()

    async def no_tokenizer(*_: Any) -> None:
        return None  # fakes have no model: prompts are token ids here, or estimated from their text

    monkeypatch.setattr(router_app, "_load_tokenizer", no_tokenizer)


@contextlib.asynccontextmanager
async def pd_router(prefill: list[FakeEngine], decode: list[FakeEngine], policy: str = "kv_aware",
                    **config: Any) -> AsyncIterator[tuple[Router, httpx.AsyncClient]]:
    """A router over the fakes, in this process, and a client of its app; `config`: PDConfig's."""
    roles = pd_roles([f.url for f in prefill], [f.url for f in decode])
    router = await start_router(list(roles), policy, health_interval=60, roles=roles, pd=PDConfig(**config))
    try:
        transport = httpx.ASGITransport(app=build_app(router))
        async with httpx.AsyncClient(transport=transport, base_url="http://router", timeout=30) as client:
            yield router, client
    finally:
        await router.close()


def pd_metrics(text: str) -> dict[tuple[str, str], float]:
    out = {}
    for line in text.splitlines():
        if line.startswith("kvserve_router:pd_decisions_total{"):
            labels = dict(kv.split("=") for kv in line[line.index("{") + 1:line.index("}")].split(","))
            out[(labels["decision"].strip('"'), labels["reason"].strip('"'))] = float(line.rsplit(" ", 1)[1])
    return out


def completion(prompt_len: int = 40, **extra: Any) -> dict[str, Any]:
    return {"prompt": list(range(1, prompt_len + 1)), "max_tokens": 5, "temperature": 0, **extra}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_always_prefills_remotely_and_passes_the_params_on(engines):
    p0, d0 = engines["p0"], engines["d0"]

    async def go() -> None:
        async with pd_router([p0], [d0], decision="always") as (router, client):
            body = completion(n=2, logprobs=1, echo=True, stop=["\n"], user="u1")
            resp = await client.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-c"})
            assert resp.status_code == 200 and resp.headers["x-kvserve-replica"] == d0.url
            assert [c["text"] for c in resp.json()["choices"]] == ["remote", "remote"]
            (path, sent), = p0.posts
            assert path == "/v1/completions" and sent == prefill_body(body)
            params = _prefill_params(p0, d0)
            (path, got), = d0.posts
            assert got == {**body, "kv_transfer_params": params}  # the client's request, and exactly the params
            assert pd_metrics((await client.get("/metrics")).text) == {(REMOTE, "forced_always"): 1}
            listed = (await client.get("/replicas")).json()
            assert listed["pd_decision"] == "always"
            assert {r["url"]: (r["role"], r["requests_routed"], r["in_flight"]) for r in listed["replicas"]} == {
                p0.url: ("prefill", 1, 0), d0.url: ("decode", 1, 0)}
            # the prefill call measured the prefill rate: 40 prompt tokens, 2 of them cached
            est = router.proxy.estimator
            assert est.measured == {"prefill_tokens_per_s", "prefill_latency_s"}
            assert 0 < est.costs.prefill_latency_s < 5
            assert est.costs.prefill_tokens_per_s == pytest.approx(38 / est.costs.prefill_latency_s)
    run(go())


def _prefill_params(prefill: FakeEngine, decode: FakeEngine) -> dict[str, Any]:
    """What the prefill fake answered (it numbers its transfers), as the decode fake must get it."""
    params = decode.posts[-1][1]["kv_transfer_params"]
    assert params["remote_engine_id"] == prefill.url and params["remote_request_id"].startswith("xfer-")
    return params


def test_streamed_chat_with_n_samples_goes_through_the_decode_replica(engines):
    p0, d0 = engines["p0"], engines["d0"]

    async def go() -> None:
        async with pd_router([p0], [d0], decision="always") as (router, client):
            body = {"messages": [{"role": "user", "content": "Tell me a story."}], "max_completion_tokens": 8,
                    "n": 2, "stream": True, "stream_options": {"include_usage": True}, "logprobs": True}
            async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
                assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
                text = (await resp.aread()).decode()
            assert text == d0.reply(d0.posts[-1][1])[1]  # the decode replica's stream, byte for byte
            assert text.count('"text": "remote"') == 2 and text.endswith("data: [DONE]\n\n")
            sent = p0.posts[-1][1]
            assert (sent["n"], sent["stream"], sent["max_tokens"]) == (1, False, 1)
            assert not {"stream_options", "max_completion_tokens", "logprobs"} & set(sent)
            assert d0.posts[-1][1] == {**body, "kv_transfer_params": _prefill_params(p0, d0)}
            # a stream's first byte timed the transfer
            assert "transfer_s_per_token" in router.proxy.estimator.measured
    run(go())


def test_never_sends_the_clients_bytes_and_drops_client_params(engines):
    p0, d0 = engines["p0"], engines["d0"]

    async def go() -> None:
        async with pd_router([p0], [d0], decision="never") as (_, client):
            raw = b'{"prompt":  [5, 6, 7],\n "max_tokens": 2}'
            resp = await client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
            assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "local"
            assert d0.raw == [raw] and not p0.posts
            # a client's own kv_transfer_params would make the decode replica pull from anywhere
            sneaky = {"prompt": [5, 6, 7], "kv_transfer_params": {"do_remote_prefill": True, "remote_host": "evil"}}
            resp = await client.post("/v1/completions", json=sneaky)
            assert resp.status_code == 200 and "kv_transfer_params" not in d0.posts[-1][1]
            assert pd_metrics((await client.get("/metrics")).text) == {(LOCAL, "forced_never"): 2}
    run(go())


def test_a_batch_of_prompts_is_prefilled_locally(engines):
    p0, d0 = engines["p0"], engines["d0"]

    async def go() -> None:
        async with pd_router([p0], [d0], decision="always") as (_, client):
            for prompt in (["one", "two"], [[1, 2, 3], [4, 5, 6]]):
                resp = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})
                assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "local"
            resp = await client.post("/v1/completions", json={"prompt": ["just one"], "max_tokens": 2})
            assert resp.json()["choices"][0]["text"] == "remote"
            decisions = pd_metrics((await client.get("/metrics")).text)
            assert decisions == {(LOCAL, "batch"): 2, (REMOTE, "forced_always"): 1}
    run(go())


class HoldsBlocks:
    """Stands in for a decode replica's KV event mirror: it holds the first `n` blocks of any prompt."""

    def __init__(self, n: int) -> None:
        self.n = n

    def match(self, hashes: list[bytes]) -> list[str]:
        return ["device"] * min(self.n, len(hashes))

    def close(self) -> None:
        pass


def test_threshold_counts_what_the_decode_replica_holds(engines):
    p0, d0 = engines["p0"], engines["d0"]

    async def go() -> None:
        async with pd_router([p0], [d0], decision="threshold", max_local_prefill_length=20) as (router, client):
            for held, where in ((2, "local"), (0, "remote")):  # 40 tokens, 2 blocks of 16 held: 8 left
                router.replicas.by_url(d0.url).view.kv_events = HoldsBlocks(held)
                resp = await client.post("/v1/completions", json=completion(40))
                assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == where
            assert len(p0.posts) == 1
            decisions = pd_metrics((await client.get("/metrics")).text)
            assert decisions == {(LOCAL, "threshold"): 1, (REMOTE, "threshold"): 1}
    run(go())


def test_conditional_follows_the_injected_costs(engines):
    p0, d0 = engines["p0"], engines["d0"]

    async def go() -> None:
        async with pd_router([p0], [d0], decision="conditional") as (router, client):
            est, prefill_view = router.proxy.estimator, router.replicas.by_url(p0.url).view
            cases = [(40, 0, "short_prompt"),  # 40 ms at 1000 tokens/s
                     (400, 0, "remote_cheaper"),  # 0.4 s local; 0.44 s remote
                     (400, 3, "prefill_queue")]  # + 3 x 0.5 s queued on the prefill replica
            for n, queued, reason in cases:
                est.costs = COSTS  # measurements of the previous calls must not count here
                prefill_view.in_flight = queued
                resp = await client.post("/v1/completions", json=completion(n))
                prefill_view.in_flight = 0
                assert resp.status_code == 200, resp.text
                assert resp.json()["choices"][0]["text"] == ("remote" if reason == "remote_cheaper" else "local")
            assert pd_metrics((await client.get("/metrics")).text) == {
                (LOCAL, "short_prompt"): 1, (REMOTE, "remote_cheaper"): 1, (LOCAL, "prefill_queue"): 1}
    run(go())


@pytest.mark.parametrize("mode", ["500", "400", "reset", "slow", "no_params", "empty_params"])
def test_a_failed_prefill_falls_back_to_local(engines, mode):
    p0, d0 = engines["p0"], engines["d0"]
    p0.mode, p0.delay = mode, 1.0

    async def go() -> None:
        async with pd_router([p0], [d0], decision="always", prefill_timeout_s=0.2) as (router, client):
            for stream in (False, True):
                resp = await client.post("/v1/completions", json=completion(stream=stream))
                assert resp.status_code == 200 and resp.headers["x-kvserve-replica"] == d0.url
                assert '"text": "local"' in resp.text if stream else resp.json()["choices"][0]["text"] == "local"
                assert "kv_transfer_params" not in d0.posts[-1][1]
            assert len(p0.posts) == 2
            assert pd_metrics((await client.get("/metrics")).text) == {(LOCAL, "prefill_failed"): 2}
            views = {r.url: r.view for r in router.replicas.replicas}
            assert all(v.in_flight == v.pending_prefill_tokens == v.decode_streams == 0 for v in views.values())
            assert not router.proxy.estimator.measured
    run(go())


def test_a_failed_decode_replica_is_retried_with_a_prefill_of_its_own(engines):
    p0, d0, d1 = engines["p0"], engines["d0"], engines["d1"]
    d0.mode = "500"

    async def go() -> None:
        # round robin over [d0, d1] tries d0 first each time (its retry, over [d1] alone, takes a turn)
        async with pd_router([p0], [d0, d1], policy="round_robin", decision="always") as (_, client):
            for _ in range(3):
                resp = await client.post("/v1/completions", json=completion())
                assert resp.status_code == 200 and resp.headers["x-kvserve-replica"] == d1.url
            assert 'kvserve_router:retries_total{reason="status_500"} 3.0' in (await client.get("/metrics")).text
    run(go())
    # each decode attempt had its own prefill: params that one replica may have used are never reused
    sent = [body["kv_transfer_params"]["remote_request_id"] for _, body in d0.posts + d1.posts]
    assert (len(d0.posts), len(d1.posts), len(p0.posts)) == (3, 3, 6) and len(set(sent)) == 6


def test_without_a_prefill_replica_decode_replicas_prefill(engines):
    p0, d0 = engines["p0"], engines["d0"]
    p0.health = 503  # down at start: never taken in

    async def go() -> None:
        async with pd_router([p0], [d0], decision="always") as (_, client):
            resp = await client.post("/v1/completions", json=completion())
            assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == "local"
            assert pd_metrics((await client.get("/metrics")).text) == {(LOCAL, "no_prefill_replica"): 1}
            assert (await client.get("/health")).status_code == 200
    run(go())
    assert not p0.posts


def test_prefill_replicas_alone_are_not_healthy(engines):
    p0, d0 = engines["p0"], engines["d0"]
    d0.health = 503

    async def go() -> None:
        async with pd_router([p0], [d0]) as (_, client):
            resp = await client.get("/health")
            assert resp.status_code == 503 and "no healthy decode replica" in resp.json()["error"]["message"]
            resp = await client.post("/v1/completions", json=completion())
            assert resp.status_code == 503 and not p0.posts
    run(go())


def test_replicas_and_metrics_show_roles_and_estimates(engines):
    p0, p1, d0 = engines["p0"], engines["p1"], engines["d0"]

    async def go() -> None:
        # p1 given as both: an engine with --kv-role both decodes too, and prefills for d0
        async with pd_router([p0, p1], [d0, p1]) as (router, client):
            listed = (await client.get("/replicas")).json()
            assert listed["pd_decision"] == "conditional"
            assert {r["url"]: r["role"] for r in listed["replicas"]} == {p0.url: "prefill", p1.url: "both",
                                                                         d0.url: "decode"}
            text = (await client.get("/metrics")).text
            costs = router.proxy.estimator.costs
            assert f"kvserve_router:pd_prefill_tokens_per_second {costs.prefill_tokens_per_s:.1f}" in text
            assert "kvserve_router:pd_transfer_seconds_per_token " in text
            assert "# TYPE kvserve_router:pd_decisions_total counter" in text
    run(go())


def test_plain_replicas_keep_their_role_and_get_no_params(engines):
    plain = engines["plain"]

    async def go() -> None:
        router = await start_router([plain.url], policy="least_load", health_interval=60)
        try:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(router)),
                                         base_url="http://router") as client:
                listed = (await client.get("/replicas")).json()
                assert listed["pd_decision"] is None and listed["replicas"][0]["role"] == "both"
                resp = await client.post("/v1/completions", json=completion())
                assert resp.status_code == 200 and "pd_decisions" not in (await client.get("/metrics")).text
        finally:
            await router.close()
    run(go())
    assert "kv_transfer_params" not in plain.posts[-1][1]


def test_router_command_over_prefill_and_decode_urls(engines, tmp_path):
    """The `kvserve router` process: flags to roles, the start-up lines, a request end to end."""
    p0, p1, d0 = engines["p0"], engines["p1"], engines["d0"]
    r = spawn_router(["--prefill", p0.url, "--prefill", p1.url + "/", "--decode", d0.url, "--decode", p1.url,
                      "--policy", "least_load", "--pd-decision", "always"], tmp_path / "router.log")
    try:
        wait_router(r)
        listed = r.replicas()
        assert {u: x["role"] for u, x in listed.items()} == {p0.url: "prefill", p1.url: "both", d0.url: "decode"}
        log = r.log.read_text()
        assert f"prefill replica {p0.url} (external" in log and f"prefill+decode replica {p1.url} (external" in log, log
        assert "P/D decision always, serving at" in log
        status, body, hdrs = http_request("POST", f"{r.base}/v1/completions", completion())
        assert status == 200 and json.loads(body)["choices"][0]["text"] == "remote", body
    finally:
        r.stop()
