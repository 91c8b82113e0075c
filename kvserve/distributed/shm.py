"""All-reduce and all-gather through shared memory, for the ranks of one group on one host.

gloo over loopback costs ~2.6 ms per all-reduce of one 576-float row on a 2-core VM
(measured: BENCHMARKS.md), and a decode step of a 30-layer model does 60 of them.
Here each rank copies its tensor into its own slot of a segment in /dev/shm, publishes
a sequence number, spins until every rank has published the same one, and then adds
the slots up in rank order, so every rank computes bit-identical sums. Two buffers
alternate: a rank can run at most one collective ahead of the slowest, so the buffer
it writes next was read by everyone already.
"""

from __future__ import annotations

import os
import time
import uuid

import numpy as np
import torch

# Bytes per rank per buffer; larger tensors go through in chunks of this size.
SLOT_BYTES = 8 * 1024 * 1024
_FLAG_STRIDE = 16  # int64 words between two ranks' flags: one cache line (and more) each
# Spin this many checks (~1 us each) before yielding the core between checks: a peer that shares
# our core (more ranks than cores) gets to run, and with a core each the yield returns at once.
_SPINS_BEFORE_YIELD = 64
_CHECKS_PER_CLOCK = 1024  # how often the timeout is checked


_NUMPY_DTYPES = (torch.float32, torch.float16, torch.float64)


def _add(a, b, out) -> None:
    if isinstance(out, np.ndarray):
        np.add(a, b, out=out)
    else:
        torch.add(a, b, out=out)


def _segment_bytes(world: int) -> int:
    return world * _FLAG_STRIDE * 8 + 2 * world * SLOT_BYTES


class ShmCollectives:
    """One group's shared segment: [flags][2 buffers x world slots of SLOT_BYTES].

    The group's first rank makes the file (create_file), every rank maps it, and the
    first unlinks it once all have: the memory lives as long as the mappings.
    """

    def __init__(self, path: str, rank: int, world: int, timeout: float) -> None:
        self.path, self.rank, self.world, self.timeout = path, rank, world, timeout
        flag_bytes = world * _FLAG_STRIDE * 8
        self._mem = torch.from_file(path, shared=True, size=_segment_bytes(world), dtype=torch.uint8)
        self._flags = self._mem[:flag_bytes].view(torch.int64).numpy()[::_FLAG_STRIDE]
        self._data = self._mem[flag_bytes:].view(2, world, SLOT_BYTES)
        self._seq = int(self._flags[rank])
        self._views: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}

    @staticmethod
    def create_file(world: int) -> str:
        """A zero-filled segment (every flag 0) for a group of `world` ranks; returns its path."""
        base = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
        path = os.path.join(base, f"kvserve-{uuid.uuid4().hex}")
        with open(path, "wb") as f:
            f.truncate(_segment_bytes(world))
        return path

    def unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _publish_and_wait(self) -> torch.Tensor:
        """Publish this rank's slot; return the buffer [world, SLOT_BYTES] once every rank has."""
        self._flags[self.rank] = self._seq
        flags, seq = self._flags, self._seq
        spins, deadline = 0, None
        while flags.min() < seq:
            spins += 1
            if spins > _SPINS_BEFORE_YIELD:
                os.sched_yield()
            if spins % _CHECKS_PER_CLOCK == 0:
                now = time.monotonic()
                deadline = deadline or now + self.timeout
                if now > deadline:
                    late = [r for r in range(self.world) if flags[r] < seq]
                    raise TimeoutError(f"shared-memory collective: rank(s) {late} of the group did not arrive "
                                       f"within {self.timeout:.0f} s")
        return self._data[seq % 2]

    def _slots(self, parity: int, dtype: torch.dtype) -> list:
        """Every rank's slot of buffer `parity` as a flat array of dtype, made once. numpy where it
        has the dtype: a step does ~60 all-reduces of a few KB, where torch's per-op overhead
        (~5-10 us a copy or add, measured) would cost more than the bytes."""
        key = (parity, dtype)
        if key not in self._views:
            views = [self._data[parity, r].view(dtype) for r in range(self.world)]
            self._views[key] = [v.numpy() for v in views] if dtype in _NUMPY_DTYPES else views
        return self._views[key]

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x (contiguous) over the group in place and return it; rank order, on every rank."""
        flat = x.view(-1)
        if x.dtype in _NUMPY_DTYPES:
            flat = flat.numpy()
        per = SLOT_BYTES // x.element_size()
        for start in range(0, len(flat), per):
            chunk = flat[start:start + per] if len(flat) > per else flat
            n = len(chunk)
            self._seq += 1
            slots = self._slots(self._seq % 2, x.dtype)
            slots[self.rank][:n] = chunk
            self._publish_and_wait()
            _add(slots[0][:n], slots[1][:n], chunk)
            for r in range(2, self.world):
                chunk += slots[r][:n]
        return x

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's x (same shape and dtype on every rank), in rank order."""
        if x.numel() * x.element_size() > SLOT_BYTES:
            raise ValueError(f"all_gather of {x.numel() * x.element_size()} bytes exceeds the "
                             f"shared-memory slot ({SLOT_BYTES} bytes)")
        self._seq += 1
        raw = x.contiguous().reshape(-1).view(torch.uint8)
        n = raw.numel()
        self._data[self._seq % 2, self.rank, :n].copy_(raw)
        slots = self._publish_and_wait()
        return [slots[r, :n].view(x.dtype).reshape(x.shape).clone() for r in range(self.world)]
