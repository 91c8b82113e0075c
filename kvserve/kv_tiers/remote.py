"""RemoteTier: blobs in a Redis server shared by several replicas.

Size and eviction are the server's job, not ours: run it with ``maxmemory``
and ``maxmemory-policy allkeys-lru`` (e.g. ``redis-server --maxmemory 8gb
--maxmemory-policy allkeys-lru``) so that it drops the least recently used
blocks by itself. Every replica then sees one LRU across the fleet, and no
replica has to coordinate counts with the others.

The remote tier is an optimisation, never a dependency: when Redis is down or
slow, each call fails fast (one attempt, bounded by the socket timeout), the
tier logs one warning, and for `retry_interval_s` it answers "absent" /
"not stored" without touching the network. After that the next call tries
again; the first success logs "reconnected". Size `socket_timeout_s` for the
largest blob: a put that takes longer is treated as the server being down.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from typing import TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvserve.kv_tiers.base import KVTier, StatValue

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
# Errors that mean "the server is not reachable"; anything else is a refused command.
_UNREACHABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
_CLEAR_BATCH = 500


def _glob_escape(prefix: bytes) -> bytes:
    """Escape Redis glob metacharacters so SCAN MATCH treats the prefix literally."""
    return re.sub(rb"([\\*?\[\]])", rb"\\\1", prefix)


class RemoteTier(KVTier):
    """Redis-backed tier. Keys are stored as `key_prefix + key`.

    Thread-safe: redis-py's client draws a connection per call from its pool;
    our own state (the up / down flag and counters) sits behind one lock.
    `entries` and `bytes_used` in `stats()` are server-wide (DBSIZE and
    used_memory), which assumes a server dedicated to the KV cache.
    """

    name = "remote"

    def __init__(self, url: str, key_prefix: bytes = b"kvserve:", retry_interval_s: float = 2.0,
                 socket_timeout_s: float = 1.0) -> None:
        """Build the client; no connection is made yet. A malformed `url` raises ValueError."""
        self.key_prefix = key_prefix
        self.retry_interval_s = retry_interval_s
        # One attempt per call: retries with backoff inside a call (redis.Redis()'s
        # own default since redis-py 6) would block far past the socket timeout.
        # from_url does not retry today; being explicit keeps it that way.
        self._client = redis.Redis.from_url(url, socket_timeout=socket_timeout_s,
                                            socket_connect_timeout=socket_timeout_s,
                                            retry=Retry(NoBackoff(), 0), health_check_interval=0)
        self._where = self._describe()
        self._lock = threading.Lock()
        self._down_since: float | None = None
        self._closed = False
        self._logged_errors: set[str] = set()
        self._hits = self._misses = self._errors = 0

    def _describe(self) -> str:
        """host:port/db of the server, without credentials, for log lines."""
        kw = self._client.connection_pool.connection_kwargs
        if "path" in kw:
            return f"unix:{kw['path']}"
        return f"{kw.get('host', 'localhost')}:{kw.get('port', 6379)}/{kw.get('db', 0)}"

    def _k(self, key: bytes) -> bytes:
        return self.key_prefix + key

    # -- availability ---------------------------------------------------------------

    def _may_try(self) -> bool:
        with self._lock:
            if self._closed:
                return False
            return self._down_since is None or time.monotonic() - self._down_since >= self.retry_interval_s

    def _mark_down(self, what: str, e: BaseException) -> None:
        with self._lock:
            first = self._down_since is None
            self._down_since = time.monotonic()
            self._errors += 1
        if first:
            logger.warning("remote KV tier unavailable (%s on %s failed: %s); carrying on with local tiers, "
                           "retrying every %.1fs", what, self._where, e, self.retry_interval_s)

    def _mark_up(self) -> None:
        with self._lock:
            was_down = self._down_since is not None
            self._down_since = None
        if was_down:
            logger.info("remote KV tier reconnected to %s", self._where)

    def _call(self, what: str, op: Callable[[redis.Redis], _T], default: _T) -> _T:
        """Run `op` against the server, or return `default` without raising."""
        if not self._may_try():
            return default
        try:
            result = op(self._client)
        except _UNREACHABLE as e:
            self._mark_down(what, e)
            return default
        except Exception as e:  # noqa: BLE001 - the tier contract is "never raise"
            # A refused command (OOM under noeviction, ACL, ...): the server is
            # up, so stay available; warn once per kind of failure.
            with self._lock:
                self._errors += 1
                tag = f"{what}:{type(e).__name__}"
                first = tag not in self._logged_errors
                self._logged_errors.add(tag)
            (logger.warning if first else logger.debug)("remote KV tier: %s on %s failed: %s", what, self._where, e)
            self._mark_up()
            return default
        self._mark_up()
        return result

    # -- KVTier ---------------------------------------------------------------------

    def get(self, key: bytes) -> bytes | None:
        blob = self._call("get", lambda c: c.get(self._k(key)), None)
        with self._lock:
            if blob is None:
                self._misses += 1
            else:
                self._hits += 1
        return blob

    def put(self, key: bytes, blob: bytes) -> bool:
        return self._call("put", lambda c: bool(c.set(self._k(key), blob)), False)

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        """One pipelined round trip of EXISTS."""
        if not keys:
            return []

        def op(c: redis.Redis) -> list[bool]:
            pipe = c.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._k(key))
            return [bool(r) for r in pipe.execute()]

        return self._call("contains_many", op, [False] * len(keys))

    def delete(self, key: bytes) -> None:
        self._call("delete", lambda c: c.delete(self._k(key)), 0)

    def clear(self) -> int:
        """Delete keys under our prefix (SCAN + DEL in batches), never FLUSHALL:
        the server may hold other tenants' keys. Best effort: if the server
        goes away midway, returns 0 and the rest stays."""

        def op(c: redis.Redis) -> int:
            n = 0
            batch: list[bytes] = []
            for k in c.scan_iter(match=_glob_escape(self.key_prefix) + b"*", count=1000):
                batch.append(k)
                if len(batch) >= _CLEAR_BATCH:
                    n += c.delete(*batch)
                    batch = []
            if batch:
                n += c.delete(*batch)
            return n

        return self._call("clear", op, 0)

    def stats(self) -> dict[str, StatValue]:
        def op(c: redis.Redis) -> tuple[int, int, int]:
            entries = int(c.dbsize())
            used = int(c.info("memory").get("used_memory", 0))
            try:
                capacity = int(c.config_get("maxmemory").get("maxmemory", 0))
            except redis.exceptions.ResponseError:
                capacity = 0  # CONFIG is often disabled on managed servers
            return entries, used, capacity

        res = self._call("stats", op, None)
        with self._lock:
            out: dict[str, StatValue] = {"hits": self._hits, "misses": self._misses, "errors": self._errors}
        entries, used, capacity = res if res is not None else (0, 0, 0)
        out.update(entries=entries, bytes_used=used, capacity_bytes=capacity, available=res is not None)
        return out

    def close(self) -> None:
        with self._lock:
            self._closed = True
        try:
            self._client.close()
        except Exception as e:  # noqa: BLE001 - closing must not raise either
            logger.debug("remote KV tier: close failed: %s", e)
