"""The router's load-only policies (round robin, least load, session affinity) and the registry
entry points: `load_policies()` imports every policy module so it registers, `make_policy(name)`
builds one. The prefix / KV-aware policies live in their own modules (kv_aware.py, approx.py).
"""

from __future__ import annotations

import bisect
import hashlib
import importlib
import itertools
import math
import random
from typing import Any

from kvserve.router.policy import POLICIES, Decision, Policy, ReplicaView, RouteRequest, register

# Policy modules outside this file; each registers its policies when imported.
POLICY_MODULES = ("kvserve.router.kv_aware", "kvserve.router.approx")


@register
class RoundRobin(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = itertools.count()

    def choose(self, req: RouteRequest, replicas: list[ReplicaView]) -> Decision:
        return Decision(replicas[next(self._next) % len(replicas)], "round_robin")


def least_loaded(replicas: list[ReplicaView], rng: random.Random) -> ReplicaView:
    """Smallest load; ties by fewer requests in flight, then at random (so equal replicas share)."""
    best = min((r.load, r.in_flight) for r in replicas)
    return rng.choice([r for r in replicas if (r.load, r.in_flight) == best])


@register
class LeastLoad(Policy):
    name = "least_load"

    def __init__(self, seed: int | None = None) -> None:
        self._rng = random.Random(seed)

    def choose(self, req: RouteRequest, replicas: list[ReplicaView]) -> Decision:
        return Decision(least_loaded(replicas, self._rng), "least_load")


def _ring_point(key: str) -> int:
    # hashlib, not hash(): the ring must be the same in every router process and every run.
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big")


@register
class SessionAffinity(Policy):
    """Consistent hashing of the session key with bounded loads (Mirrokni, Thorup, Zadimoghaddam,
    "Consistent Hashing with Bounded Loads", 2018).

    Each replica owns `virtual_nodes` points on a ring; a session goes to the first replica
    clockwise from its key's point. Only the sessions of a replica that leaves move (to the next
    replica on the ring), and they move back when it returns. A replica that would go over
    ceil(c * (total_in_flight + 1) / n) requests is skipped so one hot session cannot pile its
    whole load on one replica; c = `load_factor`.
    """

    name = "session"

    def __init__(self, load_factor: float = 1.25, virtual_nodes: int = 100, seed: int | None = None) -> None:
        if load_factor < 1:
            raise ValueError(f"session policy: load_factor must be >= 1, got {load_factor}")
        if virtual_nodes < 1:
            raise ValueError(f"session policy: virtual_nodes must be >= 1, got {virtual_nodes}")
        self.load_factor, self.virtual_nodes = load_factor, virtual_nodes
        self._rng = random.Random(seed)
        self._ring_urls: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[str] = []

    def _ring(self, urls: tuple[str, ...]) -> None:
        """(Re)build the ring for this set of replicas; points depend only on the URLs."""
        if urls == self._ring_urls:
            return
        pairs = sorted((_ring_point(f"{u}#{i}"), u) for u in urls for i in range(self.virtual_nodes))
        self._points = [p for p, _ in pairs]
        self._owners = [u for _, u in pairs]
        self._ring_urls = urls

    def walk(self, key: str, urls: tuple[str, ...]) -> list[str]:
        """The replicas in ring order starting at the key's point, each once: its preference list."""
        self._ring(tuple(sorted(urls)))
        start = bisect.bisect(self._points, _ring_point(key))
        seen: dict[str, None] = {}
        n = len(self._owners)
        for i in range(n):
            seen.setdefault(self._owners[(start + i) % n], None)
            if len(seen) == len(urls):
                break
        return list(seen)

    def choose(self, req: RouteRequest, replicas: list[ReplicaView]) -> Decision:
        if not req.session_key:
            return Decision(least_loaded(replicas, self._rng), "no_session")
        by_url = {r.url: r for r in replicas}
        order = self.walk(req.session_key, tuple(by_url))
        total = sum(r.in_flight for r in replicas)
        bound = math.ceil(self.load_factor * (total + 1) / len(replicas))
        for i, url in enumerate(order):
            # The bound always leaves room somewhere (it is at least the mean load + 1).
            if by_url[url].in_flight + 1 <= bound:
                return Decision(by_url[url], "session" if i == 0 else "bounded_load")
        return Decision(by_url[order[0]], "session")


def load_policies() -> dict[str, type[Policy]]:
    """Import the policy modules, so they register; returns the registry."""
    for module in POLICY_MODULES:
        importlib.import_module(module)
    return POLICIES


def make_policy(name: str, **options: Any) -> Policy:
    policies = load_policies()
    if name not in policies:
        raise ValueError(f"--policy: unknown router policy {name!r}; known: {', '.join(sorted(policies))}")
    return policies[name](**options)
