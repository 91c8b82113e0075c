"""TierWorker: the KV tiers' worker role, built inside every rank.

The output rank (last stage, first tensor-parallel rank) holds the tiers (a TierStore: host RAM,
disk, remote) and their reader and writer threads; every rank gives its piece of each block to
it, or takes its piece from it (worker/kv_blocks.py), so whole blocks never pass through the
engine process. The scheduler role (manager.py) plans each step in a TierStepMeta:

- offloads: blocks the prefix cache evicted, copied out before the forward (or only marked
  recently used, when host RAM holds them already);
- onloads: entries written into new blocks before the forward, from host RAM or from what a
  prefetch staged (both checked by the codec first);
- fetches / cancels: prefetches from disk and remote on the reader thread, for requests that wait;
- writes: blocks the forward fills, sent to the remote tier (write-through).

`take_output` reports which prefetches finished (the keys they staged) and the tiers' events:
entries stored in and removed from a tier, with the chain hashes routers know blocks by, which the
scheduler role mirrors (host RAM's keys, for its lookups) and publishes. A host entry that fails
its check at onload means this process's own memory is broken: it raises, and the engine stops.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.config import TierConfig
from kvserve.core.kv_connector import EvictedBlock, KVConnectorWorker
from kvserve.core.kv_loads import BackgroundLoads
from kvserve.kv_tiers.codec import CorruptEntryError
from kvserve.kv_tiers.store import CPU, DISK, FLUSH_BUDGET_S, Name, TierStore

Event = tuple[str, str, bytes, Name | None]  # ("stored" | "removed", tier, key, (chain hash, parent))


@dataclass
class Onload:
    block_id: int
    key: bytes
    parent: bytes
    tokens: tuple[int, ...]
    request_id: str | None  # staged by this request's prefetch; None: from host RAM


@dataclass
class TierStepMeta:
    """One step's copies, in the order the worker does them (an evicted block may be refilled by
    an onload or by this very step, so offloads are read out first)."""

    offloads: list[EvictedBlock] = field(default_factory=list)  # read out before the forward
    touches: list[bytes] = field(default_factory=list)  # evicted, already in host RAM: keys to mark used
    onloads: list[Onload] = field(default_factory=list)  # written in before the forward
    fetches: list[tuple[str, list[tuple[bytes, bytes, tuple[int, ...]]]]] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)  # after this step's onloads: drop what was staged
    writes: list[EvictedBlock] = field(default_factory=list)  # filled by the forward: to the remote tier
    idle_wait_s: float = 0.0  # no token this step, prefetches under way: wait for one (kv_loads.IDLE_WAIT_S)


class TierWorker(KVConnectorWorker):
    """Threads: the rank's step thread calls everything. On the output rank the store's reader
    thread runs prefetches (`_fetch`, through `_loads`) and its writer thread stores entries;
    both report events through `stored` / `removed`, whose names map and buffer go under `_lock`."""

    def __init__(self, cfg: TierConfig, blocks: Any) -> None:
        self.cfg = cfg
        self.blocks = blocks  # worker/kv_blocks.py WholeBlocks
        self.leader = blocks.is_leader
        self.store: TierStore | None = None
        self._loads = BackgroundLoads()  # prefetches: request -> {key: (data, tier)} staged
        self._lock = threading.Lock()
        self._names: dict[str, dict[bytes, Name]] = {CPU: {}, DISK: {}}
        self._events: list[Event] = []
        self.bytes_onloaded = 0
        # Host RAM's victims of the last few steps, by step: the scheduler role plans onloads from
        # its mirror of host RAM, which hears of an eviction with the step's output, up to one
        # step per pipeline stage later (batches in flight).
        self._victims: deque[dict[bytes, bytes]] = deque(maxlen=blocks.pp + 1)

    def configure(self, fingerprint: bytes) -> None:
        """The model's fingerprint (entry keys depend on it); the output rank opens the tiers."""
        if self.leader:
            self.store = TierStore(self.cfg, fingerprint, self.blocks.shape, self.blocks.dtype, self)

    # ---- events (TierListener) --------------------------------------------------------------

    def stored(self, tier: str, key: bytes, name: Name | None) -> None:
        with self._lock:
            if name is not None and tier in self._names:
                self._names[tier][key] = name
            self._events.append(("stored", tier, key, name))

    def removed(self, tier: str, key: bytes) -> Name | None:
        with self._lock:
            name = self._names[tier].pop(key, None) if tier in self._names else None
            self._events.append(("removed", tier, key, name))
        return name

    # ---- the step ---------------------------------------------------------------------------

    def before_forward(self, meta: TierStepMeta | None, runner: Any) -> None:
        if meta is None:
            return
        store = self.store
        if self.leader:
            for key in meta.touches:
                store.touch(key)
            for rid, todo in meta.fetches:
                self._loads.begin(rid)
                store.submit_read(self._loads.run, rid, lambda rid=rid, todo=todo: self._fetch(rid, todo))
        # The entries to load are read first (the offloads below may evict them from host RAM), the
        # evicted blocks are read out of the device next (an onload may refill one), then written.
        onload = torch.stack([self._onload_data(o) for o in meta.onloads]) if self.leader and meta.onloads else None
        if self.leader:
            for rid in meta.cancels:  # gone, or loaded just now: drop what was staged (a prefetch stops)
                self._loads.cancel(rid)
        victims: dict[bytes, bytes] = {}
        if meta.offloads:
            data = self.blocks.gather([b.block_id for b in meta.offloads])
            if self.leader:
                for b, d in zip(meta.offloads, data):
                    victims.update((e.key, e.blob) for e in store.put(b, d))
        if self.leader:
            self._victims.append(victims)
        if meta.onloads:
            self.blocks.scatter([o.block_id for o in meta.onloads], onload)
            if self.leader:
                self.bytes_onloaded += onload.numel() * onload.element_size()

    def _onload_data(self, o: Onload) -> torch.Tensor:
        store = self.store
        if o.request_id is not None:
            staged = self._loads.peek(o.request_id) or {}
            if o.key in staged:
                return store.to_tensor(staged[o.key][0])
        try:
            data = store.get(o.key, o.parent, o.tokens, strict=True)
            if data is None:
                blob = next((v[o.key] for v in self._victims if o.key in v), None)
                if blob is None:
                    raise RuntimeError("KV tiers: a host-RAM entry the scheduler role planned to load is gone "
                                       "(its mirror of host RAM is out of step)")
                data = store.decode(o.key, blob, o.parent, o.tokens)
        except CorruptEntryError as e:
            raise RuntimeError(f"KV tiers: a host-RAM entry this process wrote fails its check ({e}): its "
                               f"memory is not what it wrote") from e
        return store.to_tensor(data)

    def after_forward(self, meta: TierStepMeta | None, runner: Any) -> None:
        if meta is None:
            return
        if meta.idle_wait_s and self.leader:  # nothing else to do: report a prefetch the moment it ends
            self._loads.wait(meta.idle_wait_s)
        if meta.writes:
            # The copy is taken now (the blocks may be reused after this step); encoding and the
            # store's round trips happen on the writer thread.
            data = self.blocks.gather([b.block_id for b in meta.writes])
            if self.leader:
                for b, d in zip(meta.writes, data):
                    self.store.put_remote(b, d)

    def take_output(self) -> dict[str, Any] | None:
        if self.store is None:  # not the output rank, or not configured yet (the engine's start-up steps)
            return None
        done = {rid: list((self._loads.peek(rid) or {}).items()) for rid in self._loads.finished()}
        pending = self.store.pending_writes  # before the events: a write done after this is reported next time
        with self._lock:
            events, self._events = self._events, []
        return {"done": {rid: [(key, tier) for key, (_, tier) in staged] for rid, staged in done.items()},
                "events": events, "pending_writes": pending}

    def _fetch(self, request_id: str, todo: list[tuple[bytes, bytes, tuple[int, ...]]]) -> dict[bytes, tuple[bytes, str]]:
        """On the reader thread: the longest run of blocks found in disk, then remote (verified),
        stopping at the first miss or when the request is gone."""
        staged: dict[bytes, tuple[bytes, str]] = {}
        for key, parent, tokens in todo:
            if self._loads.cancelled(request_id):
                break
            found = self.store.fetch(key, parent, tokens)
            if found is None:
                break
            staged[key] = found
        return staged

    # ---- management (the engine's collective_rpc) ----------------------------------------------

    def missing_on_disk(self, keys: list[bytes]) -> list[int] | None:
        """Indices of the keys the disk tier lacks (None off the output rank)."""
        if not self.leader:
            return None
        disk = self.store.disk
        return [i for i, k in enumerate(keys) if disk is not None and not disk.contains(k)]

    def persist(self, blocks: list[EvictedBlock], timeout: float = FLUSH_BUDGET_S) -> int:
        """Every rank: save these device blocks, then host RAM's entries, to the disk tier."""
        read = self.blocks.gather  # the output rank's whole blocks; None on the others
        if not self.leader:
            for i in range(0, len(blocks), 64):  # the output rank gathers them all
                read([b.block_id for b in blocks[i:i + 64]])
            return 0
        return self.store.persist(blocks, read, timeout, every_chunk=self.blocks.world > 1)

    def flush(self, timeout: float = FLUSH_BUDGET_S) -> None:
        if self.leader:
            self.store.flush(timeout)

    def clear(self) -> dict[str, int] | None:
        if not self.leader:
            return None
        with self._lock:
            for names in self._names.values():
                names.clear()
        return self.store.clear()

    def stats(self) -> dict[str, Any]:
        if self.store is None:
            return {}
        return {"kv_tier_bytes_onloaded": self.bytes_onloaded, **self.store.stats()}

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None
