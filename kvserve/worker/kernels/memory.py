"""Weights on transparent huge pages: a decode step streams every weight byte once, and with 4 KB
pages a 3B model's 1.7 GB is ~400k pages, each a TLB miss and a page walk the GEMV waits on.

`on_huge_pages(t)` copies a large CPU tensor into a fresh private anonymous mapping advised
MADV_HUGEPAGE (Linux's THP in its default "madvise" mode backs it with 2 MB pages as it is
written). Measured on Zen 3 (2 threads, 4-bit weights ten times the L3, interleaved): 3072x8192
10.9 -> 13.3 GB/s, 11264x2048 12.5 -> 13.2 GB/s. Where THP is off, or the call fails, the memory
is ordinary pages (or the tensor is returned as it is): nothing else changes.
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import torch

HUGE = 2 << 20
MIN_BYTES = 4 << 20  # smaller tensors would not fill a huge page or two
_MADV_HUGEPAGE = 14


def _madvise() -> object | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


_MADVISE = _madvise()


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A copy of contiguous CPU tensor t in memory advised for huge pages; t itself when it is small,
    not on the CPU, or the platform cannot advise."""
    nbytes = t.numel() * t.element_size()
    if _MADVISE is None or t.device.type != "cpu" or not t.is_contiguous() or nbytes < MIN_BYTES:
        return t
    size = -(-nbytes // HUGE) * HUGE
    try:
        mm = mmap.mmap(-1, size + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, ValueError):
        return t
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    off = (-base) % HUGE
    _MADVISE(base + off, size, _MADV_HUGEPAGE)  # advice only: a failure leaves 4 KB pages
    # a storage of exactly the tensor's bytes (weight_bytes counts storages); it keeps mm alive
    out = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=off).view(t.dtype).view(t.shape)
    out.copy_(t)
    return out
