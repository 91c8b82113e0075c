"""The machine's memory read bandwidth, measured once with the engine's threads and cached.

Decode of a quantized model reads every weight once per token, so weight bytes per token times
tokens per second, divided by this number, says how close a decode run is to the memory limit
(issue 30: llama.cpp reaches ~40% of it). The measurement is a streaming read (c/bandwidth.c) of
a buffer well past the last-level cache: 4x L3, at least 256 MiB, at most 1 GiB. Best of a few
reads: another process can only slow a read down, so the fastest one is the machine's.

Cached as JSON under `<cache_dir>/bandwidth/<key>.json`, keyed by the CPU model and the thread
count, with when it was taken (`made`, unix time) and every read's time as its evidence; measured
again after STALE_DAYS. Not under `tuning/`: that holds the dtype and kernel decisions, whose
files `kvserve env` parses as such.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

from kvserve.kernels import build, cpu

MIN_BYTES, MAX_BYTES = 256 << 20, 1 << 30
L3_MULTIPLE = 4
STALE_DAYS = 30
REPS = 10  # a read of 256 MiB takes ~20 ms: ten cost little and ride out a busy moment
_SIGNATURES = {"bw_measure": [ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.POINTER(ctypes.c_double),
                              ctypes.POINTER(ctypes.c_uint64)]}


def load() -> ctypes.CDLL | None:
    """The compiled library, or None (no compiler, a failed build, KVSERVE_NO_C_KERNEL=1)."""
    return build.load_library("bandwidth", "bandwidth.c", _SIGNATURES)


def l3_bytes() -> int | None:
    """The L3 (or last-level) cache size Linux reports for CPU 0, or None."""
    root = Path("/sys/devices/system/cpu/cpu0/cache")
    sizes = []
    for index in root.glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
        digits = text.rstrip("KMGkmg")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes) if sizes else None


def buffer_bytes() -> int:
    """4x the last-level cache, clamped to [256 MiB, 1 GiB] (1 GiB when the cache size is unknown)."""
    l3 = l3_bytes()
    return MAX_BYTES if l3 is None else max(MIN_BYTES, min(MAX_BYTES, L3_MULTIPLE * l3))


def _threads(threads: int | None) -> int:
    if threads is not None:
        return threads
    import torch  # the engine's thread count is torch's

    return torch.get_num_threads()


def measure(threads: int | None = None, nbytes: int | None = None, reps: int = REPS) -> dict[str, Any] | None:
    """Read a fresh buffer `reps` times with `threads` OpenMP threads (default: torch's count);
    None without the C library. Raises MemoryError when the buffer cannot be allocated."""
    lib = load()
    if lib is None:
        return None
    threads, nbytes = _threads(threads), nbytes or buffer_bytes()
    seconds, sink = (ctypes.c_double * reps)(), ctypes.c_uint64()
    lib.bw_measure(nbytes, threads, reps, seconds, ctypes.byref(sink))
    if seconds[0] < 0:
        raise MemoryError(f"bandwidth: cannot allocate a {nbytes >> 20} MiB buffer")
    nbytes = nbytes // 64 * 64  # what the kernel read
    runs = list(seconds)
    return {"gb_s": nbytes / min(runs) / 1e9, "threads": threads, "bytes": nbytes, "seconds": runs,
            "cpu": cpu.cpu_model(), "made": time.time()}


def cache_path(threads: int) -> Path:
    key = json.dumps(["bandwidth", cpu.cpu_model(), threads])
    return build.cache_dir() / "bandwidth" / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def read_bandwidth(threads: int | None = None, refresh: bool = False) -> dict[str, Any] | None:
    """measure()'s result, from the cache when this CPU and thread count were measured before
    and not older than STALE_DAYS (refresh: measure again). "cached" in the result says which."""
    threads = _threads(threads)
    path = cache_path(threads)
    if not refresh:
        try:
            result = json.loads(path.read_text())
            if float(result["gb_s"]) > 0 and time.time() - float(result["made"]) < STALE_DAYS * 86400:
                return {**result, "cached": True}
        except (OSError, ValueError, KeyError, TypeError):
            pass  # missing or damaged: measure
    result = measure(threads)
    if result is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(result, indent=1))
    os.replace(tmp, path)  # atomic: a concurrent start reads the old file or the new one
    return {**result, "cached": False}
