"""PDWorker: the worker role of prefill/decode transfer, built inside every rank.

The K/V move between the ranks and the wire without passing through the engine process: the
output rank (last stage, first tensor-parallel rank) holds the KVSender and runs the fetches;
every rank gives its piece of a block to it, or takes its piece from it (worker/kv_blocks.py).
What the scheduler role (connector.py) asked for arrives as the step's PDStepMeta:

- sends: gather a finished prompt's blocks and hand them to the sender under the transfer id the
  scheduler role put in the signed params;
- fetches: pull a transfer from a prefill engine on a thread; keep it once it checks out
  (shape, dtype, size and signed digest in transport.py; the claimed chain hashes equal the ones
  the scheduler role computed from the prompt);
- writes: scatter fetched blocks into the request's new blocks before the forward;
- cancels: drop what a forgotten request's fetch brings.

`take_output` reports what was sent, which fetches finished (how many blocks each brought, or why
it failed under kv_load_failure_policy fail) and the counters.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.config import KVTransferConfig
from kvserve.core.kv_connector import KVConnectorWorker
from kvserve.core.kv_loads import BackgroundLoads
from kvserve.disagg.auth import TransferAuth
from kvserve.disagg.transport import KVSender, KVTransferError, fetch

logger = logging.getLogger(__name__)

PER_PEER_FETCHES = 2  # a prefill engine's fetches at once; a silent one holds no more threads than this


@dataclass
class SendPlan:
    request_id: str
    transfer_id: str
    block_ids: list[int]
    hashes: list[bytes]


@dataclass
class FetchPlan:
    request_id: str
    host: str
    port: int
    transfer_id: str
    num_blocks: int
    hashes: list[bytes]  # the prompt's chain hashes, computed by the decode engine


@dataclass
class WritePlan:
    request_id: str
    block_ids: list[int]
    indices: list[int]  # which fetched blocks go into block_ids


@dataclass
class PDStepMeta:
    sends: list[SendPlan] = field(default_factory=list)
    fetches: list[FetchPlan] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    writes: list[WritePlan] = field(default_factory=list)
    idle_wait_s: float = 0.0  # no token this step, fetches under way: wait for one (kv_loads.IDLE_WAIT_S)

    def __bool__(self) -> bool:
        return bool(self.sends or self.fetches or self.cancels or self.writes or self.idle_wait_s)


class PDWorker(KVConnectorWorker):
    """Threads: the rank's step thread calls everything but `_run` / `_fetch`, which run on one
    thread per fetch under way. What fetches bring goes through `_loads`; the per-peer queues
    and the counters go under `_lock`."""

    def __init__(self, cfg: KVTransferConfig, blocks: Any) -> None:
        self.cfg = cfg
        self.blocks = blocks  # worker/kv_blocks.py WholeBlocks
        self.leader = blocks.is_leader
        self.handshake: dict[str, Any] | None = None
        self.auth: TransferAuth | None = None
        self.sender: KVSender | None = None
        self._loads = BackgroundLoads()
        self._lock = threading.Lock()
        self._queued: dict[tuple[str, int], deque[tuple[FetchPlan, float]]] = {}  # peer -> (fetch, deadline)
        self._running: dict[tuple[str, int], int] = {}
        self._closed = False
        self._sent: list[str] = []
        self.counts: dict[str, int] = {"kv_transfer_sent": 0, "kv_transfer_received": 0,
                                       "kv_transfer_failed": 0, "kv_transfer_tokens_received": 0}

    def configure(self, handshake: dict[str, Any]) -> dict[str, Any] | None:
        """The engine's handshake (model, block shape, dtype, fingerprint). On the output rank:
        where its sender listens ({} without one); None on the other ranks."""
        self.handshake = handshake
        if not self.leader:
            return None
        key = self.cfg.auth_key()
        assert key is not None, "the scheduler role refuses to start without the deployment's key"
        self.auth = TransferAuth(key)
        if self.cfg.produces:
            self.sender = KVSender(self.cfg.host, self.cfg.port, handshake, self.cfg.lease_s, self.auth)
            return {"host": self.sender.host, "port": self.sender.port}
        return {}

    # ---- the step ---------------------------------------------------------------------

    def before_forward(self, meta: PDStepMeta | None, runner: Any) -> None:
        if not meta:
            return
        for s in meta.sends:  # held blocks: nothing has reused them
            data = self.blocks.gather(s.block_ids)
            if self.leader:
                self.sender.expect(s.hashes, s.transfer_id)
                self.sender.put(s.transfer_id, data)
                self._sent.append(s.request_id)
                self._count("kv_transfer_sent")
        if self.leader:
            for rid in meta.cancels:
                self._loads.cancel(rid)  # a fetch under way drops what it brings
            for f in meta.fetches:
                self._start(f)
        for w in meta.writes:
            data = None
            if self.leader:
                loaded = self._loads.take(w.request_id)
                data = loaded[torch.tensor(w.indices)]
            self.blocks.scatter(w.block_ids, data)

    def after_forward(self, meta: PDStepMeta | None, runner: Any) -> None:
        if meta and meta.idle_wait_s and self.leader:  # nothing else to do: report a fetch the moment it ends
            self._loads.wait(meta.idle_wait_s)

    def take_output(self) -> dict[str, Any] | None:
        if not self.leader:
            return None
        sent, self._sent = self._sent, []
        done = {}
        for rid in self._loads.finished():
            loaded = self._loads.peek(rid)
            done[rid] = (0 if loaded is None else len(loaded), self._loads.error(rid))
        return {"sent": sent, "done": done}

    def stats(self) -> dict[str, int]:
        if not self.leader:
            return {}
        with self._lock:
            out = dict(self.counts)
        if self.sender is not None:
            out.update(kv_transfer_pending=self.sender.num_pending, kv_transfer_bytes_sent=self.sender.bytes_sent,
                       kv_transfer_expired=self.sender.transfers_expired)
        return out

    # ---- fetches ------------------------------------------------------------------------

    def _start(self, f: FetchPlan) -> None:
        peer = (f.host, f.port)
        self._loads.begin(f.request_id)
        with self._lock:
            self._queued.setdefault(peer, deque()).append((f, time.monotonic() + self.cfg.fetch_timeout_s))
            self._pump(peer)

    def _pump(self, peer: tuple[str, int]) -> None:
        """Start the peer's queued fetches while it has a free slot (under `_lock`)."""
        queue = self._queued.get(peer)
        while queue and self._running.get(peer, 0) < PER_PEER_FETCHES and not self._closed:
            self._running[peer] = self._running.get(peer, 0) + 1
            threading.Thread(target=self._run, args=(peer, *queue.popleft()), name="kvserve-kv-fetch",
                             daemon=True).start()
        if not queue:
            self._queued.pop(peer, None)

    def _run(self, peer: tuple[str, int], f: FetchPlan, deadline: float) -> None:
        try:
            self._loads.run(f.request_id, lambda: self._fetch(f, deadline))
        finally:
            with self._lock:
                self._running[peer] -= 1
                if not self._running[peer]:
                    del self._running[peer]
                self._pump(peer)

    def _fetch(self, f: FetchPlan, deadline: float) -> torch.Tensor | None:
        """On a fetch thread: the request's verified blocks; None (prefill here) or an exception
        (policy fail: the request fails) when they cannot be had."""
        if self._loads.cancelled(f.request_id):
            return None  # gone while queued
        try:
            left = deadline - time.monotonic()
            if left <= 0:
                raise KVTransferError(f"no fetch from {f.host}:{f.port} could start within "
                                      f"{self.cfg.fetch_timeout_s:g} s: its earlier transfers hang")
            hashes, data = fetch(f.host, f.port, f.transfer_id, self.handshake, self.auth, left, f.num_blocks,
                                 self.cfg.transport)
            # The sender's hashes are a claim: only the ones computed from the prompt count.
            if hashes != f.hashes[:len(hashes)]:
                bad = next(i for i, h in enumerate(hashes) if i >= len(f.hashes) or h != f.hashes[i])
                raise KVTransferError(f"fetched block {bad} of {len(hashes)} is not this prompt's (its hash is not "
                                      f"the one computed here from the prompt's tokens)")
        except Exception as e:  # noqa: BLE001 - any failure means: no remote K/V for this request
            self._count("kv_transfer_failed")
            reason = str(e) if isinstance(e, KVTransferError) else f"{type(e).__name__}: {e}"
            if self.cfg.policy == "fail":
                raise KVTransferError(f"remote KV load failed: {reason}") from e
            if not self._loads.cancelled(f.request_id):
                logger.warning("request %s: remote KV load failed (%s); prefilling here", f.request_id, reason)
            return None
        self._count("kv_transfer_received")
        self._count("kv_transfer_tokens_received", len(hashes) * data.shape[3])
        return data

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
            self.sender = None
        with self._lock:
            self._closed = True  # fetches under way end by their deadline; queued ones never start
            self._queued.clear()
