"""PDConnector: the scheduler role of prefill/decode disaggregation's KV connector (its worker
role, PDWorker in worker.py, runs inside the ranks and moves the bytes).

A request carries `kv_transfer_params` (SamplingParams.extra_args, the request field of the
same name), in vLLM's shape:

- `{"do_remote_decode": true}` on a prefill engine: compute the prompt (the router asks for
  one token), then keep its full blocks for a decode engine. When the request finishes its
  blocks stay held until the next step's worker role has copied them out to the KVSender;
  the output's `kv_transfer_params` tell the decode engine where to fetch them:
  `{"do_remote_prefill": true, "remote_host", "remote_port", "remote_request_id",
  "remote_num_blocks", "remote_engine_id", "remote_auth"}`, signed with the deployment's key
  (auth.py; an engine with a role does not start without one).
- those params on a decode engine (checked on arrival, params.py): the request waits
  (WAITING_FOR_REMOTE_KV) while the worker role fetches the blocks on a thread of its own. They are used only if
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
import time
import uuid
from collections.abc import Mapping
from typing import Any

from kvserve.config import KVTransferConfig
from kvserve.core.kv_connector import EvictedBlock, KVConnector, TierHit
from kvserve.core.kv_loads import IDLE_WAIT_S
from kvserve.core.prefix_cache import compute_block_hashes, max_cached_blocks
from kvserve.core.sched_output import SchedulerOutput
from kvserve.disagg.auth import sign_params
from kvserve.disagg.params import check_transfer_params, transfer_params
from kvserve.disagg.worker import FetchPlan, PDStepMeta, SendPlan, WritePlan
from kvserve.request import Request, RequestStatus

logger = logging.getLogger(__name__)

TRANSFER_TIER = "kv_transfer"  # the origin of transferred tokens in cached_tokens_by_tier


class PDConnector(KVConnector):
    """The engine thread calls everything. What the worker role did comes back through
    `update_connector_output`, once per step."""

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
        self.sender_address: tuple[str, int] | None = None  # set_worker_info, on a prefill engine
        self._step = PDStepMeta()
        # prefill side
        self._sent: list[str] = []  # copied out by the worker role: their device blocks may be freed
        self._out_params: dict[str, dict[str, Any]] = {}  # request id -> its output's kv_transfer_params
        # decode side
        self._fetching: dict[str, list[bytes]] = {}  # request -> its prompt's hashes, while the worker fetches
        self._worker_waits = False  # the last step's plan has the worker role wait for a fetch
        self._loaded: dict[str, list[bytes]] = {}  # fetched: the hashes of the blocks the worker holds
        self._finished: list[str] = []
        self._errors: dict[str, str] = {}  # fetch failures that fail their request (policy fail)

    def set_worker_info(self, info: dict[str, Any] | None) -> None:
        """What the output rank's worker role said when configured: where its sender listens."""
        if info and "port" in info:
            self.sender_address = (info["host"], info["port"])

    def validate_request(self, params: Any, num_prompt_tokens: int) -> None:
        check_transfer_params(transfer_params(params), self.cfg, params.n)

    # ---- prefill side ---------------------------------------------------------------

    def request_finished(self, request: Request) -> bool:
        p = transfer_params(request.sampling_params)
        if (self.sender_address is None or not p or not p.get("do_remote_decode")
                or request.status == RequestStatus.FINISHED_ABORTED):
            return False
        # The blocks a decode engine can use: full ones before the prompt's last token.
        n = min(max(0, (request.num_prompt_tokens - 1) // self.block_size), len(request.block_ids),
                request.num_computed_tokens // self.block_size)
        tid = uuid.uuid4().hex if n else ""
        host, port = self.sender_address
        self._out_params[request.request_id] = sign_params(self._key, {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.cfg.engine_id,
            "remote_host": host, "remote_port": port, "remote_request_id": tid, "remote_num_blocks": n})
        if not n:
            return False  # a prompt shorter than a block: nothing worth sending
        hashes = compute_block_hashes(request, n, self.block_size)[:n]
        self._step.sends.append(SendPlan(request.request_id, tid, list(request.block_ids[:n]), hashes))
        return True

    def take_output_params(self, request_id: str) -> dict[str, Any] | None:
        return self._out_params.pop(request_id, None)

    def finished_sending(self) -> list[str]:
        out, self._sent = self._sent, []
        return out

    # ---- decode side: the fetch -----------------------------------------------------

    def start_load(self, request: Request, num_device_blocks: int) -> bool:
        p = transfer_params(request.sampling_params)
        if not self.cfg.consumes or not p or not p.get("do_remote_prefill") or request.leader_id is not None:
            return False  # n > 1: the other samples fork from the leader's blocks
        usable = min(p["remote_num_blocks"], max_cached_blocks(request, self.block_size))
        if usable <= num_device_blocks:
            return False  # already cached here (the prefill engine's copy expires with its lease)
        hashes = compute_block_hashes(request, max_cached_blocks(request, self.block_size), self.block_size)
        rid = request.request_id
        self._fetching[rid] = list(hashes)
        self._step.fetches.append(FetchPlan(rid, p["remote_host"], p["remote_port"], p["remote_request_id"],
                                            p["remote_num_blocks"], list(hashes)))
        return True

    def update_connector_output(self, output: dict[str, Any] | None) -> None:
        if not output:
            return
        self._sent += output["sent"]
        for rid, (n, error) in output["done"].items():
            hashes = self._fetching.pop(rid, None)
            if hashes is None:
                continue  # forgotten meanwhile
            if n:
                self._loaded[rid] = hashes[:n]
            if error is not None:
                self._errors[rid] = error
            self._finished.append(rid)

    def needs_step(self, meta: PDStepMeta | None) -> bool:
        """The ranks must run the plan, or report on the fetches under way."""
        return bool(meta) or bool(self._fetching)

    def finished_loading(self) -> list[str]:
        out, self._finished = self._finished, []
        return out

    def load_error(self, request_id: str) -> str | None:
        return self._errors.pop(request_id, None)

    # ---- decode side: the step path -------------------------------------------------------

    def on_evict(self, block: EvictedBlock) -> None:
        pass  # evicted blocks are simply gone; tiers are another connector

    def lookup(self, request: Request, start_block: int, max_blocks: int) -> list[TierHit]:
        hashes = self._loaded.get(request.request_id)
        if hashes is None:
            return []
        end = min(len(hashes), max_blocks)
        return [TierHit(hashes[i], TRANSFER_TIER) for i in range(start_block, end)]

    def count_lookup(self, request: Request) -> None:
        pass

    def on_allocated(self, request: Request, block_ids: list[int], hits: list[TierHit]) -> None:
        hashes = self._loaded.pop(request.request_id)
        index = {h: i for i, h in enumerate(hashes)}
        self._step.writes.append(WritePlan(request.request_id, list(block_ids), [index[h.block_hash] for h in hits]))

    def build_meta(self, out: SchedulerOutput, requests: Mapping[str, Request]) -> PDStepMeta:
        if self._fetching and not out.num_scheduled_tokens:
            self._step.idle_wait_s = IDLE_WAIT_S
        meta, self._step = self._step, PDStepMeta()
        self._worker_waits = meta.idle_wait_s > 0
        return meta

    def wait(self, timeout: float) -> None:
        """When this step's worker role waits for the fetch (PDStepMeta.idle_wait_s) the engine goes
        straight on; otherwise it sleeps rather than spin."""
        if not self._worker_waits:
            time.sleep(timeout)

    def forget(self, request_id: str) -> None:
        if self._fetching.pop(request_id, None) is not None or self._loaded.pop(request_id, None) is not None:
            self._step.cancels.append(request_id)  # the worker drops what its fetch brings
        self._errors.pop(request_id, None)
