"""Cache-aware routing with real processes: kv_aware over replicas with KV events (a restarted
router rebuilds its index from their replay endpoints; a replica computing other K/V is
refused), and approx over replicas that publish nothing."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.router.router_procs import REPLICA, Replica, spawn_router, stop_all, wait_router, wait_until
from tests.serving import http_request

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def replicas(cluster, tmp_path_factory) -> Iterator[dict[str, list[Replica]]]:
    """Two of the shared replicas (KV events on), two without events, one with events whose
    K/V differ (-q none)."""
    logs = tmp_path_factory.mktemp("cache-replicas")
    groups = {"events": cluster[:2],
              "plain": [Replica(logs / f"plain-{i}.log", events=None) for i in range(2)],
              "other": [Replica(logs / "other.log", extra=["-q", "none"])]}
    every = [r for g in ("plain", "other") for r in groups[g]]
    try:
        for r in every:
            r.start()
        with ThreadPoolExecutor(len(every)) as ex:
            list(ex.map(Replica.wait_healthy, every))
        yield groups
    finally:
        stop_all([r.proc for r in every if r.proc is not None])


def _prefix(n_words: int) -> str:
    rng = random.Random(time.time_ns())
    return "Shared context for the cache routing test. " + " ".join(f"w{rng.randrange(10**6)}" for _ in range(n_words))


def _complete(base: str, prompt: str) -> tuple[str, int, str]:
    status, body, hdrs = http_request("POST", f"{base}/v1/completions",
                                      {"prompt": prompt, "max_tokens": 2, "temperature": 0}, timeout=120)
    assert status == 200, body
    usage = json.loads(body)["usage"]
    return hdrs[REPLICA], usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]


def _decisions(base: str, policy: str) -> dict[str, float]:
    _, body, _ = http_request("GET", f"{base}/metrics")
    out = {}
    for line in body.decode().splitlines():
        if line.startswith(f'kvserve_router:decisions_total{{policy="{policy}"'):
            reason = line.split('reason="')[1].split('"')[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


def _wait_synced(router) -> None:
    wait_until("the router's KV event mirrors to sync",
               lambda: all(r["kv_events"]["synced"] for r in router.replicas().values()), 30)


def test_kv_aware_follows_the_blocks_and_a_restarted_router_rebuilds_its_index(replicas, tmp_path):
    urls = [a for r in replicas["events"] for a in ("--replica", r.url)]
    router = wait_router(spawn_router([*urls, "--policy", "kv_aware"], tmp_path / "router1.log"))
    try:
        _wait_synced(router)
        prefix = _prefix(60)  # ~420 tokens: dozens of blocks either replica could hold
        home, cached, _ = _complete(router.base, prefix + " Question 0?")
        assert cached == 0
        time.sleep(0.3)  # events reach the mirror within ~20 ms
        for i in range(1, 4):
            where, cached, n_prompt = _complete(router.base, prefix + f" Question {i}?")
            assert where == home and cached >= n_prompt - 32, (where, home, cached, n_prompt)
        assert _decisions(router.base, "kv_aware").get("cache_hit", 0) >= 3
    finally:
        router.stop()

    # A new router process knows nothing but what the replicas' replay endpoints tell it.
    router = wait_router(spawn_router([*urls, "--policy", "kv_aware"], tmp_path / "router2.log"))
    try:
        _wait_synced(router)
        where, cached, n_prompt = _complete(router.base, prefix + " Question 9?")
        assert where == home and cached >= n_prompt - 32
        assert _decisions(router.base, "kv_aware") == {"cache_hit": 1.0}
    finally:
        router.stop()


def test_a_replica_that_computes_other_kv_is_refused_at_start(replicas, tmp_path):
    good, other = replicas["events"][0], replicas["other"][0]
    router = spawn_router(["--replica", good.url, "--replica", other.url], tmp_path / "router.log")
    assert router.proc.wait(120) == 2
    log = router.log.read_text()
    assert "model_fingerprint differs" in log and good.url in log and other.url in log, log
    stop_all([router.proc])


def test_approx_routes_by_text_to_replicas_without_events(replicas, tmp_path):
    plain = replicas["plain"]
    urls = [a for r in plain for a in ("--replica", r.url)]
    router = wait_router(spawn_router([*urls, "--policy", "approx"], tmp_path / "router.log"))
    try:
        listed = router.replicas()
        assert all(not r["kv_events"]["enabled"] for r in listed.values())
        homes = {}
        for k in range(2):  # two prefixes: each stays where it first went
            prefix = _prefix(40)
            homes[k], _, _ = _complete(router.base, prefix + " First question?")
            for i in range(3):
                where, cached, n_prompt = _complete(router.base, prefix + f" Question {i}?")
                assert where == homes[k] and cached >= n_prompt - 32
        assert homes[0] != homes[1]  # a new prefix goes to the replica that has seen less text
        assert _decisions(router.base, "approx").get("cache_hit", 0) >= 6
    finally:
        router.stop()
