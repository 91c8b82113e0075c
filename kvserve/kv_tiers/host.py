"""HostTier: an in-process LRU of blobs in host RAM (the "cpu" tier)."""

from __future__ import annotations

import threading
from collections import OrderedDict

from kvserve.kv_tiers.base import Evicted, KVTier, StatValue


class _Entry:
    __slots__ = ("blob", "hits")

    def __init__(self, blob: bytes) -> None:
        self.blob = blob
        self.hits = 0


class HostTier(KVTier):
    """LRU of blobs bounded by the sum of blob lengths.

    Python object overhead is not counted: with KV blocks of tens of KiB or
    more it is noise, and counting payload bytes keeps the number predictable.
    Every method holds one lock for its whole (memory-only, short) body.
    """

    name = "cpu"

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        # Oldest first: popitem(last=False) is the LRU victim.
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self._bytes_used = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._rejected = 0
        self._closed = False

    def get(self, key: bytes) -> bytes | None:
        """The blob under `key` (refreshing recency and counting a hit), or None."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            entry.hits += 1
            self._hits += 1
            return entry.blob

    def touch(self, key: bytes) -> bool:
        """Refresh `key`'s recency without counting a hit; False if absent."""
        with self._lock:
            if key not in self._entries:
                return False
            self._entries.move_to_end(key)
            return True

    def put(self, key: bytes, blob: bytes) -> bool:
        """See `put_evicting`; the evicted entries are dropped."""
        stored, _ = self.put_evicting(key, blob)
        return stored

    def put_evicting(self, key: bytes, blob: bytes) -> tuple[bool, list[Evicted]]:
        """Store `blob` as the most recent entry, evicting LRU entries until it fits.

        Returns `(stored, evicted)`: `evicted` lists the entries dropped to make
        room, oldest first, with their hit counts, so the caller can demote them.
        A replaced entry for the same key is not reported (its content is
        superseded, not evicted) and the new entry starts with 0 hits. A blob
        larger than the capacity is refused with `(False, [])` and any existing
        entry for the key is kept.
        """
        size = len(blob)
        if size > self.capacity_bytes or self._closed:
            with self._lock:
                self._rejected += 1
            return False, []
        evicted: list[Evicted] = []
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes_used -= len(old.blob)
            while self._bytes_used + size > self.capacity_bytes:
                victim_key, victim = self._entries.popitem(last=False)
                self._bytes_used -= len(victim.blob)
                evicted.append(Evicted(victim_key, victim.blob, victim.hits))
            self._entries[key] = _Entry(blob)
            self._bytes_used += size
            self._evictions += len(evicted)
        return True, evicted

    def pop(self, key: bytes) -> bytes | None:
        """Remove and return the blob under `key` (used when it is promoted to the device)."""
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                return None
            self._bytes_used -= len(entry.blob)
            return entry.blob

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        with self._lock:
            return [k in self._entries for k in keys]

    def delete(self, key: bytes) -> None:
        self.pop(key)

    def clear(self) -> int:
        with self._lock:
            n = len(self._entries)
            self._entries.clear()
            self._bytes_used = 0
            return n

    def keys_lru(self) -> list[bytes]:
        """Keys from least to most recently used (for tests and debugging)."""
        with self._lock:
            return list(self._entries)

    def stats(self) -> dict[str, StatValue]:
        with self._lock:
            return {
                "entries": len(self._entries),
                "bytes_used": self._bytes_used,
                "capacity_bytes": self.capacity_bytes,
                "available": not self._closed,
                "hits": self._hits,
                "misses": self._misses,
                "evictions": self._evictions,
                "rejected": self._rejected,
            }

    def close(self) -> None:
        """Drop every entry and refuse further puts."""
        self._closed = True
        self.clear()

    def check_integrity(self) -> None:
        """Assert the byte count matches the entries and stays within capacity."""
        with self._lock:
            total = sum(len(e.blob) for e in self._entries.values())
            assert total == self._bytes_used, f"bytes_used {self._bytes_used} != sum of blobs {total}"
            assert total <= self.capacity_bytes, f"bytes_used {total} > capacity {self.capacity_bytes}"
            assert all(e.hits >= 0 for e in self._entries.values()), "negative hit count"
