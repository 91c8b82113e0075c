"""TierStore: the tiers below the device pool behind one interface (contains, put, get, fetch,
remove), as LMCache puts its storage backends behind one.

    put:   host RAM --LRU evict (admission by hits)--> disk, remote  (the writer thread)
    get:   host RAM (the step path: memory only)
    fetch: disk, then remote (the reader thread: TierManager's prefetch)

An entry's key is sha256(model fingerprint, chain hash); the chain hash already covers the parent
chain and the cache_salt, so other models and other tenants never share an entry. Entries carry
the block's tokens and are checksummed (codec.py): a corrupt or foreign entry is deleted and never
returned. What is where, by chain hash, is the index's business (TierManager): the store tells
its `listener` of every entry stored in and removed from a tier.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any, Protocol

import torch

from kvserve.config import TierConfig
from kvserve.core.kv_connector import EvictedBlock
from kvserve.kv_tiers.base import Evicted, KVTier
from kvserve.kv_tiers.codec import CorruptEntryError, decode_entry, encode_entry
from kvserve.kv_tiers.disk import DiskTier
from kvserve.kv_tiers.host import HostTier
from kvserve.kv_tiers.remote import RemoteTier

logger = logging.getLogger(__name__)

CPU, DISK, REMOTE = "cpu", "disk", "remote"
WRITE_QUEUE_MAX = 1024  # demotions waiting for disk / network; beyond it they are dropped
FLUSH_BUDGET_S = 10.0  # at close: how long pending writes may take

Name = tuple[bytes, bytes]  # (chain hash, parent hash): how routers know a block


def entry_key(fingerprint: bytes, block_hash: bytes) -> bytes:
    """A block's key in every tier: its chain hash under the model's fingerprint."""
    return hashlib.sha256(b"kvserve.tier.v1" + fingerprint + block_hash).digest()


class TierListener(Protocol):
    def stored(self, tier: str, key: bytes, name: Name | None) -> None: ...

    def removed(self, tier: str, key: bytes) -> Name | None: ...


class TierStore:
    """Lives in the output rank (worker.py). Threads: the rank's step thread calls everything but
    `fetch`, which runs on the reader thread
    (`submit_read`), and the writes the store queues, which run on its writer thread. The tiers
    are thread-safe themselves (base.py); the store's counters go under `_lock`."""

    def __init__(self, cfg: TierConfig, fingerprint: bytes, block_shape: tuple[int, ...], dtype: torch.dtype,
                 listener: TierListener) -> None:
        self.cfg = cfg
        self.fingerprint = fingerprint
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.listener = listener
        self.host = HostTier(cfg.cpu_bytes) if cfg.cpu_bytes else None
        self.disk = DiskTier(cfg.disk_path, cfg.disk_bytes) if cfg.disk_path else None
        self.remote = RemoteTier(cfg.remote_url) if cfg.remote_url else None
        self.slow: list[KVTier] = [t for t in (self.disk, self.remote) if t is not None]
        if self.disk is not None:
            self.disk.removed_listener = lambda key: listener.removed(DISK, key)
        self._lock = threading.Lock()
        self.counts: dict[str, int] = defaultdict(int)  # "<tier>_queries" / "<tier>_hits" (tokens), bytes moved
        self._reads: queue.Queue = queue.Queue()
        self._writes: queue.Queue = queue.Queue(maxsize=WRITE_QUEUE_MAX)
        self._threads = [threading.Thread(target=self._loop, args=(q,), name=f"kvserve-tier-{n}", daemon=True)
                         for n, q in (("read", self._reads), ("write", self._writes))] if self.slow else []
        for t in self._threads:
            t.start()

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    # ---- keys and entries -------------------------------------------------------

    def key(self, block_hash: bytes) -> bytes:
        return entry_key(self.fingerprint, block_hash)

    def encode(self, b: EvictedBlock, data: torch.Tensor) -> bytes:
        meta = {"parent": b.parent_hash, "tokens": list(b.tokens), "shape": list(self.block_shape),
                "dtype": str(self.dtype)}
        return encode_entry(self.key(b.block_hash), meta, data.contiguous().view(torch.uint8).numpy())

    def decode(self, key: bytes, blob: bytes, parent: bytes, tokens: tuple[int, ...]) -> bytes:
        """The block data, after checking checksum, key, tokens, shape and dtype."""
        meta, data = decode_entry(key, blob)
        if (meta.get("parent") != parent or tuple(meta.get("tokens", ())) != tokens
                or tuple(meta.get("shape", ())) != self.block_shape or meta.get("dtype") != str(self.dtype)):
            raise CorruptEntryError("entry content does not match the block it is keyed by")
        return data

    def to_tensor(self, data: bytes) -> torch.Tensor:
        return torch.frombuffer(bytearray(data), dtype=self.dtype).view(self.block_shape)

    # ---- the interface ------------------------------------------------------------

    def contains(self, key: bytes) -> bool:
        """In host RAM (the slow tiers are asked by `fetch`)."""
        return self.host is not None and self.host.contains(key)

    def touch(self, key: bytes) -> bool:
        """Mark a host entry recently used; whether it is there."""
        return self.host is not None and self.host.touch(key)

    def get(self, key: bytes, parent: bytes, tokens: tuple[int, ...], strict: bool = False) -> bytes | None:
        """The block's verified data from host RAM, or None (absent, or corrupt: then deleted;
        `strict`: CorruptEntryError instead)."""
        blob = self.host.get(key) if self.host is not None else None
        if blob is None:
            return None
        try:
            return self.decode(key, blob, parent, tokens)
        except CorruptEntryError as e:
            if strict:
                raise
            logger.warning("dropping a corrupt host-tier KV entry: %s", e)
            self.remove(CPU, key)
            return None

    def fetch(self, key: bytes, parent: bytes, tokens: tuple[int, ...]) -> tuple[bytes, str] | None:
        """(verified data, tier) from disk, then remote; None when neither has it."""
        for tier in self.slow:
            self.count(f"{tier.name}_queries", len(tokens))
            blob = tier.get(key)
            if blob is None:
                continue
            try:
                data = self.decode(key, blob, parent, tokens)
            except CorruptEntryError as e:
                logger.warning("deleting a corrupt %s-tier KV entry: %s", tier.name, e)
                self.remove(tier.name, key)
                continue
            self.count(f"{tier.name}_hits", len(tokens))
            return data, tier.name
        return None

    def put(self, b: EvictedBlock, data: torch.Tensor) -> list[Evicted]:
        """An evicted block: into host RAM, whose LRU victims go down to the slow tiers they are
        admitted to (by hits); without a host tier, straight down. Returns host RAM's victims."""
        blob, key, name = self.encode(b, data), self.key(b.block_hash), (b.block_hash, b.parent_hash)
        if self.host is None:
            self._demote([Evicted(key, blob, 0)], {key: name})
            return []
        ok, evicted = self.host.put_evicting(key, blob)
        if ok:
            self.count(f"bytes_{CPU}", len(blob))
            self.listener.stored(CPU, key, name)
        self._demote(evicted, {e.key: self.listener.removed(CPU, e.key) for e in evicted})
        return evicted

    def put_remote(self, b: EvictedBlock, data: torch.Tensor) -> None:
        """Write-through: a block the forward just computed goes to the remote store (queued)."""
        self._queue(self._write_new, b, data)

    def remove(self, tier: str, key: bytes) -> None:
        t = {CPU: self.host, DISK: self.disk, REMOTE: self.remote}[tier]
        if t is not None:
            t.delete(key)
        self.listener.removed(tier, key)

    def submit_read(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run fn(*args) on the reader thread (prefetches, in order)."""
        self._reads.put((fn, args))

    # ---- the writer thread ------------------------------------------------------

    def _queue(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            self._writes.put_nowait((fn, args))
        except queue.Full:
            self.count("writes_dropped")

    def _demote(self, entries: list[Evicted], names: dict[bytes, Name | None]) -> None:
        for e in entries:
            targets = [t for t, min_hits in ((self.disk, self.cfg.disk_min_hits),
                                             (self.remote, self.cfg.remote_min_hits))
                       if t is not None and e.hits >= min_hits]
            if targets:
                self._queue(self._write, e.key, e.blob, targets, names.get(e.key))

    def _write_new(self, b: EvictedBlock, data: torch.Tensor) -> None:
        assert self.remote is not None
        key = self.key(b.block_hash)
        if not self.remote.contains(key):
            self._write(key, self.encode(b, data), [self.remote], (b.block_hash, b.parent_hash))

    def _write(self, key: bytes, blob: bytes, targets: list[KVTier], name: Name | None = None) -> None:
        for tier in targets:
            if tier.put(key, blob):
                self.count(f"bytes_{tier.name}", len(blob))
                self.listener.stored(tier.name, key, name)
            else:
                self.count(f"write_failures_{tier.name}")

    def _loop(self, q: queue.Queue) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            fn, args = item
            try:
                fn(*args)
            except Exception:  # a tier bug must not kill the thread
                logger.exception("KV tier background task failed")
            finally:
                q.task_done()

    # ---- management ---------------------------------------------------------------

    def tiers(self) -> list[KVTier]:
        return [t for t in (self.host, self.disk, self.remote) if t is not None]

    def stats(self) -> dict[str, int | float | bool | str]:
        with self._lock:
            c = dict(self.counts)
        out: dict[str, int | float | bool | str] = {"kv_tier_writes_dropped": c.get("writes_dropped", 0)}
        for tier in self.tiers():
            s, n = tier.stats(), tier.name
            if n != CPU:  # host RAM's lookups are the scheduler role's (manager.py)
                out.update({f"kv_tier_{n}_queries": c.get(f"{n}_queries", 0), f"kv_tier_{n}_hits": c.get(f"{n}_hits", 0)})
            out.update({f"kv_tier_{n}_bytes_offloaded": c.get(f"bytes_{n}", 0),
                        f"kv_tier_{n}_entries": s["entries"], f"kv_tier_{n}_bytes_used": s["bytes_used"],
                        f"kv_tier_{n}_capacity_bytes": s["capacity_bytes"],
                        f"kv_tier_{n}_available": bool(s["available"]),
                        f"kv_tier_{n}_write_failures": c.get(f"write_failures_{n}", 0),
                        # unreachable, or its last write failed (a full disk): KV is not being kept there
                        f"kv_tier_{n}_degraded": not s["available"] or bool(s.get("write_failing"))})
        return out

    def clear(self) -> dict[str, int]:
        return {t.name: t.clear() for t in self.tiers()}

    def persist(self, cached: list[EvictedBlock], read_blocks: Callable[[list[int]], torch.Tensor],
                timeout: float = FLUSH_BUDGET_S, every_chunk: bool = False) -> int:
        """Save what would be lost at shutdown to the disk tier: device blocks (read_blocks: their
        K/V; the caller leaves out those the disk has), then the host tier's entries (most recently
        used first); returns how many were written. Bounded by `timeout` so a stop never hangs on a
        slow disk; `every_chunk`: read every chunk even past it (other ranks read with this one)."""
        deadline, written = time.monotonic() + timeout, 0
        for i in range(0, len(cached), 64):
            late = time.monotonic() > deadline
            if late and not every_chunk:
                return written
            chunk = cached[i:i + 64]
            data = read_blocks([b.block_id for b in chunk])
            if self.disk is not None and not late:
                for b, d in zip(chunk, data):
                    written += self.disk.put(self.key(b.block_hash), self.encode(b, d))
        if self.disk is None:
            return written
        for key in reversed(self.host.keys_lru() if self.host is not None else []):
            if time.monotonic() > deadline:
                break
            blob = self.host.get(key)
            if blob is not None and not self.disk.contains(key):
                written += self.disk.put(key, blob)
        return written

    def flush(self, timeout: float = FLUSH_BUDGET_S) -> None:
        """Wait (up to `timeout`) until queued background writes are on disk / in the store."""
        deadline = time.monotonic() + timeout
        while self._writes.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    @property
    def pending_writes(self) -> int:
        """Writes queued for the slow tiers, not done yet."""
        return self._writes.unfinished_tasks

    def join_reads(self) -> None:
        """Until every queued read has run (tests)."""
        self._reads.join()

    def close(self) -> None:
        self.flush()
        for q in (self._reads, self._writes):
            try:
                q.put(None, timeout=5)  # the write queue may be full: wait a little for room
            except queue.Full:
                pass
        for t in self._threads:
            t.join(timeout=5)
        for tier in self.tiers():
            tier.close()
