"""TierManager: the KV tiers' connector (core/kv_connector.py) and their index.

    device pool --evict--> host RAM --LRU evict (admission)--> disk, remote (background)
    device pool <--onload-- host RAM or staged <--prefetch (background)-- disk, remote

The bytes live in a TierStore (store.py: the tiers behind one interface). This class decides: it
hears of evicted blocks and copies them down before the next forward, looks a prompt's next
blocks up (host RAM on the step path; disk and remote by a prefetch that the request waits for,
core/kv_loads.py), plans the onloads, and keeps the index of what is where by chain hash, which
it publishes as KV events for routers. On the step path only memory is touched.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvserve.config import TierConfig
from kvserve.core.kv_connector import EvictedBlock, KVConnector, KVConnectorWorker, TierHit
from kvserve.core.kv_events import KVEventSink
from kvserve.core.kv_loads import BackgroundLoads
from kvserve.core.prefix_cache import block_tokens, compute_block_hashes, max_cached_blocks
from kvserve.core.sched_output import SchedulerOutput
from kvserve.kv_tiers.base import KVTier
from kvserve.kv_tiers.store import CPU, DISK, FLUSH_BUDGET_S, Name, TierStore
from kvserve.request import Request

logger = logging.getLogger(__name__)

_SAMPLE = 1 << 20


def model_fingerprint(model_path: str, weights: str, dtype: torch.dtype, block_shape: tuple[int, ...],
                      kv_scales: torch.Tensor | None = None) -> bytes:
    """Identity of what a KV block depends on besides its tokens: the weights (each weight
    file's name, size, first and last MiB, so the same checkpoint matches on any machine),
    how they were loaded (`weights`: compute dtype and quantization), the KV dtype, the
    block layout and, for an fp8 cache, the per-layer scales its codes are read with.
    Cheap: never reads whole files."""
    h = hashlib.sha256(b"kvserve.fingerprint.v1")
    root = Path(model_path)
    files = [root] if root.is_file() else sorted(p for p in root.iterdir() if p.is_file() and (
        p.suffix in (".safetensors", ".gguf", ".bin") or p.name == "config.json"))
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(_SAMPLE))
            if size > 2 * _SAMPLE:
                fh.seek(size - _SAMPLE)
                h.update(fh.read(_SAMPLE))
    h.update(f"{weights}\0{dtype}\0{list(block_shape)}".encode())
    if kv_scales is not None:
        h.update(b"\0kv_scales\0" + kv_scales.to(torch.float32).contiguous().numpy().tobytes())
    return h.digest()


@dataclass
class TierStepMeta:
    """One step's copies, in the order the worker half does them (an evicted block may be
    refilled by an onload or by this very step, so offloads are read out first)."""

    offloads: list[EvictedBlock]  # evicted blocks: read out before the forward
    onloads: list[tuple[int, TierHit]]  # (device block, hit): written in before the forward
    writes: list[tuple[str, EvictedBlock]]  # (request, block) the forward fills: sent to the remote tier


class TierManager(KVConnector, KVConnectorWorker):
    """Both halves of the KV tiers' connector, in the engine process; the worker half reaches
    the ranks' KV through the executor (`runner`).

    Threads: the engine thread calls every connector method. Prefetches (`_fetch`) run on the
    store's reader thread and hand what they staged back through `_loads`; the store's writer
    thread calls `stored` / `removed`, so the names index goes under `_lock`."""

    name = "tiers"

    def __init__(self, cfg: TierConfig, fingerprint: bytes, block_size: int, block_shape: tuple[int, ...],
                 dtype: torch.dtype) -> None:
        """block_shape: one block's K/V as the runner reads it, [layers, 2, block_size, kv_heads, head_dim]."""
        self.cfg = cfg
        self.block_size = block_size
        self.store = TierStore(cfg, fingerprint, block_shape, dtype, self)
        self._loads = BackgroundLoads()  # prefetches: request -> {key: (data, tier)} staged
        self._ready: dict[bytes, bytes] = {}  # verified data of this step's lookups, by key
        self._offloads: list[EvictedBlock] = []  # evicted since the last step
        self._onloads: list[tuple[int, TierHit]] = []  # allocated this step
        self._written: dict[str, int] = {}  # request id -> its full blocks sent to the remote tier
        self._lookups: dict[str, tuple[int, int]] = {}  # request id -> its last lookup's (queried, found)
        self.bytes_onloaded = 0
        # KV events (for routers): the sink, and the chain hash of each entry in the host and
        # disk tiers by key (a tier evicts by key; a router knows blocks by chain hash).
        self.events: KVEventSink | None = None
        self._lock = threading.Lock()
        self._names: dict[str, dict[bytes, Name]] = {CPU: {}, DISK: {}}

    def key(self, block_hash: bytes) -> bytes:
        return self.store.key(block_hash)

    # ---- the index: KV events (TierListener) -------------------------------------------

    def stored(self, tier: str, key: bytes, name: Name | None) -> None:
        if self.events is None or name is None:
            return
        if tier in self._names:
            with self._lock:
                self._names[tier][key] = name
        self.events.stored(name[0], name[1], tier)

    def removed(self, tier: str, key: bytes) -> Name | None:
        """Report the entry gone from `tier`; returns its (chain hash, parent) when known."""
        if self.events is None:
            return None
        with self._lock:
            name = self._names[tier].pop(key, None) if tier in self._names else None
        if name is not None:
            self.events.removed(name[0], tier)
        return name

    # ---- KVConnector: the step path ---------------------------------------------

    def on_evict(self, block: EvictedBlock) -> None:
        self._offloads.append(block)

    def on_allocated(self, request: Request, block_ids: list[int], hits: list[TierHit]) -> None:
        self._onloads.extend(zip(block_ids, hits))

    def build_meta(self, out: SchedulerOutput, requests: Mapping[str, Request]) -> TierStepMeta:
        writes = self._new_full_blocks(out, requests) if self.cfg.writes_through else []
        meta = TierStepMeta(self._offloads, self._onloads, writes)
        self._offloads, self._onloads = [], []
        return meta

    def _new_full_blocks(self, out: SchedulerOutput, requests: Mapping[str, Request]) -> list[tuple[str, EvictedBlock]]:
        """Full blocks the step's forward completes, not sent to the remote tier before."""
        todo: list[tuple[str, EvictedBlock]] = []
        for rid in out.num_scheduled_tokens:
            req = requests[rid]
            # Blocks the request found cached were computed (and sent) before.
            done = self._written.setdefault(rid, max(req.num_cached_tokens, 0) // self.block_size)
            full = min(req.num_computed_tokens // self.block_size, len(req.block_ids))
            hashes = compute_block_hashes(req, full, self.block_size)
            for i in range(done, full):
                todo.append((rid, EvictedBlock(req.block_ids[i], hashes[i], hashes[i - 1] if i else b"",
                                               block_tokens(req, i, self.block_size))))
            self._written[rid] = max(done, full)
        return todo

    def lookup(self, request: Request, start_block: int, max_blocks: int) -> list[TierHit]:
        self._lookups.pop(request.request_id, None)
        if start_block >= max_blocks:
            return []
        hashes = compute_block_hashes(request, max_blocks, self.block_size)
        staged = self._loads.peek(request.request_id) or {}
        hits: list[TierHit] = []
        queried = found = 0  # host-tier tokens, counted by count_lookup if the request is scheduled
        for i in range(start_block, max_blocks):
            key, parent = self.key(hashes[i]), hashes[i - 1] if i else b""
            if key in staged:
                self._ready[key], origin = staged[key]
                hits.append(TierHit(hashes[i], origin))
                continue
            queried += self.block_size
            data = self.store.get(key, parent, block_tokens(request, i, self.block_size))
            if data is None:
                break
            found += self.block_size
            self._ready[key] = data
            hits.append(TierHit(hashes[i], CPU))
        self._lookups[request.request_id] = (queried, found)
        return hits

    def count_lookup(self, request: Request) -> None:
        queried, found = self._lookups.pop(request.request_id, (0, 0))
        self.store.count(f"{CPU}_queries", queried)
        self.store.count(f"{CPU}_hits", found)
        self._loads.take(request.request_id)  # scheduled: what was staged for it is in _ready

    # ---- KVConnectorWorker: the copies -----------------------------------------------

    def after_forward(self, meta: TierStepMeta, runner: Any) -> None:
        # A request finished meanwhile (pipeline parallel: later steps ran) may have lost its blocks.
        todo = [b for rid, b in meta.writes if rid in self._written]
        if not todo:
            return
        # The copy is taken now (the blocks may be reused after this step); encoding and the
        # store's round trips happen on the writer thread.
        for b, data in zip(todo, runner.read_kv_blocks([b.block_id for b in todo])):
            self.store.put_remote(b, data)

    def before_forward(self, meta: TierStepMeta, runner: Any) -> None:
        """Copy evicted blocks out of the device, then loaded blocks in."""
        # A block loaded from RAM and evicted again is still there (same key, same content) with
        # its hit count, which admission to disk needs: only mark it recently used.
        kv_offload = [b for b in meta.offloads if not self.store.touch(self.key(b.block_hash))]
        if kv_offload:
            data = runner.read_kv_blocks([b.block_id for b in kv_offload])
            for b, d in zip(kv_offload, data):
                self.store.put(b, d)
        if meta.onloads:
            blocks = [self.store.to_tensor(self._ready.pop(self.key(hit.block_hash))) for _, hit in meta.onloads]
            runner.write_kv_blocks([b for b, _ in meta.onloads], torch.stack(blocks))
            self.bytes_onloaded += sum(len(b.untyped_storage()) for b in blocks)
        self._ready.clear()

    # ---- KVConnector: prefetch from slow tiers -------------------------------------

    def start_load(self, request: Request, num_device_blocks: int) -> bool:
        if not self.store.slow:
            return False
        max_blocks = max_cached_blocks(request, self.block_size)
        if num_device_blocks >= max_blocks:
            return False
        hashes = compute_block_hashes(request, max_blocks, self.block_size)
        keys = [self.key(h) for h in hashes]
        first = num_device_blocks
        while first < max_blocks and self.store.contains(keys[first]):
            first += 1
        if first >= max_blocks:
            return False
        todo = [(keys[i], hashes[i - 1] if i else b"", block_tokens(request, i, self.block_size))
                for i in range(first, max_blocks)]
        rid = request.request_id
        self._loads.begin(rid)
        self.store.submit_read(self._loads.run, rid, lambda: self._fetch(rid, todo))
        return True

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

    def finished_loading(self) -> list[str]:
        return self._loads.finished()

    def wait(self, timeout: float) -> None:
        """Block until a prefetch finishes or `timeout` passes (the engine has nothing else to do)."""
        self._loads.wait(timeout)

    def forget(self, request_id: str) -> None:
        self._lookups.pop(request_id, None)
        self._written.pop(request_id, None)
        self._loads.cancel(request_id)  # a fetch under way stops and drops what it staged

    # ---- management ---------------------------------------------------------------

    def tiers(self) -> list[KVTier]:
        return self.store.tiers()

    def stats(self) -> dict[str, int | float | bool | str]:
        return {"kv_tier_bytes_onloaded": self.bytes_onloaded, **self.store.stats()}

    def clear(self) -> dict[str, int]:
        with self._lock:
            for names in self._names.values():
                names.clear()
        out = self.store.clear()
        if self.events is not None:
            for name in out:
                self.events.cleared(name)
        return out

    def persist(self, cached: list[EvictedBlock], runner: Any, timeout: float = FLUSH_BUDGET_S) -> int:
        """Save what would be lost at shutdown to the disk tier (TierStore.persist)."""
        return self.store.persist(cached, runner.read_kv_blocks, timeout)

    def flush(self, timeout: float = FLUSH_BUDGET_S) -> None:
        self.store.flush(timeout)

    def close(self) -> None:
        self.store.close()
