"""Storage layer of the KV tiers: the entry codec, and the host-RAM, disk and Redis tiers."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import random
import socket
import struct
import threading
import time
import zlib
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.kv_tiers import disk as disk_mod
from kvserve.kv_tiers.base import Evicted
from kvserve.kv_tiers.codec import MAGIC, CorruptEntryError, decode_entry, encode_entry
from kvserve.kv_tiers.disk import DiskTier
from kvserve.kv_tiers.host import HostTier
from tests.kv_tiers.conftest import RedisServer
from tests.serving import free_port


def key(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


def entry(i: int, size: int = 100) -> bytes:
    """A valid encoded entry for key(i), whose total length is exactly `size` + header."""
    return encode_entry(key(i), {"i": i}, bytes([i % 256]) * size)


def warnings_from(caplog: pytest.LogCaptureFixture, module: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == f"kvserve.kv_tiers.{module}" and r.levelno == logging.WARNING]


def craft(k: bytes, meta_raw: bytes, data: bytes) -> bytes:
    """An entry with arbitrary meta bytes but a valid checksum (what a foreign writer could produce)."""
    body = MAGIC + struct.pack("<H", len(k)) + k + struct.pack("<I", len(meta_raw)) + meta_raw
    body += struct.pack("<Q", len(data)) + data
    return body + struct.pack("<I", zlib.crc32(body))


# -- codec ---------------------------------------------------------------------------

@pytest.mark.parametrize("data", [b"", b"x", os.urandom(100_000), bytearray(b"ab" * 10), memoryview(b"view"),
                                  np.arange(24, dtype=np.float16).reshape(2, 3, 4)])
@pytest.mark.parametrize("meta", [{}, {"block_size": 16, "dtype": "bf16", "shape": [2, 16, 64], 3: {"z": b"\0"}}])
def test_codec_round_trip(data: bytes, meta: dict) -> None:
    blob = encode_entry(key(1), meta, data)
    assert blob[:4] == MAGIC and struct.unpack_from("<I", blob, len(blob) - 4)[0] == zlib.crc32(blob[:-4])
    out_meta, out_data = decode_entry(key(1), blob)
    assert out_meta == meta and out_data == memoryview(data).tobytes() and type(out_data) is bytes


def _flip(blob: bytes, pos: int, mask: int = 0xFF) -> bytes:
    return blob[:pos] + bytes([blob[pos] ^ mask]) + blob[pos + 1:]


@pytest.mark.parametrize("make, message", [
    (lambda b: b"KVT2" + b[4:], "bad magic"),
    (lambda b: b"KV", "truncated"),
    (lambda b: b"", "truncated"),
    (lambda b: b[:10], "truncated"),
    (lambda b: b[:-1], "truncated"),
    (lambda b: b + b"\0", "length mismatch"),
    (lambda b: _flip(b, len(b) - 10), "checksum mismatch"),  # in the data
    (lambda b: _flip(b, len(b) - 1), "checksum mismatch"),  # in the crc itself
    (lambda b: _flip(b, 8), "checksum mismatch"),  # in the embedded key
    (lambda b: entry(2), "foreign entry"),
    (lambda b: craft(key(1), msgpack.packb([1, 2]), b"d"), "bad meta: expected a map"),
    (lambda b: craft(key(1), b"\xc1", b"d"), "bad meta: not valid msgpack"),
])
def test_codec_detects_corruption(make, message: str) -> None:
    with pytest.raises(CorruptEntryError, match=message):
        decode_entry(key(1), make(entry(1)))


def test_codec_every_truncation_and_byte_flip_is_detected() -> None:
    blob = encode_entry(key(1), {"a": 1}, b"payload")
    for n in range(len(blob)):
        with pytest.raises(CorruptEntryError, match="truncated"):
            decode_entry(key(1), blob[:n])
    for pos in range(len(blob)):
        with pytest.raises(CorruptEntryError):
            decode_entry(key(1), _flip(blob, pos))


def test_codec_rejects_oversized_key() -> None:
    with pytest.raises(ValueError, match="key too long"):
        encode_entry(b"k" * 70_000, {}, b"")


def _decode_or_corrupt(k: bytes, blob: bytes) -> None:
    """Anything but CorruptEntryError propagates and fails the test."""
    try:
        decode_entry(k, blob)
    except CorruptEntryError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200), st.booleans())
def test_codec_fuzz_random_bytes(blob: bytes, with_magic: bool) -> None:
    _decode_or_corrupt(key(1), MAGIC + blob if with_magic else blob)


meta_values = st.integers(-(2**63), 2**64 - 1) | st.binary(max_size=8) | st.text(max_size=8)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=40), st.dictionaries(st.text(max_size=5), meta_values, max_size=3),
       st.binary(max_size=300), st.integers(min_value=0), st.integers(1, 255), st.integers(min_value=0))
def test_codec_fuzz_damaged_valid_entries(k: bytes, meta: dict, data: bytes, pos: int, mask: int, cut: int) -> None:
    blob = encode_entry(k, meta, data)
    assert decode_entry(k, blob) == (meta, data)
    with pytest.raises(CorruptEntryError):
        decode_entry(k, _flip(blob, pos % len(blob), mask))
    with pytest.raises(CorruptEntryError):
        decode_entry(k, blob[: cut % len(blob)])


# -- host tier -------------------------------------------------------------------------

def test_host_lru_get_protects_entry_and_capacity_holds() -> None:
    tier = HostTier(300)
    for i in range(3):
        assert tier.put(key(i), b"a" * 100)
    assert tier.get(key(0)) == b"a" * 100  # key 0 becomes most recent
    assert tier.put(key(3), b"b" * 100)
    assert tier.contains_many([key(0), key(1), key(2), key(3)]) == [True, False, True, True]
    assert tier.keys_lru() == [key(2), key(0), key(3)]
    assert tier.stats()["bytes_used"] == 300
    tier.check_integrity()


def test_host_oversize_refused_and_existing_entry_kept() -> None:
    tier = HostTier(100)
    assert tier.put(key(0), b"x" * 100)
    assert tier.put_evicting(key(0), b"y" * 101) == (False, [])
    assert tier.get(key(0)) == b"x" * 100
    assert tier.stats()["rejected"] == 1


def test_host_put_evicting_reports_victims_with_hit_counts() -> None:
    tier = HostTier(300)
    for i in range(3):
        tier.put(key(i), bytes([i]) * 100)
    for i in (0, 0, 1):
        tier.get(key(i))  # LRU order now 2, 0, 1
    stored, evicted = tier.put_evicting(key(9), b"n" * 200)
    assert stored
    assert evicted == [Evicted(key(2), b"\x02" * 100, 0), Evicted(key(0), b"\x00" * 100, 2)]
    # Replacing an entry is not an eviction, and the new entry starts at 0 hits.
    assert tier.put_evicting(key(1), b"r" * 50) == (True, [])
    tier.put(key(8), b"z" * 60)
    assert tier.put_evicting(key(7), b"q" * 200)[1][0] == Evicted(key(1), b"r" * 50, 0)
    stats = tier.stats()
    assert (stats["hits"], stats["evictions"], stats["entries"]) == (3, 4, 2)
    tier.check_integrity()


def test_host_touch_refreshes_recency_without_a_hit() -> None:
    tier = HostTier(3 * len(entry(0)))
    for i in range(3):
        tier.put(key(i), entry(i))
    assert tier.touch(key(0)) and not tier.touch(key(9))
    ok, evicted = tier.put_evicting(key(3), entry(3))
    assert ok and [e.key for e in evicted] == [key(1)]  # key(0) was refreshed
    assert tier.get(key(0)) == entry(0)
    _, evicted = tier.put_evicting(key(4), entry(4))
    assert [(e.key, e.hits) for e in evicted] == [(key(2), 0)]
    tier.put(key(5), entry(5))
    tier.put(key(6), entry(6))
    assert tier.stats()["entries"] == 3


def test_host_pop_clear_close() -> None:
    tier = HostTier(1000)
    tier.put(key(0), b"a" * 10)
    tier.put(key(1), b"b" * 20)
    assert tier.pop(key(0)) == b"a" * 10 and tier.pop(key(0)) is None
    assert tier.get(key(0)) is None and tier.stats()["bytes_used"] == 20
    tier.delete(key(5))  # absent: no error
    assert tier.clear() == 1 and tier.stats()["entries"] == 0 and tier.stats()["bytes_used"] == 0
    tier.close()
    assert not tier.put(key(2), b"c") and tier.stats()["available"] is False


def test_host_threaded_smoke() -> None:
    tier = HostTier(5000)
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(2000):
            i = rng.randrange(40)
            op = rng.random()
            if op < 0.5:
                tier.put(key(i), bytes([i]) * rng.randrange(1, 400))
            else:
                blob = tier.get(key(i)) if op < 0.9 else tier.pop(key(i))
                if blob is not None and set(blob) != {i}:
                    errors.append(f"key {i} returned another key's blob")

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    tier.check_integrity()
    stats = tier.stats()
    assert stats["entries"] == len(tier.keys_lru()) and 0 < stats["bytes_used"] <= 5000


# -- disk tier -------------------------------------------------------------------------

def files(root: Path, pattern: str = "*.kv") -> set[str]:
    return {p.name for p in root.rglob(pattern)}


def test_disk_put_get_layout_delete(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 10_000)
    assert tier.put(key(1), entry(1)) and tier.put(key(2), entry(2))
    path = tmp_path / key(1).hex()[:2] / f"{key(1).hex()}.kv"
    assert path.read_bytes() == entry(1) and tier.get(key(1)) == entry(1)
    assert tier.get_verified(key(2)) == ({"i": 2}, b"\x02" * 100)
    assert tier.contains_many([key(1), key(3), key(2)]) == [True, False, True]
    tier.delete(key(1))
    assert not path.exists() and tier.get(key(1)) is None and tier.stats()["entries"] == 1
    assert tier.put(key(2), entry(2, 300)) and tier.get(key(2)) == entry(2, 300)  # replace
    assert not tier.put(key(3), b"x" * 10_001)
    stats = tier.stats()
    assert (stats["entries"], stats["bytes_used"], stats["path"]) == (1, len(entry(2, 300)), str(tmp_path))
    tier.check_integrity()


def test_disk_capacity_evicts_files(tmp_path: Path) -> None:
    size = len(entry(0))
    tier = DiskTier(tmp_path, 3 * size)
    for i in range(5):
        assert tier.put(key(i), entry(i))
    assert files(tmp_path) == {f"{key(i).hex()}.kv" for i in (2, 3, 4)}
    assert tier.stats()["evictions"] == 2
    tier.check_integrity()


def test_disk_survives_restart_with_lru_order(tmp_path: Path) -> None:
    size = len(entry(0))
    tier = DiskTier(tmp_path, 3 * size)
    for i in range(3):
        tier.put(key(i), entry(i))
    assert tier.get(key(0)) == entry(0)  # read before the restart: now the most recent
    tier.close()
    assert tier.get(key(0)) is None and not tier.put(key(5), entry(5))  # closed
    tier = DiskTier(tmp_path, 3 * size)
    assert tier.stats()["entries"] == 3 and tier.keys_lru() == [key(1), key(2), key(0)]
    assert tier.put(key(3), entry(3))
    assert tier.contains_many([key(0), key(1), key(2), key(3)]) == [True, False, True, True]
    assert tier.get_verified(key(0)) == ({"i": 0}, b"\x00" * 100)
    tier.check_integrity()
    # A smaller capacity on restart evicts the oldest files at once.
    tier = DiskTier(tmp_path, size)
    assert tier.keys_lru() == [key(0)] and files(tmp_path) == {f"{key(0).hex()}.kv"}


def test_disk_start_removes_temp_files_and_ignores_foreign_files(tmp_path: Path) -> None:
    DiskTier(tmp_path, 10_000).put(key(1), entry(1))
    shard = tmp_path / key(1).hex()[:2]
    (shard / ".kvtmp-crashed").write_bytes(b"half")
    old = time.time() - 120  # a crash's leftover is old; a young one may be a live writer's
    os.utime(shard / ".kvtmp-crashed", (old, old))
    (shard / ".kvtmp-live").write_bytes(b"being written")
    foreign = [tmp_path / "README", shard / "notes.txt", shard / "xyz.kv", shard / "00ff.kv",
               tmp_path / "zz" / f"{'a' * 64}.kv"]
    for p in foreign:
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(b"not ours")
    tier = DiskTier(tmp_path, 10_000)
    assert not (shard / ".kvtmp-crashed").exists() and (shard / ".kvtmp-live").exists()
    assert all(p.read_bytes() == b"not ours" for p in foreign)
    assert tier.keys_lru() == [key(1)]
    assert tier.clear() == 1 and all(p.exists() for p in foreign)


@pytest.mark.parametrize("damage, message", [
    (lambda b: _flip(b, len(b) // 2), "checksum mismatch"),
    (lambda b: b[: len(b) // 2], "truncated"),
])
def test_disk_corrupt_file_is_dropped(tmp_path: Path, caplog: pytest.LogCaptureFixture, damage, message: str) -> None:
    tier = DiskTier(tmp_path, 10_000)
    tier.put(key(1), entry(1))
    path = next(tmp_path.rglob("*.kv"))
    path.write_bytes(damage(path.read_bytes()))
    assert tier.get_verified(key(1)) is None
    assert not path.exists() and not tier.contains(key(1)) and tier.stats()["bytes_used"] == 0
    assert any(message in r.getMessage() for r in warnings_from(caplog, "base"))


def test_disk_vanished_file_is_dropped_from_index(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 10_000)
    tier.put(key(1), entry(1))
    tier.put(key(2), entry(2))
    next(p for p in tmp_path.rglob("*.kv") if p.name.startswith(key(1).hex())).unlink()
    assert tier.get(key(1)) is None and not tier.contains(key(1))
    assert tier.stats()["entries"] == 1
    tier.check_integrity()


def test_disk_full_logs_one_warning_and_leaves_no_temp_files(tmp_path: Path, caplog: pytest.LogCaptureFixture,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    tier = DiskTier(tmp_path, 10_000)
    tier.put(key(0), entry(0))

    def disk_full(fd: int, blob: bytes) -> None:
        os.write(fd, blob[:10])  # a partial temp file, as a real ENOSPC would leave
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk_mod, "_write_all", disk_full)
    assert [tier.put(key(i), entry(i)) for i in range(1, 4)] == [False] * 3
    assert len(warnings_from(caplog, "disk")) == 1 and "No space left" in warnings_from(caplog, "disk")[0].getMessage()
    assert files(tmp_path, ".kvtmp-*") == set() and tier.stats()["write_errors"] == 3
    assert tier.get(key(0)) == entry(0) and tier.keys_lru() == [key(0)]
    monkeypatch.undo()
    assert tier.put(key(1), entry(1))  # a success re-arms the warning
    monkeypatch.setattr(disk_mod, "_write_all", disk_full)
    assert not tier.put(key(2), entry(2)) and not tier.put(key(3), entry(3))
    assert len(warnings_from(caplog, "disk")) == 2
    tier.check_integrity()


def test_disk_unusable_directory_makes_tier_unavailable(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / "file").write_bytes(b"")
    tier = DiskTier(tmp_path / "file" / "sub", 10_000)  # a file where a directory should be
    assert not tier.put(key(1), entry(1)) and tier.get(key(1)) is None
    assert tier.contains_many([key(1)]) == [False] and tier.stats()["available"] is False
    assert len(warnings_from(caplog, "disk")) == 1


def test_disk_threaded_smoke(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tier = DiskTier(tmp_path, 2000)
    errors: list[str] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        for _ in range(150):
            i = rng.randrange(20)
            if rng.random() < 0.5:
                tier.put(key(i), entry(i, rng.randrange(1, 300)))
            elif (got := tier.get_verified(key(i))) is not None and got[0] != {"i": i}:
                errors.append(f"key {i} returned {got[0]}")

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and not warnings_from(caplog, "base") and not warnings_from(caplog, "disk")
    tier.check_integrity()
    assert files(tmp_path) == {f"{k.hex()}.kv" for k in tier.keys_lru()} and not files(tmp_path, ".kvtmp-*")


# -- remote tier (a private redis-server per test) -----------------------------------------

def raw_client(server: RedisServer):
    import redis

    return redis.Redis(port=server.port, socket_timeout=1)


def test_remote_put_get_contains_delete_stats(redis_server: RedisServer) -> None:
    from kvserve.kv_tiers.remote import RemoteTier

    tier = RemoteTier(redis_server.url, key_prefix=b"t:")
    assert tier.put(key(1), entry(1)) and tier.put(key(2), entry(2))
    assert tier.get(key(1)) == entry(1) and tier.get(key(3)) is None
    assert raw_client(redis_server).get(b"t:" + key(1)) == entry(1)  # stored under the prefix
    assert tier.contains_many([key(1), key(3), key(2)]) == [True, False, True] and tier.contains_many([]) == []
    tier.delete(key(1))
    assert not tier.contains(key(1))
    stats = tier.stats()
    assert stats["available"] is True and stats["capacity_bytes"] == 64 * 2**20
    assert stats["entries"] == 1 and stats["bytes_used"] > 0 and (stats["hits"], stats["misses"]) == (1, 1)
    tier.close()
    assert tier.get(key(2)) is None and not tier.put(key(2), entry(2))


def test_remote_clear_only_touches_our_prefix(redis_server: RedisServer) -> None:
    from kvserve.kv_tiers.remote import RemoteTier

    tier = RemoteTier(redis_server.url, key_prefix=b"t[1]*:")  # glob characters must match literally
    client = raw_client(redis_server)
    foreign = [b"other:x", b"t1abc:x", b"t[1]x"]
    for k in foreign:
        client.set(k, b"keep")
    for i in range(1200):  # more than one SCAN / DEL batch
        assert tier.put(key(i), b"v")
    assert tier.clear() == 1200
    assert sorted(client.keys(b"*")) == sorted(foreign)


def test_remote_get_verified_drops_corrupt_value(redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    from kvserve.kv_tiers.remote import RemoteTier

    tier = RemoteTier(redis_server.url)
    tier.put(key(1), entry(1))
    tier.put(key(2), entry(2))
    raw_client(redis_server).setrange(b"kvserve:" + key(1), 60, b"\xff")
    assert tier.get_verified(key(1)) is None and not tier.contains(key(1))
    assert "checksum mismatch" in warnings_from(caplog, "base")[0].getMessage()
    assert tier.get_verified(key(2)) == ({"i": 2}, b"\x02" * 100)


class _Spy:
    """Stands in for the redis client and records any use of it."""

    def __init__(self, real: object) -> None:
        self.real, self.used = real, []

    def __getattr__(self, name: str) -> object:
        self.used.append(name)
        return getattr(self.real, name)


def _timed(fn, *args):
    start = time.monotonic()
    out = fn(*args)
    assert time.monotonic() - start < 1.5, f"{fn.__name__} blocked"
    return out


def test_remote_outage_and_reconnect(redis_server: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    from kvserve.kv_tiers.remote import RemoteTier

    caplog.set_level(logging.INFO, logger="kvserve.kv_tiers.remote")
    tier = RemoteTier(redis_server.url, retry_interval_s=0.2, socket_timeout_s=1.0)
    assert tier.put(key(1), entry(1))
    redis_server.stop()
    assert _timed(tier.get, key(1)) is None
    spy = tier._client = _Spy(tier._client)  # within retry_interval: no network at all
    assert _timed(tier.put, key(2), entry(2)) is False
    assert _timed(tier.contains_many, [key(1), key(2)]) == [False, False]
    assert _timed(tier.get_verified, key(1)) is None and _timed(tier.clear) == 0
    assert tier.stats()["available"] is False and spy.used == []
    time.sleep(0.25)
    assert _timed(tier.get, key(1)) is None and spy.used  # retried, still down
    assert len(warnings_from(caplog, "remote")) == 1
    assert "carrying on with local tiers" in warnings_from(caplog, "remote")[0].getMessage()
    redis_server.start()
    time.sleep(0.25)
    assert tier.put(key(3), entry(3)) and tier.get(key(3)) == entry(3)
    assert tier.stats()["available"] is True
    assert sum("reconnected" in r.getMessage() for r in caplog.records) == 1
    assert len(warnings_from(caplog, "remote")) == 1


def test_remote_unresponsive_server_times_out(caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("redis")
    from kvserve.kv_tiers.remote import RemoteTier

    with socket.socket() as listener:  # accepts connections (backlog) but never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        tier = RemoteTier(f"redis://127.0.0.1:{listener.getsockname()[1]}", socket_timeout_s=0.3)
        start = time.monotonic()
        assert tier.get(key(1)) is None
        assert time.monotonic() - start < 1.0  # one attempt, no hidden client-side retries
        assert tier.contains_many([key(1)]) == [False] and len(warnings_from(caplog, "remote")) == 1
    nothing = RemoteTier(f"redis://127.0.0.1:{free_port()}")  # nobody listening at all
    assert _timed(nothing.put, key(1), entry(1)) is False and nothing.stats()["available"] is False
