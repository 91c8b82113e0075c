"""A process group and the collectives models use; with one rank every op returns its input.

Layers take a `Group` (tensor-parallel, expert-parallel) and call all_reduce / all_gather
on it, never torch.distributed directly, so a one-rank model pays nothing and a group
whose ranks share a host can use shared memory instead of gloo's sockets.
"""

from __future__ import annotations

import functools
import time

import torch
import torch.distributed as dist

from kvserve.distributed.shm import SLOT_BYTES, ShmCollectives


def _timed(fn):
    """Count a collective's calls and wall time (waiting for the slowest rank included): where a
    step's time goes, for benchmarks (Worker.comm_stats)."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        if self.size == 1:
            return fn(self, *args, **kwargs)
        start = time.perf_counter()
        try:
            return fn(self, *args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1

    return wrapper


class Group:
    """Ranks `ranks` (global ranks, in group order); this process is `global_rank`."""

    def __init__(self, ranks: list[int], global_rank: int, pg=None, shm: ShmCollectives | None = None) -> None:
        self.ranks = list(ranks)
        self.global_rank = global_rank
        self.rank = self.ranks.index(global_rank) if global_rank in self.ranks else -1
        self.size = len(self.ranks)
        self.pg = pg
        self.shm = shm
        self.seconds = 0.0  # in collectives, since the last reset (see _timed)
        self.calls = 0

    @classmethod
    def single(cls) -> Group:
        return cls([0], 0)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    @_timed
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group; returns x's values summed (in place where possible)."""
        if self.size == 1:
            return x
        x = x.contiguous()
        if self.shm is not None:
            return self.shm.all_reduce(x)
        dist.all_reduce(x, group=self.pg)
        return x

    @_timed
    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's x (same shape everywhere) along dim, in rank order."""
        if self.size == 1:
            return x
        x = x.contiguous()
        if self.shm is not None and x.numel() * x.element_size() <= SLOT_BYTES:
            parts = self.shm.all_gather(x)
        else:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x, group=self.pg)
        return torch.cat(parts, dim=dim)

    @_timed
    def all_to_all(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        """Rows [in_splits[r]] of x go to rank r; returns the rows every rank sent here, in rank order."""
        if self.size == 1:
            return x
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=self.pg)
        return out

    def all_gather_object(self, obj) -> list:
        if self.size == 1:
            return [obj]
        out = [None] * self.size
        dist.all_gather_object(out, obj, group=self.pg)
        return out

    @_timed
    def send(self, tensors: list[torch.Tensor], dst: int) -> None:
        """Point to point, to group rank dst (pipeline stages)."""
        for t in tensors:
            dist.send(t.contiguous(), self.ranks[dst], group=self.pg)

    @_timed
    def recv(self, tensors: list[torch.Tensor], src: int) -> list[torch.Tensor]:
        """Fill the given (preallocated, right-shaped) tensors from group rank src."""
        for t in tensors:
            dist.recv(t, self.ranks[src], group=self.pg)
        return tensors

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.pg)
