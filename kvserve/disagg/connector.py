"""PDConnector: the KV connector of prefill/decode disaggregation (both halves).

A request carries `kv_transfer_params` (SamplingParams.extra_args, the request field of the
same name), in vLLM's shape:

- `{"do_remote_decode": true}` on a prefill engine: compute the prompt (the router asks for
  one token), then keep its full blocks for a decode engine. When the request finishes its
  blocks stay held until the next step's worker half has copied them out to the KVSender;
  the output's `kv_transfer_params` tell the decode engine where to fetch them:
  `{"do_remote_prefill": true, "remote_host", "remote_port", "remote_request_id",
  "remote_num_blocks", "remote_engine_id", "remote_auth"}`, signed with the deployment's key
  (auth.py; an engine with a role does not start without one).
- those params on a decode engine (checked on arrival, params.py): the request waits
  (WAITING_FOR_REMOTE_KV) while a background thread fetches the blocks. They are used only if
  every one checks out: this engine's block shape, dtype and size, the sender's signed digest
  (transport.py), and the chain hashes the sender claims equal to the ones computed here from
  the prompt's own tokens (a different prompt, salt or model never matches). Then `lookup`
  offers them, they are written into the request's new blocks before its first forward, which
  computes only the rest of the prompt (less than one block, at least its last token), and
  they become cached blocks here like any other. If the fetch fails in any way, the request
  prefills here (`kv_load_failure_policy` recompute) or fails with the reason (fail).

Each prefill engine (peer) gets at most PER_PEER_FETCHES fetches at once, each on a thread of
its own, the rest queued; a fetch's deadline (fetch_timeout_s) runs from its request's arrival,
queueing included. A peer that hangs delays its own requests only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kvserve.config import KVTransferConfig
from kvserve.core.kv_connector import EvictedBlock, KVConnector, KVConnectorWorker, TierHit
from kvserve.core.kv_loads import BackgroundLoads
from kvserve.core.prefix_cache import compute_block_hashes, max_cached_blocks
from kvserve.core.sched_output import SchedulerOutput
from kvserve.disagg.auth import TransferAuth, sign_params
from kvserve.disagg.params import check_transfer_params, transfer_params
from kvserve.disagg.transport import KVSender, KVTransferError, fetch
from kvserve.request import Request, RequestStatus

logger = logging.getLogger(__name__)

TRANSFER_TIER = "kv_transfer"  # the origin of transferred tokens in cached_tokens_by_tier
PER_PEER_FETCHES = 2  # a prefill engine's fetches at once; a silent one holds no more threads than this


@dataclass
class _Send:
    request_id: str
    transfer_id: str
    block_ids: list[int]


@dataclass
class PDStepMeta:
    """One step's copies: finished prompts' blocks out to the sender, fetched blocks in."""

    sends: list[_Send] = field(default_factory=list)
    writes: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (device block, its K/V)


@dataclass
class _Fetch:
    request: Request
    params: dict[str, Any]
    deadline: float  # time.monotonic()


@dataclass
class _Loaded:
    data: torch.Tensor  # [n, *block_shape]: the prompt's first n blocks
    hashes: list[bytes]


class PDConnector(KVConnector, KVConnectorWorker):
    """Threads: the engine thread calls everything but `_run`/`_fetch`, which run on one thread
    per fetch under way. What fetches bring goes through `_loads` (core/kv_loads.py); the per-peer
    queues and the counters they share go under `_lock`."""

    name = "kv_transfer"

    def __init__(self, cfg: KVTransferConfig, handshake: dict[str, Any], block_size: int) -> None:
        self.cfg = cfg
        self.handshake = handshake
        self.block_size = block_size
        key = cfg.auth_key()
        if key is None:
            raise ValueError(f"kv_role {cfg.kv_role} needs the deployment's shared key, the same on every prefill "
                             f"and decode engine: kv_transfer_config.kv_connector_extra_config.auth_key_file (or "
                             f"auth_key); `kvserve router --launch-pd` makes one")
        self._key = key
        self.auth = TransferAuth(key)
        self.sender = KVSender(cfg.host, cfg.port, handshake, cfg.lease_s, self.auth) if cfg.produces else None
        self._lock = threading.Lock()
        # prefill side
        self._to_send: list[_Send] = []  # finished requests whose blocks the next step copies out
        self._sent: list[str] = []  # ... copied: their device blocks may be freed
        self._out_params: dict[str, dict[str, Any]] = {}  # request id -> its output's kv_transfer_params
        # decode side: fetches (what they brought: _Loaded; failures fail their request under policy fail)
        self._loads = BackgroundLoads()
        self._queued: dict[tuple[str, int], deque[_Fetch]] = {}  # peer -> fetches waiting for a slot
        self._running: dict[tuple[str, int], int] = {}  # peer -> its fetches under way
        self._closed = False
        self._writes: list[tuple[int, torch.Tensor]] = []
        self.stats_counts: dict[str, int] = {"kv_transfer_sent": 0, "kv_transfer_received": 0,
                                             "kv_transfer_failed": 0, "kv_transfer_tokens_received": 0}

    def validate_request(self, params: Any, num_prompt_tokens: int) -> None:
        check_transfer_params(transfer_params(params), self.cfg, params.n)

    # ---- prefill side ---------------------------------------------------------------

    def request_finished(self, request: Request) -> bool:
        p = transfer_params(request.sampling_params)
        if (self.sender is None or not p or not p.get("do_remote_decode")
                or request.status == RequestStatus.FINISHED_ABORTED):
            return False
        # The blocks a decode engine can use: full ones before the prompt's last token.
        n = min(max(0, (request.num_prompt_tokens - 1) // self.block_size), len(request.block_ids),
                request.num_computed_tokens // self.block_size)
        tid = self.sender.expect(compute_block_hashes(request, n, self.block_size)[:n]) if n else ""
        self._out_params[request.request_id] = sign_params(self._key, {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.cfg.engine_id,
            "remote_host": self.sender.host, "remote_port": self.sender.port, "remote_request_id": tid,
            "remote_num_blocks": n})
        if not n:
            return False  # a prompt shorter than a block: nothing worth sending
        self._to_send.append(_Send(request.request_id, tid, list(request.block_ids[:n])))
        return True

    def take_output_params(self, request_id: str) -> dict[str, Any] | None:
        return self._out_params.pop(request_id, None)

    def finished_sending(self) -> list[str]:
        out, self._sent = self._sent, []
        return out

    # ---- decode side: the background fetch -----------------------------------------

    def start_load(self, request: Request, num_device_blocks: int) -> bool:
        p = transfer_params(request.sampling_params)
        if not self.cfg.consumes or not p or not p.get("do_remote_prefill") or request.leader_id is not None:
            return False  # n > 1: the other samples fork from the leader's blocks
        usable = min(p["remote_num_blocks"], max_cached_blocks(request, self.block_size))
        if usable <= num_device_blocks:
            return False  # already cached here (the prefill engine's copy expires with its lease)
        peer = (p["remote_host"], p["remote_port"])
        self._loads.begin(request.request_id)
        with self._lock:
            self._queued.setdefault(peer, deque()).append(
                _Fetch(request, p, time.monotonic() + self.cfg.fetch_timeout_s))
            self._pump(peer)
        return True

    def _pump(self, peer: tuple[str, int]) -> None:
        """Start the peer's queued fetches while it has a free slot (under `_lock`)."""
        queue = self._queued.get(peer)
        while queue and self._running.get(peer, 0) < PER_PEER_FETCHES and not self._closed:
            self._running[peer] = self._running.get(peer, 0) + 1
            threading.Thread(target=self._run, args=(peer, queue.popleft()), name="kvserve-kv-fetch",
                             daemon=True).start()
        if not queue:
            self._queued.pop(peer, None)

    def _run(self, peer: tuple[str, int], job: _Fetch) -> None:
        try:
            self._loads.run(job.request.request_id, lambda: self._fetch(job))
        finally:
            with self._lock:
                self._running[peer] -= 1
                if not self._running[peer]:
                    del self._running[peer]
                self._pump(peer)

    def _fetch(self, job: _Fetch) -> _Loaded | None:
        """On a fetch thread: the request's verified blocks; None (prefill here) or an exception
        (policy fail: the request fails) when they cannot be had."""
        request, p, rid = job.request, job.params, job.request.request_id
        if self._loads.cancelled(rid):
            return None  # gone while queued
        try:
            left = job.deadline - time.monotonic()
            if left <= 0:
                raise KVTransferError(f"no fetch from {p['remote_host']}:{p['remote_port']} could start within "
                                      f"{self.cfg.fetch_timeout_s:g} s: its earlier transfers hang")
            hashes, data = fetch(p["remote_host"], p["remote_port"], p["remote_request_id"], self.handshake, self.auth,
                                 left, p["remote_num_blocks"], self.cfg.transport)
            # The sender's hashes are a claim: only the ones computed here from the prompt count.
            mine = compute_block_hashes(request, max_cached_blocks(request, self.block_size), self.block_size)
            if hashes != mine[:len(hashes)]:
                bad = next(i for i, h in enumerate(hashes) if i >= len(mine) or h != mine[i])
                raise KVTransferError(f"fetched block {bad} of {len(hashes)} is not this prompt's (its hash is not "
                                      f"the one computed here from the prompt's tokens)")
        except Exception as e:  # noqa: BLE001 - any failure means: no remote K/V for this request
            self._count("kv_transfer_failed")
            reason = str(e) if isinstance(e, KVTransferError) else f"{type(e).__name__}: {e}"
            if self.cfg.policy == "fail":
                raise KVTransferError(f"remote KV load failed: {reason}") from e
            if not self._loads.cancelled(rid):
                logger.warning("request %s: remote KV load failed (%s); prefilling here", rid, reason)
            return None
        self._count("kv_transfer_received")
        self._count("kv_transfer_tokens_received", len(hashes) * self.block_size)
        return _Loaded(data, mine[:len(hashes)])

    def finished_loading(self) -> list[str]:
        return self._loads.finished()

    def load_error(self, request_id: str) -> str | None:
        return self._loads.error(request_id)

    def wait(self, timeout: float) -> None:
        self._loads.wait(timeout)

    # ---- decode side: the step path -------------------------------------------------------

    def on_evict(self, block: EvictedBlock) -> None:
        pass  # evicted blocks are simply gone; tiers are another connector

    def lookup(self, request: Request, start_block: int, max_blocks: int) -> list[TierHit]:
        loaded = self._loads.peek(request.request_id)
        if loaded is None:
            return []
        end = min(len(loaded.hashes), max_blocks)
        return [TierHit(loaded.hashes[i], TRANSFER_TIER) for i in range(start_block, end)]

    def count_lookup(self, request: Request) -> None:
        pass

    def on_allocated(self, request: Request, block_ids: list[int], hits: list[TierHit]) -> None:
        loaded = self._loads.take(request.request_id)
        index = {h: i for i, h in enumerate(loaded.hashes)}
        self._writes.extend((b, loaded.data[index[h.block_hash]]) for b, h in zip(block_ids, hits))

    def build_meta(self, out: SchedulerOutput, requests: Mapping[str, Request]) -> PDStepMeta:
        meta = PDStepMeta(self._to_send, self._writes)
        self._to_send, self._writes = [], []
        return meta

    def forget(self, request_id: str) -> None:
        self._loads.cancel(request_id)  # a fetch under way drops what it brings

    # ---- the worker half ---------------------------------------------------------------

    def before_forward(self, meta: PDStepMeta, runner: Any) -> None:
        for s in meta.sends:  # held blocks: nothing has reused them
            self.sender.put(s.transfer_id, runner.read_kv_blocks(s.block_ids))
            self._sent.append(s.request_id)
            self._count("kv_transfer_sent")
        if meta.writes:
            runner.write_kv_blocks([b for b, _ in meta.writes], torch.stack([d for _, d in meta.writes]))

    def after_forward(self, meta: PDStepMeta, runner: Any) -> None:
        pass

    # ---- the engine ----------------------------------------------------------------------

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.stats_counts[name] += n

    def stats(self) -> dict[str, int]:
        with self._lock:
            out = dict(self.stats_counts)
        if self.sender is not None:
            out.update(kv_transfer_pending=self.sender.num_pending, kv_transfer_bytes_sent=self.sender.bytes_sent,
                       kv_transfer_expired=self.sender.transfers_expired)
        return out

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()
        with self._lock:
            self._closed = True  # fetches under way end by their deadline; queued ones never start
            self._queued.clear()
