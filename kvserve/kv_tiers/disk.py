"""DiskTier: blobs as files in a local directory, LRU-bounded, surviving restarts.

Layout: ``<path>/<first 2 hex chars>/<hex key>.kv``. The two-char shard keeps
directories small (256 of them) so lookups and scans stay fast with millions of
entries.

Writes go to a temp file (``.kvtmp-*``) in the entry's own shard directory and
are then ``os.replace``d onto the real name, so a process crash never leaves a
half-written entry under a real name, and readers see the old or the new file,
never a mix. There is deliberately no fsync: it would cost a disk flush per KV
block and this is a cache. After a power loss an entry may come back empty or
partial; the codec's length and checksum checks catch that and `get_verified`
deletes it.

The index (key -> size, LRU order) lives in memory and is rebuilt on start by
scanning the directory, LRU order coming from file mtimes. `put` and `get`
stamp files with strictly increasing mtimes so the order survives a restart
even when several entries are touched within one clock tick. One DiskTier owns
its directory: two processes sharing a directory would delete each other's temp
files on start and disagree about the capacity.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

from kvserve.kv_tiers.base import KVTier, StatValue

logger = logging.getLogger(__name__)

TMP_PREFIX = ".kvtmp-"
STALE_TMP_S = 60.0  # a temp file older than this belongs to no live writer
SUFFIX = ".kv"
_HEX = frozenset("0123456789abcdef")


def _write_all(fd: int, blob: bytes) -> None:
    """Write all of `blob` to `fd` (os.write may write less than asked). Tests patch this."""
    mv = memoryview(blob)
    while mv:
        mv = mv[os.write(fd, mv) :]


def _is_hex(s: str) -> bool:
    return bool(s) and len(s) % 2 == 0 and set(s) <= _HEX


def _parse_name(shard: str, name: str) -> bytes | None:
    """The key a file name encodes, or None if the file is not one of ours."""
    if not name.endswith(SUFFIX):
        return None
    stem = name[: -len(SUFFIX)]
    if not _is_hex(stem) or stem[:2] != shard:
        return None
    return bytes.fromhex(stem)


def _unlink_quiet(path: str | Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        logger.warning("disk KV tier: cannot remove %s: %s", path, e)


class _DiskEntry:
    # An object rather than a bare size so that `index.get(key) is entry`
    # tells a stale lookup from a concurrent re-put of the same key.
    __slots__ = ("size",)

    def __init__(self, size: int) -> None:
        self.size = size


class DiskTier(KVTier):
    """LRU of entry files bounded by the sum of file sizes.

    The lock guards the index and every rename / unlink, so the index and the
    names on disk always agree; file contents are written and read outside it.
    If the directory cannot be created or scanned the tier logs a warning and
    stays unavailable instead of raising.
    """

    name = "disk"

    def __init__(self, path: str | Path, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        self.path = Path(path)
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, _DiskEntry] = OrderedDict()  # oldest first
        self._bytes_used = 0
        self._last_stamp = 0
        self._available = True
        self._write_failing = False
        self._hits = self._misses = self._evictions = self._write_errors = 0
        # Told the key of each entry evicted to make room (KV events); called under the lock.
        self.removed_listener: Callable[[bytes], None] | None = None
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            with self._lock:
                self._load_locked()
        except OSError as e:
            logger.warning("disk KV tier at %s unavailable: %s", self.path, e)
            self._available = False
            self._index.clear()
            self._bytes_used = 0

    def _load_locked(self) -> None:
        """Rebuild the index from the files on disk, oldest mtime first."""
        found: list[tuple[int, str, bytes, int]] = []
        strays = 0
        for shard in os.scandir(self.path):
            if len(shard.name) != 2 or not _is_hex(shard.name) or not shard.is_dir(follow_symlinks=False):
                continue
            for f in os.scandir(shard.path):
                if f.name.startswith(TMP_PREFIX):
                    # Left by a crash mid-put, unless young: then another process (a live
                    # server, while `kvserve cache stats --disk` looks at its directory) is writing it.
                    with contextlib.suppress(OSError):
                        if time.time() - f.stat(follow_symlinks=False).st_mtime > STALE_TMP_S:
                            _unlink_quiet(f.path)
                            strays += 1
                    continue
                key = _parse_name(shard.name, f.name)
                try:
                    if key is None or not f.is_file(follow_symlinks=False):
                        continue  # not ours: leave it alone
                    st = f.stat(follow_symlinks=False)
                except OSError:
                    continue  # vanished while scanning
                found.append((st.st_mtime_ns, f.name, key, st.st_size))
        found.sort()  # name breaks mtime ties so the order is deterministic
        for _, _, key, size in found:
            self._index[key] = _DiskEntry(size)
            self._bytes_used += size
        self._last_stamp = found[-1][0] if found else 0
        evicted = self._evict_locked()
        logger.info("disk KV tier at %s: %d entries (%d bytes) restored, %d evicted, %d temp files removed",
                    self.path, len(self._index), self._bytes_used, evicted, strays)

    def _path_for(self, key: bytes) -> Path:
        if not key:
            raise ValueError("empty key")
        h = key.hex()
        return self.path / h[:2] / f"{h}{SUFFIX}"

    def _next_stamp(self) -> int:
        """A strictly increasing mtime in ns (caller holds the lock)."""
        self._last_stamp = max(time.time_ns(), self._last_stamp + 1)
        return self._last_stamp

    def _evict_locked(self) -> int:
        """Delete LRU files until within capacity; returns how many."""
        n = 0
        while self._bytes_used > self.capacity_bytes:
            key, entry = self._index.popitem(last=False)
            self._bytes_used -= entry.size
            _unlink_quiet(self._path_for(key))
            n += 1
            if self.removed_listener is not None:
                self.removed_listener(key)
        self._evictions += n
        return n

    def get(self, key: bytes) -> bytes | None:
        """The file's bytes, or None. A file that vanished or cannot be read is
        dropped from the index. Refreshes recency in memory and on disk."""
        path = self._path_for(key)
        with self._lock:
            entry = self._index.get(key) if self._available else None
            if entry is None:
                self._misses += 1
                return None
            self._index.move_to_end(key)
            stamp = self._next_stamp()
        try:
            with open(path, "rb", buffering=0) as f:
                blob = f.readall()
        except OSError as e:
            log = logger.debug if isinstance(e, FileNotFoundError) else logger.warning
            log("disk KV tier: cannot read %s (%s); dropping it from the index", path, e)
            with self._lock:
                self._misses += 1
                if self._index.get(key) is entry:  # not re-put meanwhile
                    del self._index[key]
                    self._bytes_used -= entry.size
            return None
        try:
            os.utime(path, ns=(stamp, stamp))
        except OSError:
            pass  # deleted or evicted since the read; the blob we hold is still good
        with self._lock:
            self._hits += 1
        return blob

    def put(self, key: bytes, blob: bytes) -> bool:
        """Write atomically, then evict LRU files to fit. False (and a warning,
        once per run of failures) on disk full / permission errors; no temp
        file is left behind."""
        size = len(blob)
        path = self._path_for(key)
        if size > self.capacity_bytes or not self._available:
            return False
        tmp: str | None = None
        try:
            path.parent.mkdir(exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=TMP_PREFIX, dir=path.parent)
            try:
                _write_all(fd, blob)
            finally:
                os.close(fd)
            with self._lock:
                stamp = self._next_stamp()
                os.utime(tmp, ns=(stamp, stamp))
                os.replace(tmp, path)
                tmp = None
                old = self._index.pop(key, None)
                self._bytes_used += size - (old.size if old else 0)
                self._index[key] = _DiskEntry(size)
                self._evict_locked()
        except OSError as e:
            self._on_write_error(e)
            return False
        finally:
            if tmp is not None:
                _unlink_quiet(tmp)
        if self._write_failing:
            with self._lock:
                self._write_failing = False
            logger.info("disk KV tier at %s: writes succeed again", self.path)
        return True

    def _on_write_error(self, e: OSError) -> None:
        # One warning per run of failures: a full disk fails every block of
        # every step, and one line per block would bury the rest of the log.
        with self._lock:
            self._write_errors += 1
            first = not self._write_failing
            self._write_failing = True
        if first:
            logger.warning("disk KV tier at %s: write failed (%s); not storing to disk, "
                           "further failures are not logged until a write succeeds", self.path, e)

    def contains_many(self, keys: list[bytes]) -> list[bool]:
        with self._lock:
            return [self._available and k in self._index for k in keys]

    def delete(self, key: bytes) -> None:
        path = self._path_for(key)
        with self._lock:
            entry = self._index.pop(key, None)
            if entry is not None:
                self._bytes_used -= entry.size
                _unlink_quiet(path)

    def clear(self) -> int:
        """Delete every indexed entry file; files that are not ours stay."""
        with self._lock:
            n = len(self._index)
            for key in self._index:
                _unlink_quiet(self._path_for(key))
            self._index.clear()
            self._bytes_used = 0
            return n

    def stats(self) -> dict[str, StatValue]:
        with self._lock:
            return {
                "entries": len(self._index),
                "bytes_used": self._bytes_used,
                "capacity_bytes": self.capacity_bytes,
                "available": self._available,
                "path": str(self.path),
                "hits": self._hits,
                "misses": self._misses,
                "evictions": self._evictions,
                "write_errors": self._write_errors,
                "write_failing": self._write_failing,
            }

    def close(self) -> None:
        """Stop serving; the files stay for the next DiskTier on this path."""
        with self._lock:
            self._available = False

    def keys_lru(self) -> list[bytes]:
        """Keys from least to most recently used (for tests and debugging)."""
        with self._lock:
            return list(self._index)

    def check_integrity(self) -> None:
        """Assert the index matches the files on disk and the capacity holds."""
        with self._lock:
            total = sum(e.size for e in self._index.values())
            assert total == self._bytes_used, f"bytes_used {self._bytes_used} != sum of sizes {total}"
            assert total <= self.capacity_bytes, f"bytes_used {total} > capacity {self.capacity_bytes}"
            for key, entry in self._index.items():
                size = self._path_for(key).stat().st_size
                assert size == entry.size, f"{key.hex()}: file has {size} bytes, index says {entry.size}"
