"""What the scheduler needs from KV storage below the device pool (kv_tiers/ implements it).

The scheduler and the KV manager stay pure bookkeeping: they hand the connector
blocks the prefix cache evicts (their K/V are still intact until the next model
step), ask it which further prompt blocks it can supply right now, and carry the
resulting copies in the SchedulerOutput:

    kv_offload  [(device block id, EvictedBlock)]  read out BEFORE the step writes anything
    kv_onload   [(device block id, TierHit)]       written into fresh blocks before the forward

Slower tiers (disk, a network store) are never touched on the step path: a new
request may first be `prefetch`ed into the fast tier in the background, and is
not scheduled until `poll` says its loads are done.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from kvserve.request import Request

DEVICE_TIER = "device"


@dataclass(frozen=True, slots=True)
class EvictedBlock:
    """A full cached block leaving the device pool, with what identifies its content."""

    block_id: int
    block_hash: bytes  # the prefix-cache chain hash (covers the parent chain and the cache_salt)
    parent_hash: bytes
    tokens: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class TierHit:
    """One block the connector can write into a device block now."""

    block_hash: bytes
    origin: str  # the tier it came from, for the cached-token split ("cpu", "disk", "remote")


class KVConnector(ABC):
    @abstractmethod
    def on_evict(self, block: EvictedBlock) -> None:
        """The prefix cache dropped this block; offload it (its copy goes out with the next step)."""

    @abstractmethod
    def lookup(self, request: Request, start_block: int, max_blocks: int) -> list[TierHit]:
        """Consecutive full blocks start_block, start_block + 1, ... (below max_blocks) of the
        request's prompt that can be onloaded in this step. Takes nothing out of any tier."""

    @abstractmethod
    def count_lookup(self, request: Request) -> None:
        """The request was scheduled with its last lookup's hits: count that lookup in the tier
        hit rates (a request that waits for room looks up again every step; it counts once)."""

    @abstractmethod
    def prefetch(self, request: Request, num_device_blocks: int) -> bool:
        """A new request whose first num_device_blocks blocks are on the device: start
        bringing its next blocks up from slow tiers. True if it should wait for `poll`."""

    @abstractmethod
    def poll(self) -> list[str]:
        """Request ids whose prefetch has finished (successfully or not) since the last call."""

    @abstractmethod
    def take_offloads(self) -> list[EvictedBlock]:
        """Blocks evicted since the last call, in eviction order; the caller copies them out."""

    @abstractmethod
    def cancel(self, request_id: str) -> None:
        """The request is gone; forget any prefetch bookkeeping for it."""
