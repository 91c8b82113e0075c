"""TierManager: moves KV blocks between the device pool and the tiers below it.

    device pool --evict--> host RAM --LRU evict (admission)--> disk, remote (background)
    device pool <--onload-- host RAM or staged <--prefetch (background)-- disk, remote

On the step path only memory is touched: an evicted block's K/V are copied into
the host tier (or, without one, queued for the background writer), and onloads
come from the host tier or from blocks a background prefetch already staged in
memory. Disk and network I/O run on two daemon threads, one reading (prefetch,
latency-critical) and one writing (demotions, best effort: dropped when the
queue is full rather than letting memory grow).

An entry's key is sha256(model fingerprint, chain hash); the chain hash already
covers the parent chain and the cache_salt, so other models and other tenants
never share an entry. Entries carry the block's tokens and are checksummed
(codec.py): a corrupt or foreign entry is deleted and never loaded.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvserve.config import TierConfig
from kvserve.core.kv_connector import EvictedBlock, FinishedLoads, KVConnector, KVConnectorWorker, TierHit
from kvserve.core.kv_events import KVEventSink
from kvserve.core.prefix_cache import block_tokens, compute_block_hashes, max_cached_blocks
from kvserve.core.sched_output import SchedulerOutput
from kvserve.kv_tiers.base import Evicted, KVTier
from kvserve.kv_tiers.codec import CorruptEntryError, decode_entry, encode_entry
from kvserve.kv_tiers.disk import DiskTier
from kvserve.kv_tiers.host import HostTier
from kvserve.kv_tiers.remote import RemoteTier
from kvserve.request import Request

logger = logging.getLogger(__name__)

CPU, DISK, REMOTE = "cpu", "disk", "remote"
WRITE_QUEUE_MAX = 1024  # demotions waiting for disk / network; beyond it they are dropped
FLUSH_BUDGET_S = 10.0  # at close: how long pending writes may take


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
class _Staged:
    data: bytes
    origin: str


@dataclass
class TierStepMeta:
    """One step's copies, in the order the worker half does them (an evicted block may be
    refilled by an onload or by this very step, so offloads are read out first)."""

    offloads: list[EvictedBlock]  # evicted blocks: read out before the forward
    onloads: list[tuple[int, TierHit]]  # (device block, hit): written in before the forward
    writes: list[tuple[str, EvictedBlock]]  # (request, block) the forward fills: sent to the remote tier


class TierManager(KVConnector, KVConnectorWorker):
    """Both halves of the KV tiers' connector. They run in the engine process, which holds the
    tiers; the worker half reaches the ranks' KV through the executor (`runner`)."""

    def __init__(self, cfg: TierConfig, fingerprint: bytes, block_size: int, block_shape: tuple[int, ...],
                 dtype: torch.dtype) -> None:
        """block_shape: one block's K/V as the runner reads it, [layers, 2, block_size, kv_heads, head_dim]."""
        self.cfg = cfg
        self.fingerprint = fingerprint
        self.block_size = block_size
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.host = HostTier(cfg.cpu_bytes) if cfg.cpu_bytes else None
        self.disk = DiskTier(cfg.disk_path, cfg.disk_bytes) if cfg.disk_path else None
        self.remote = RemoteTier(cfg.remote_url) if cfg.remote_url else None
        self.slow: list[KVTier] = [t for t in (self.disk, self.remote) if t is not None]
        self._lock = threading.Lock()
        self._staged: dict[bytes, _Staged] = {}  # prefetched from slow tiers, waiting to be onloaded
        self._staged_by_req: dict[str, list[bytes]] = defaultdict(list)
        self._ready: dict[bytes, bytes] = {}  # verified data of this step's lookups, by key
        self._offloads: list[EvictedBlock] = []  # evicted since the last step
        self._onloads: list[tuple[int, TierHit]] = []  # allocated this step
        self._written: dict[str, int] = {}  # request id -> its full blocks sent to the remote tier
        self._done = FinishedLoads()
        self._fetching: set[str] = set()  # requests with a prefetch queued or running
        self._cancelled: set[str] = set()  # ... of those, the ones finished meanwhile
        self.stats_tokens: dict[str, int] = defaultdict(int)  # "<tier>_queries" / "<tier>_hits", in tokens
        self._lookups: dict[str, tuple[int, int]] = {}  # request id -> its last lookup's (queried, found)
        self.bytes_offloaded: dict[str, int] = defaultdict(int)
        self.bytes_onloaded = 0
        self.writes_dropped = 0
        self.write_failures: dict[str, int] = defaultdict(int)  # puts a tier did not store (I/O, unreachable)
        # KV events (for routers): the sink, and the chain hash of each entry in the host and
        # disk tiers by key (a tier evicts by key; a router knows blocks by chain hash).
        self.events: KVEventSink | None = None
        self._names: dict[str, dict[bytes, tuple[bytes, bytes]]] = {CPU: {}, DISK: {}}
        if self.disk is not None:
            self.disk.removed_listener = lambda key: self._removed(DISK, key)
        self._reads: queue.Queue = queue.Queue()
        self._writes: queue.Queue = queue.Queue(maxsize=WRITE_QUEUE_MAX)
        self._threads = [threading.Thread(target=self._loop, args=(q,), name=f"kvserve-tier-{n}", daemon=True)
                         for n, q in (("read", self._reads), ("write", self._writes))] if self.slow else []
        for t in self._threads:
            t.start()

    # ---- keys and entries -------------------------------------------------------

    def key(self, block_hash: bytes) -> bytes:
        return hashlib.sha256(b"kvserve.tier.v1" + self.fingerprint + block_hash).digest()

    def _encode(self, b: EvictedBlock, data: torch.Tensor) -> bytes:
        meta = {"parent": b.parent_hash, "tokens": list(b.tokens), "shape": list(self.block_shape),
                "dtype": str(self.dtype)}
        return encode_entry(self.key(b.block_hash), meta, data.contiguous().view(torch.uint8).numpy())

    def _decode(self, key: bytes, blob: bytes, parent: bytes, tokens: tuple[int, ...]) -> bytes:
        """The block data, after checking checksum, key, tokens, shape and dtype."""
        meta, data = decode_entry(key, blob)
        if (meta.get("parent") != parent or tuple(meta.get("tokens", ())) != tokens
                or tuple(meta.get("shape", ())) != self.block_shape or meta.get("dtype") != str(self.dtype)):
            raise CorruptEntryError("entry content does not match the block it is keyed by")
        return data

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
        hits: list[TierHit] = []
        queried = found = 0  # host-tier tokens, counted by count_lookup if the request is scheduled
        for i in range(start_block, max_blocks):
            key, parent = self.key(hashes[i]), hashes[i - 1] if i else b""
            with self._lock:
                staged = self._staged.get(key)
            if staged is not None:
                self._ready[key] = staged.data
                hits.append(TierHit(hashes[i], staged.origin))
                continue
            queried += self.block_size
            blob = self.host.get(key) if self.host is not None else None
            if blob is None:
                break
            found += self.block_size
            try:
                self._ready[key] = self._decode(key, blob, parent, block_tokens(request, i, self.block_size))
            except CorruptEntryError as e:
                logger.warning("dropping a corrupt host-tier KV entry: %s", e)
                self.host.delete(key)
                self._removed(CPU, key)
                break
            hits.append(TierHit(hashes[i], CPU))
        self._lookups[request.request_id] = (queried, found)
        return hits

    def count_lookup(self, request: Request) -> None:
        queried, found = self._lookups.pop(request.request_id, (0, 0))
        self.stats_tokens[f"{CPU}_queries"] += queried
        self.stats_tokens[f"{CPU}_hits"] += found

    # ---- KVConnectorWorker: the copies -----------------------------------------------

    def after_forward(self, meta: TierStepMeta, runner: Any) -> None:
        # A request finished meanwhile (pipeline parallel: later steps ran) may have lost its blocks.
        todo = [b for rid, b in meta.writes if rid in self._written]
        if not todo:
            return
        # The copy is taken now (the blocks may be reused after this step); encoding and the
        # store's round trips happen on the writer thread.
        for b, data in zip(todo, runner.read_kv_blocks([b.block_id for b in todo])):
            try:
                self._writes.put_nowait((self._write_new, (b, data)))
            except queue.Full:
                self.writes_dropped += 1

    def before_forward(self, meta: TierStepMeta, runner: Any) -> None:
        """Copy evicted blocks out of the device, then loaded blocks in."""
        kv_offload, kv_onload = meta.offloads, meta.onloads
        # A block loaded from RAM and evicted again is still there (same key, same content) with
        # its hit count, which admission to disk needs: only mark it recently used.
        if self.host is not None:
            kv_offload = [b for b in kv_offload if not self.host.touch(self.key(b.block_hash))]
        if kv_offload:
            data = runner.read_kv_blocks([b.block_id for b in kv_offload])
            for b, d in zip(kv_offload, data):
                self._store(b, d)
        if kv_onload:
            blocks = []
            for _, hit in kv_onload:
                key = self.key(hit.block_hash)
                raw = self._ready.pop(key)
                with self._lock:
                    self._staged.pop(key, None)
                blocks.append(torch.frombuffer(bytearray(raw), dtype=self.dtype).view(self.block_shape))
            runner.write_kv_blocks([b for b, _ in kv_onload], torch.stack(blocks))
            self.bytes_onloaded += sum(len(b.untyped_storage()) for b in blocks)
        self._ready.clear()

    def _store(self, b: EvictedBlock, data: torch.Tensor) -> None:
        blob, key, name = self._encode(b, data), self.key(b.block_hash), (b.block_hash, b.parent_hash)
        if self.host is None:
            self._demote([Evicted(key, blob, 0)], {key: name})
            return
        ok, evicted = self.host.put_evicting(key, blob)
        if ok:
            self.bytes_offloaded[CPU] += len(blob)
            self._stored(CPU, key, name)
        self._demote(evicted, {e.key: self._removed(CPU, e.key) for e in evicted})

    def _demote(self, entries: list[Evicted], names: dict[bytes, tuple[bytes, bytes] | None]) -> None:
        for e in entries:
            targets = [t for t, min_hits in ((self.disk, self.cfg.disk_min_hits),
                                             (self.remote, self.cfg.remote_min_hits))
                       if t is not None and e.hits >= min_hits]
            if not targets:
                continue
            try:
                self._writes.put_nowait((self._write, (e.key, e.blob, targets, names.get(e.key))))
            except queue.Full:
                self.writes_dropped += 1

    # ---- KV events ------------------------------------------------------------------

    def _stored(self, tier: str, key: bytes, name: tuple[bytes, bytes] | None) -> None:
        if self.events is None or name is None:
            return
        if tier in self._names:
            with self._lock:
                self._names[tier][key] = name
        self.events.stored(name[0], name[1], tier)

    def _removed(self, tier: str, key: bytes) -> tuple[bytes, bytes] | None:
        """Report the entry gone from `tier`; returns its (chain hash, parent) when known."""
        if self.events is None:
            return None
        with self._lock:
            name = self._names[tier].pop(key, None) if tier in self._names else None
        if name is not None:
            self.events.removed(name[0], tier)
        return name

    def _write_new(self, b: EvictedBlock, data: torch.Tensor) -> None:
        assert self.remote is not None
        key = self.key(b.block_hash)
        if self.remote.contains(key):
            return
        blob = self._encode(b, data)
        if self.remote.put(key, blob):
            self.bytes_offloaded[REMOTE] += len(blob)
            self._stored(REMOTE, key, (b.block_hash, b.parent_hash))
        else:
            self.write_failures[REMOTE] += 1

    # ---- KVConnector: prefetch from slow tiers -------------------------------------

    def start_load(self, request: Request, num_device_blocks: int) -> bool:
        if not self.slow:
            return False
        max_blocks = max_cached_blocks(request, self.block_size)
        if num_device_blocks >= max_blocks:
            return False
        hashes = compute_block_hashes(request, max_blocks, self.block_size)
        keys = [self.key(h) for h in hashes]
        first = num_device_blocks
        while first < max_blocks and self.host is not None and self.host.contains(keys[first]):
            first += 1
        if first >= max_blocks:
            return False
        todo = [(keys[i], hashes[i - 1] if i else b"", block_tokens(request, i, self.block_size))
                for i in range(first, max_blocks)]
        with self._lock:
            self._fetching.add(request.request_id)
        self._reads.put((self._fetch, (request.request_id, todo)))
        return True

    def finished_loading(self) -> list[str]:
        return self._done.drain()

    def wait(self, timeout: float) -> None:
        """Block until a prefetch finishes or `timeout` passes (the engine has nothing else to do)."""
        self._done.wait(timeout)

    def forget(self, request_id: str) -> None:
        self._lookups.pop(request_id, None)
        self._written.pop(request_id, None)
        with self._lock:
            if request_id in self._fetching:
                self._cancelled.add(request_id)  # the fetch stops and drops what it staged
            for key in self._staged_by_req.pop(request_id, []):
                self._staged.pop(key, None)

    # ---- background threads -------------------------------------------------------

    def _loop(self, q: queue.Queue) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            fn, args = item
            try:
                fn(*args)
            except Exception:  # a tier bug must not kill the thread
                logger.exception("KV tier background task failed")
            finally:
                q.task_done()

    def _fetch(self, request_id: str, todo: list[tuple[bytes, bytes, tuple[int, ...]]]) -> None:
        """Stage the longest run of blocks found in disk, then remote; stop at the first miss."""
        try:
            for key, parent, tokens in todo:
                data = None
                for tier in self.slow:
                    self.stats_tokens[f"{tier.name}_queries"] += self.block_size
                    blob = tier.get(key)
                    if blob is None:
                        continue
                    try:
                        data = self._decode(key, blob, parent, tokens)
                    except CorruptEntryError as e:
                        logger.warning("deleting a corrupt %s-tier KV entry: %s", tier.name, e)
                        tier.delete(key)
                        self._removed(tier.name, key)
                        continue
                    self.stats_tokens[f"{tier.name}_hits"] += self.block_size
                    with self._lock:
                        if request_id in self._cancelled:
                            return
                        self._staged[key] = _Staged(data, tier.name)
                        self._staged_by_req[request_id].append(key)
                    break
                if data is None:
                    return
        finally:
            with self._lock:
                self._fetching.discard(request_id)
                if request_id in self._cancelled:  # finished while we fetched: nobody will onload
                    self._cancelled.discard(request_id)
                    for key in self._staged_by_req.pop(request_id, []):
                        self._staged.pop(key, None)
            self._done.put(request_id)

    def _write(self, key: bytes, blob: bytes, targets: list[KVTier], name: tuple[bytes, bytes] | None = None) -> None:
        for tier in targets:
            if tier.put(key, blob):
                self.bytes_offloaded[tier.name] += len(blob)
                self._stored(tier.name, key, name)
            else:
                self.write_failures[tier.name] += 1

    # ---- management ---------------------------------------------------------------

    def tiers(self) -> list[KVTier]:
        return [t for t in (self.host, self.disk, self.remote) if t is not None]

    def stats(self) -> dict[str, int | float | bool | str]:
        out: dict[str, int | float | bool | str] = {"kv_tier_bytes_onloaded": self.bytes_onloaded,
                                                     "kv_tier_writes_dropped": self.writes_dropped}
        for tier in self.tiers():
            s = tier.stats()
            n = tier.name
            out.update({f"kv_tier_{n}_queries": self.stats_tokens[f"{n}_queries"],
                        f"kv_tier_{n}_hits": self.stats_tokens[f"{n}_hits"],
                        f"kv_tier_{n}_bytes_offloaded": self.bytes_offloaded[n],
                        f"kv_tier_{n}_entries": s["entries"], f"kv_tier_{n}_bytes_used": s["bytes_used"],
                        f"kv_tier_{n}_capacity_bytes": s["capacity_bytes"],
                        f"kv_tier_{n}_available": bool(s["available"]),
                        f"kv_tier_{n}_write_failures": self.write_failures[n],
                        # unreachable, or its last write failed (a full disk): KV is not being kept there
                        f"kv_tier_{n}_degraded": not s["available"] or bool(s.get("write_failing"))})
        return out

    def clear(self) -> dict[str, int]:
        with self._lock:
            self._staged.clear()
            self._staged_by_req.clear()
            for names in self._names.values():
                names.clear()
        out = {t.name: t.clear() for t in self.tiers()}
        if self.events is not None:
            for name in out:
                self.events.cleared(name)
        return out

    def persist(self, cached: list[EvictedBlock], runner: Any, timeout: float = FLUSH_BUDGET_S) -> int:
        """Save what would be lost at shutdown to the disk tier: blocks still cached on the
        device, then the host tier's entries (most recently used first); returns how many
        were written. Bounded by `timeout` so a stop never hangs on a slow disk."""
        if self.disk is None:
            return 0
        deadline, written = time.monotonic() + timeout, 0
        todo = [b for b in cached if not self.disk.contains(self.key(b.block_hash))]
        for i in range(0, len(todo), 64):
            if time.monotonic() > deadline:
                return written
            chunk = todo[i:i + 64]
            for b, d in zip(chunk, runner.read_kv_blocks([b.block_id for b in chunk])):
                written += self.disk.put(self.key(b.block_hash), self._encode(b, d))
        for key in reversed(self.host.keys_lru() if self.host is not None else []):
            if time.monotonic() > deadline:
                break
            blob = self.host.get(key)
            if blob is not None and not self.disk.contains(key):
                written += self.disk.put(key, blob)
        return written

    def flush(self, timeout: float = FLUSH_BUDGET_S) -> None:
        """Wait (up to `timeout`) until queued background writes are on disk / in the store."""
        deadline = time.monotonic() + timeout
        while self._writes.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        self.flush()
        for q in (self._reads, self._writes):
            try:
                q.put(None, timeout=5)  # the write queue may be full: wait a little for room
            except queue.Full:
                pass
        for t in self._threads:
            t.join(timeout=5)
        for tier in self.tiers():
            tier.close()
