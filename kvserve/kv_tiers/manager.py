"""TierManager: the scheduler role of the KV tiers' connector (core/kv_connector.py), and its index.

    device pool --evict--> host RAM --LRU evict (admission)--> disk, remote (background)
    device pool <--onload-- host RAM or staged <--prefetch (background)-- disk, remote

The bytes live in the output rank's TierStore (store.py), which the worker role (worker.py) runs
inside the ranks; this class decides. It hears of evicted blocks and plans their copy down before
the next forward, looks a prompt's next blocks up in its mirror of host RAM's keys (on the step
path) or in what a prefetch from disk and remote staged for a request that waited for it, plans
the onloads, and publishes the tiers' events (what entered and left each tier, by chain hash) for
routers. What the stores hold is reported back with each step (`update_connector_output`);
management (flush, persist, clear) goes to the ranks through the engine's `rpc`.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from kvserve.config import TierConfig
from kvserve.core.kv_connector import EvictedBlock, KVConnector, TierHit
from kvserve.core.kv_events import KVEventSink
from kvserve.core.kv_loads import IDLE_WAIT_S
from kvserve.core.prefix_cache import block_tokens, compute_block_hashes, max_cached_blocks
from kvserve.core.sched_output import SchedulerOutput
from kvserve.kv_tiers.store import CPU, FLUSH_BUDGET_S, entry_key
from kvserve.kv_tiers.worker import Onload, TierStepMeta
from kvserve.request import Request

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


class TierManager(KVConnector):
    """The engine thread calls everything. `rpc(method, *args)` calls a TierWorker method on
    every rank and returns the output rank's answer."""

    name = "tiers"

    def __init__(self, cfg: TierConfig, fingerprint: bytes, block_size: int,
                 rpc: Callable[..., Any]) -> None:
        self.cfg = cfg
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.rpc = rpc
        self.slow = bool(cfg.disk_path or cfg.remote_url)
        self._host: set[bytes] = set()  # the keys host RAM holds, as the output rank last reported
        self._step = TierStepMeta()
        self._last: dict[str, list[Onload]] = {}  # request -> its last lookup's hits, as onloads
        self._fetching: set[str] = set()  # requests whose prefetch runs in the output rank
        self._staged: dict[str, dict[bytes, str]] = {}  # request -> keys its prefetch staged -> tier
        self._finished: list[str] = []
        self._written: dict[str, int] = {}  # request id -> its full blocks sent to the remote tier
        self._lookups: dict[str, tuple[int, int]] = {}  # request id -> its last lookup's (queried, found)
        self.counts = {f"{CPU}_queries": 0, f"{CPU}_hits": 0}  # host-RAM lookups, in tokens
        self._pending_writes = 0  # the output rank's queued writes, when it last reported
        self._worker_waits = False  # the last step's plan has the worker role wait for a prefetch
        self.events: KVEventSink | None = None

    def key(self, block_hash: bytes) -> bytes:
        return entry_key(self.fingerprint, block_hash)

    # ---- what the ranks report ----------------------------------------------------------

    def update_connector_output(self, output: dict[str, Any] | None) -> None:
        if not output:
            return
        for op, tier, key, name in output["events"]:
            if tier == CPU:
                (self._host.add if op == "stored" else self._host.discard)(key)
            if self.events is not None and name is not None:
                if op == "stored":
                    self.events.stored(name[0], name[1], tier)
                else:
                    self.events.removed(name[0], tier)
        for rid, staged in output["done"].items():
            if rid in self._fetching:
                self._fetching.discard(rid)
                self._staged[rid] = dict(staged)
                self._finished.append(rid)
        self._pending_writes = output["pending_writes"]

    def needs_step(self, meta: TierStepMeta | None) -> bool:
        """A plan to carry out, a prefetch under way, or writes whose events are still to come."""
        plan = meta is not None and bool(meta.offloads or meta.touches or meta.onloads or meta.fetches
                                          or meta.cancels or meta.writes)
        return plan or bool(self._fetching) or self._pending_writes > 0

    # ---- the step path ------------------------------------------------------------------

    def on_evict(self, block: EvictedBlock) -> None:
        key = self.key(block.block_hash)
        # A block loaded from RAM and evicted again is still there (same key, same content) with
        # its hit count, which admission to disk needs: only mark it recently used.
        if key in self._host:
            self._step.touches.append(key)
        else:
            self._step.offloads.append(block)

    def lookup(self, request: Request, start_block: int, max_blocks: int) -> list[TierHit]:
        rid = request.request_id
        self._lookups.pop(rid, None)
        self._last.pop(rid, None)
        if start_block >= max_blocks:
            return []
        hashes = compute_block_hashes(request, max_blocks, self.block_size)
        staged = self._staged.get(rid, {})
        hits: list[TierHit] = []
        loads: list[Onload] = []
        queried = found = 0  # host-tier tokens, counted by count_lookup if the request is scheduled
        for i in range(start_block, max_blocks):
            key, parent = self.key(hashes[i]), hashes[i - 1] if i else b""
            tokens = block_tokens(request, i, self.block_size)
            if key in staged:
                hits.append(TierHit(hashes[i], staged[key]))
                loads.append(Onload(-1, key, parent, tokens, rid))
                continue
            queried += self.block_size
            if key not in self._host:
                break
            found += self.block_size
            hits.append(TierHit(hashes[i], CPU))
            loads.append(Onload(-1, key, parent, tokens, None))
        self._lookups[rid] = (queried, found)
        self._last[rid] = loads
        return hits

    def count_lookup(self, request: Request) -> None:
        queried, found = self._lookups.pop(request.request_id, (0, 0))
        self.counts[f"{CPU}_queries"] += queried
        self.counts[f"{CPU}_hits"] += found

    def on_allocated(self, request: Request, block_ids: list[int], hits: list[TierHit]) -> None:
        loads = self._last.pop(request.request_id)
        for block_id, load in zip(block_ids, loads):
            load.block_id = block_id
            self._step.onloads.append(load)
        if self._staged.pop(request.request_id, None) is not None:
            self._step.cancels.append(request.request_id)  # the worker drops the rest after this step's onloads

    def build_meta(self, out: SchedulerOutput, requests: Mapping[str, Request]) -> TierStepMeta:
        if self.cfg.writes_through:
            self._step.writes = self._new_full_blocks(out, requests)
        if self._fetching and not out.num_scheduled_tokens:
            self._step.idle_wait_s = IDLE_WAIT_S
        meta, self._step = self._step, TierStepMeta()
        self._worker_waits = meta.idle_wait_s > 0
        return meta

    def wait(self, timeout: float) -> None:
        """Nothing to run but waiting requests: when this step's worker role waits for their
        prefetch (TierStepMeta.idle_wait_s) the engine goes straight on; otherwise it sleeps, so
        an engine that only waits for news (queued writes) does not spin and starve the writer."""
        if not self._worker_waits:
            time.sleep(timeout)

    def _new_full_blocks(self, out: SchedulerOutput, requests: Mapping[str, Request]) -> list[EvictedBlock]:
        """Full blocks the step's forward completes, not sent to the remote tier before."""
        todo: list[EvictedBlock] = []
        for rid in out.num_scheduled_tokens:
            req = requests[rid]
            # Blocks the request found cached were computed (and sent) before.
            done = self._written.setdefault(rid, max(req.num_cached_tokens, 0) // self.block_size)
            # Known tokens only: with speculative decoding num_computed_tokens also counts drafts.
            full = min(min(req.num_computed_tokens, req.num_tokens) // self.block_size, len(req.block_ids))
            hashes = compute_block_hashes(req, full, self.block_size)
            for i in range(done, full):
                todo.append(EvictedBlock(req.block_ids[i], hashes[i], hashes[i - 1] if i else b"",
                                         block_tokens(req, i, self.block_size)))
            self._written[rid] = max(done, full)
        return todo

    # ---- prefetch from the slow tiers -------------------------------------------------

    def start_load(self, request: Request, num_device_blocks: int) -> bool:
        if not self.slow:
            return False
        max_blocks = max_cached_blocks(request, self.block_size)
        if num_device_blocks >= max_blocks:
            return False
        hashes = compute_block_hashes(request, max_blocks, self.block_size)
        keys = [self.key(h) for h in hashes]
        first = num_device_blocks
        while first < max_blocks and keys[first] in self._host:
            first += 1
        if first >= max_blocks:
            return False
        todo = [(keys[i], hashes[i - 1] if i else b"", block_tokens(request, i, self.block_size))
                for i in range(first, max_blocks)]
        self._fetching.add(request.request_id)
        self._step.fetches.append((request.request_id, todo))
        return True

    def finished_loading(self) -> list[str]:
        out, self._finished = self._finished, []
        return out

    def forget(self, request_id: str) -> None:
        self._lookups.pop(request_id, None)
        self._last.pop(request_id, None)
        self._written.pop(request_id, None)
        planned = [f for f in self._step.fetches if f[0] == request_id]
        if planned:  # its prefetch never reached the worker
            self._step.fetches.remove(planned[0])
            self._fetching.discard(request_id)
        elif request_id in self._fetching or self._staged.pop(request_id, None) is not None:
            self._fetching.discard(request_id)
            self._step.cancels.append(request_id)  # a prefetch under way stops and drops what it staged

    # ---- management ---------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Host RAM's lookups (the rest comes from the output rank's worker role)."""
        if not self.cfg.cpu_bytes:
            return {}
        return {f"kv_tier_{CPU}_queries": self.counts[f"{CPU}_queries"], f"kv_tier_{CPU}_hits": self.counts[f"{CPU}_hits"]}

    def clear(self) -> dict[str, int]:
        out = self.rpc("clear")
        self._host.clear()
        self._staged.clear()
        if self.events is not None:
            for name in out:
                self.events.cleared(name)
        return out

    def persist(self, cached: list[EvictedBlock], timeout: float = FLUSH_BUDGET_S) -> int:
        """Save the device's cached blocks the disk tier lacks, then host RAM's entries, to disk."""
        missing = self.rpc("missing_on_disk", [self.key(b.block_hash) for b in cached])
        return self.rpc("persist", [cached[i] for i in missing], timeout)

    def flush(self, timeout: float = FLUSH_BUDGET_S) -> None:
        """Wait (up to `timeout`) until queued background writes are on disk / in the store."""
        self.rpc("flush", timeout)
