"""Memory read bandwidth (kvserve/kernels/c/bandwidth.c): a plausible number, measured once per
CPU and thread count and then read from the cache."""

from __future__ import annotations

import json
import time

import pytest

from kvserve.kernels import bandwidth

pytestmark = pytest.mark.skipif(bandwidth.load() is None, reason="no C compiler: the kernel cannot build")


def test_buffer_size_follows_the_cache(monkeypatch):
    for l3, want in ((None, 1 << 30), (8 << 20, 256 << 20), (96 << 20, 384 << 20), (1 << 30, 1 << 30)):
        monkeypatch.setattr(bandwidth, "l3_bytes", lambda v=l3: v)
        assert bandwidth.buffer_bytes() == want


def test_l3_read_from_sysfs():
    l3 = bandwidth.l3_bytes()
    assert l3 is None or 64 << 10 <= l3 <= 4 << 30


def test_measure_is_plausible():
    r = bandwidth.measure(threads=1, nbytes=(256 << 20) + 100, reps=3)
    assert r["bytes"] == (256 << 20) + 64  # whole 64-byte lines
    assert len(r["seconds"]) == 3 and all(s > 0 for s in r["seconds"])
    assert r["gb_s"] == pytest.approx(r["bytes"] / min(r["seconds"]) / 1e9)
    # Any machine from a laptop to an HBM server: well above a disk, below any memory system's peak.
    assert 0.5 < r["gb_s"] < 5000


def test_measured_once_then_cached(monkeypatch):
    bandwidth.cache_path(2).unlink(missing_ok=True)  # `kvserve env` tests may have measured it already
    first = bandwidth.read_bandwidth(threads=2)
    assert not first["cached"] and first["threads"] == 2 and first["gb_s"] > 0
    path = bandwidth.cache_path(2)
    assert json.loads(path.read_text())["gb_s"] == first["gb_s"]

    def fail(*args, **kwargs):
        raise AssertionError("measured again although cached")

    monkeypatch.setattr(bandwidth, "measure", fail)
    again = bandwidth.read_bandwidth(threads=2)
    assert again["cached"] and again["gb_s"] == first["gb_s"]
    assert bandwidth.cache_path(1) != path  # another thread count is another measurement


def test_stale_or_damaged_cache_is_measured_again(monkeypatch):
    fake = {"gb_s": 12.5, "threads": 3, "bytes": 1 << 28, "seconds": [0.02], "cpu": "x", "made": time.time()}
    calls = []
    monkeypatch.setattr(bandwidth, "measure", lambda threads: calls.append(threads) or dict(fake))
    path = bandwidth.cache_path(3)
    path.parent.mkdir(parents=True, exist_ok=True)
    for content in ("{not json", json.dumps({**fake, "gb_s": 99.0, "made": time.time() - 40 * 86400})):
        path.write_text(content)
        r = bandwidth.read_bandwidth(threads=3)
        assert not r["cached"] and r["gb_s"] == 12.5
    assert calls == [3, 3]
    assert bandwidth.read_bandwidth(threads=3)["cached"]
    assert bandwidth.read_bandwidth(threads=3, refresh=True)["cached"] is False and calls == [3, 3, 3]


def test_kvserve_env_reports_it():
    from kvserve import env

    b = env._bandwidth()
    line = env._bandwidth_line(b)
    assert line.startswith(f"{b['gb_s']:.1f} GB/s ({b['threads']} threads, best of {len(b['seconds'])} reads")
    assert env._bandwidth_line(None) == "not measured (no C kernels)"
