"""The router's replica set: one ReplicaView per `kvserve serve` replica, kept current.

At start every replica is probed (/health, /kv_events, /v1/models). Replicas whose block
size, hash scheme or model fingerprint differ are refused: the chain hashes of one would
never match the other's, so a cache-aware router would silently see 0% hits. A replica
that publishes KV events gets a KVEventSubscriber (its block mirror, read by the policies).
A health loop takes a replica out at its first failed check (the policy is told, so it
forgets what it learned) and takes it back, re-probed, when it answers again.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

from kvserve.config import KVEventsConfig
from kvserve.core.kv_events import KVEventSubscriber
from kvserve.router.policy import Policy, ReplicaView

logger = logging.getLogger(__name__)

# What every replica must agree on for prefix hashes to mean the same thing everywhere.
MATCHING_FIELDS = ("block_size", "hash_scheme", "model_fingerprint")
DEFAULT_HEALTH_INTERVAL = 2.0
HEALTH_TIMEOUT = 5.0  # a replica busy on a loaded CPU can be slow to answer; longer is "down"
_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]")


@dataclass
class Replica:
    view: ReplicaView
    pid: int | None = None  # set when the router launched it
    # "prefill" or "decode" (--prefill / --decode: an engine with that --kv-role), or "both": a
    # plain replica, or a URL given as both (an engine with --kv-role both)
    role: str = "both"
    kv_info: dict[str, Any] = field(default_factory=dict)  # its /kv_events answer
    model_path: str | None = None
    excluded: str | None = None  # why a replica that answers is kept out (its settings differ)
    last_error: str | None = None  # why the last health check failed
    routed: int = 0  # requests whose reply started here

    @property
    def url(self) -> str:
        return self.view.url


class Lease:
    """One request's share of a replica's load, from routing to its last byte."""

    def __init__(self, replica: Replica, prompt_tokens: int) -> None:
        self.view, self.tokens = replica.view, prompt_tokens
        self._prefill, self._decoding, self._open = True, False, True
        self.view.in_flight += 1
        self.view.pending_prefill_tokens += prompt_tokens

    def first_byte(self, streaming: bool) -> None:
        """The reply started: its prompt is prefilled; a stream now decodes."""
        if self._prefill:
            self._prefill = False
            self.view.pending_prefill_tokens -= self.tokens
            if streaming:
                self._decoding = True
                self.view.decode_streams += 1

    def release(self) -> None:
        if not self._open:
            return
        self.first_byte(streaming=False)
        self._open = False
        self.view.in_flight -= 1
        if self._decoding:
            self.view.decode_streams -= 1


def events_address(addr: str, replica_url: str) -> str:
    """A replica's ZMQ address as seen from here: a wildcard bind host becomes the replica's host."""
    if not addr.startswith("tcp://"):
        return addr
    host, _, port = addr.removeprefix("tcp://").rpartition(":")
    if host in _WILDCARD_HOSTS:
        host = urlsplit(replica_url).hostname or "127.0.0.1"
        host = f"[{host}]" if ":" in host else host
    return f"tcp://{host}:{port}"


class ReplicaSet:
    """The replicas, their health and their event subscribers; the policy sees `healthy()`."""

    def __init__(self, urls: list[str], policy: Policy, client: httpx.AsyncClient,
                 health_interval: float = DEFAULT_HEALTH_INTERVAL, headers: dict[str, str] | None = None,
                 pids: dict[str, int] | None = None, roles: dict[str, str] | None = None) -> None:
        if not urls:
            raise ValueError("--replica: give at least one replica URL (or --launch N)")
        if health_interval <= 0:
            raise ValueError(f"--health-interval must be > 0 seconds, got {health_interval}")
        self.replicas = [Replica(ReplicaView(u.rstrip("/"), healthy=False), (pids or {}).get(u),
                                 (roles or {}).get(u.rstrip("/"), "both"))
                         for u in dict.fromkeys(urls)]
        self.policy, self.client = policy, client
        self.health_interval = health_interval
        self.headers = headers or {}  # Authorization of --upstream-api-key: on probes and forwarded requests
        self.reference: dict[str, tuple[Any, str]] = {}  # field -> (value, replica that set it)
        self._locks = {r.url: asyncio.Lock() for r in self.replicas}
        self._tasks: set[asyncio.Task] = set()
        self._loop: asyncio.Task | None = None

    # ---- life cycle ---------------------------------------------------------------

    async def start(self) -> None:
        """Probe every replica; raise ValueError if two disagree on a MATCHING_FIELDS value."""
        up = await asyncio.gather(*(self._probe(r) for r in self.replicas))
        errors = [e for r, ok in zip(self.replicas, up) if ok and (e := self._mismatch(r))]
        if errors:
            raise ValueError("replicas are incompatible (routing by prefix would never hit):\n  "
                             + "\n  ".join(errors))
        for r, ok in zip(self.replicas, up):
            if ok:
                self._admit(r)
        self._loop = asyncio.create_task(self._health_loop())

    async def close(self) -> None:
        for t in [self._loop, *self._tasks]:
            if t is not None:
                t.cancel()
        subs = [r.view.kv_events for r in self.replicas if r.view.kv_events is not None]
        for r in self.replicas:
            r.view.kv_events = None
        # close() joins the subscriber's thread: not on the event loop
        await asyncio.gather(*(asyncio.to_thread(s.close) for s in subs))

    # ---- queries ----------------------------------------------------------------

    def healthy(self, role: str | None = None) -> list[Replica]:
        """The healthy replicas; with a role, those that serve it ("both" serves either)."""
        return [r for r in self.replicas if r.view.healthy and (role is None or r.role in (role, "both"))]

    def by_url(self, url: str) -> Replica:
        return next(r for r in self.replicas if r.url == url)

    def model_path(self) -> str | None:
        return next((r.model_path for r in self.replicas if r.model_path), None)

    def max_model_len(self) -> int | None:
        """The longest context a replica reports (its /kv_events), None if none reports one."""
        return max((n for r in self.replicas if isinstance(n := r.kv_info.get("max_model_len"), int)), default=None)

    def describe(self) -> list[dict[str, Any]]:
        out = []
        for r in self.replicas:
            sub = r.view.kv_events
            out.append({
                "url": r.url, "role": r.role, "healthy": r.view.healthy, "in_flight": r.view.in_flight,
                "pending_prefill_tokens": r.view.pending_prefill_tokens, "decode_streams": r.view.decode_streams,
                "load": r.view.load, "requests_routed": r.routed, "pid": r.pid, "block_size": r.view.block_size,
                "kv_events": {"enabled": sub is not None, "synced": sub is not None and sub.synced.is_set(),
                              "endpoint": sub.endpoint if sub else None},
                "error": r.excluded or (None if r.view.healthy else r.last_error)})
        return out

    # ---- health -----------------------------------------------------------------

    def check_soon(self, r: Replica) -> None:
        """A request just failed on `r`: check it now rather than at the next tick."""
        self._spawn(self.check(r))

    async def check(self, r: Replica) -> None:
        async with self._locks[r.url]:
            ok = await self._health_ok(r)
            if ok and not r.view.healthy:
                # It came back, perhaps restarted with other settings: probe it before taking it in.
                if await self._probe(r):
                    r.excluded = self._mismatch(r)
                    if r.excluded:
                        logger.error("router: keeping %s out: %s", r.url, r.excluded)
                    else:
                        self._admit(r)
            elif not ok and r.view.healthy:
                r.view.healthy = False
                self.policy.on_replica_removed(r.url)
                logger.warning("router: replica %s is unhealthy (%s); routing around it", r.url, r.last_error)

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            await asyncio.gather(*(self.check(r) for r in self.replicas), return_exceptions=True)

    async def _health_ok(self, r: Replica) -> bool:
        try:
            resp = await self.client.get(f"{r.url}/health", headers=self.headers, timeout=HEALTH_TIMEOUT)
        except httpx.HTTPError as e:
            r.last_error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            return False
        r.last_error = None if resp.status_code == 200 else f"/health answered {resp.status_code}"
        return resp.status_code == 200

    # ---- probing ----------------------------------------------------------------

    async def _probe(self, r: Replica) -> bool:
        """Read what the replica says about itself; False if it does not answer /health."""
        if not await self._health_ok(r):
            return False
        try:
            info = await self._get_json(r, "/kv_events")
            models = await self._get_json(r, "/v1/models")
        except httpx.HTTPError as e:
            r.last_error = f"probe failed: {type(e).__name__}: {e}"
            return False
        r.kv_info = info or {"enabled": False}  # a replica without /kv_events publishes none
        cards = (models or {}).get("data") or [{}]
        r.model_path = r.kv_info.get("model_path") or cards[0].get("root")
        r.view.block_size = r.kv_info.get("block_size")
        return True

    async def _get_json(self, r: Replica, path: str) -> dict[str, Any] | None:
        resp = await self.client.get(f"{r.url}{path}", headers=self.headers, timeout=HEALTH_TIMEOUT)
        if resp.status_code != 200:
            return None  # 404: an older replica without the route; 401: a key we do not have
        return resp.json()

    def _mismatch(self, r: Replica) -> str | None:
        """Why `r` cannot join the replicas seen so far (None: it can); the first to report a
        field sets the value the others must match."""
        for name in MATCHING_FIELDS:
            value, (ref, ref_url) = r.kv_info.get(name), self.reference.get(name, (None, ""))
            if value is not None and ref is not None and value != ref:
                hint = (" (it covers the weights, the compute dtype, the quantization and the KV cache dtype; "
                        "--dtype auto may choose differently on machines that differ: give every engine "
                        "the same --dtype)") if name == "model_fingerprint" else ""
                return f"{name} differs: {ref_url} has {ref!r}, {r.url} has {value!r}{hint}"
        for name in MATCHING_FIELDS:
            if r.kv_info.get(name) is not None:
                self.reference.setdefault(name, (r.kv_info[name], r.url))
        return None

    def _admit(self, r: Replica) -> None:
        r.excluded = None
        self._subscribe(r)
        r.view.healthy = True
        logger.info("router: replica %s is healthy", r.url)

    def _subscribe(self, r: Replica) -> None:
        """A subscriber for the replica's current event endpoints (ZMQ reconnects by itself
        across restarts on the same endpoints; new endpoints need a new subscriber)."""
        info, old = r.kv_info, r.view.kv_events
        if not info.get("enabled") or not info.get("endpoint"):
            endpoints = None
        else:
            # a replica that names no replay endpoint uses the engine's default (KVEventsConfig.replay)
            replay = info.get("replay_endpoint") or KVEventsConfig(endpoint=info["endpoint"]).replay
            endpoints = (events_address(info["endpoint"], r.url), events_address(replay, r.url))
        if old is not None and endpoints == (old.endpoint, old.replay_endpoint):
            return
        if old is not None:
            self._spawn(asyncio.to_thread(old.close))
        r.view.kv_events = KVEventSubscriber(*endpoints) if endpoints else None

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
