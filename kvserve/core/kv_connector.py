"""The KV connector interface, in two halves (DESIGN.md, "KV connector, two halves").

A connector brings K/V into the device pool from elsewhere and takes K/V out of it: the KV
tiers below the pool (kv_tiers/), another engine (prefill/decode), chunks reused out of order.
The scheduler and the KV manager stay pure bookkeeping and know only this interface:

- the **scheduler half** (`KVConnector`) decides. It hears of every block the prefix cache
  evicts (its K/V are intact until the next model step), says which further prompt blocks it
  can supply this step, and whether a new request must wait for its KV first (status
  `WAITING_FOR_REMOTE_KV` until `finished_loading` names it). Each step it puts its plan in the
  SchedulerOutput (`build_meta`), opaque to everyone else. A finished request's blocks stay
  held while the connector still needs them (`request_finished` -> True), until
  `finished_sending` names it.
- the **worker role** (`KVConnectorWorker`) moves the bytes, carrying out the plan around the
  step's forward inside each rank (`kvserve/worker/kv_connectors.py` names them):
  `before_forward` (offloads are read out before anything is written, then loaded blocks are
  written in) and `after_forward` (K/V the forward computed), with that rank's runner. What it
  reports (`take_output`) comes back in `ModelRunnerOutput.kv_connector_output[name]` to the
  scheduler half's `update_connector_output`. Whole blocks meet at the output rank
  (worker/kv_blocks.py); the engine process never holds K/V.

A feature's per-request state lives in its connector, keyed by request id, not on `Request`; what
a request asks of a connector travels in `SamplingParams.extra_args[<its request key>]`, checked
by `validate_request` before the request is queued.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvserve.core.sched_output import SchedulerOutput
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
    origin: str  # where it came from, for the cached-token split ("cpu", "disk", "remote", ...)


class KVConnector(ABC):
    """The scheduler half: pure bookkeeping, no torch. `name` keys its step metadata and its
    worker role's output."""

    name: str = "kv"

    # ---- requests that arrive ---------------------------------------------------------

    def validate_request(self, params: Any, num_prompt_tokens: int) -> None:
        """Raise ValueError naming the field when this connector cannot serve the request (called
        before it is queued, for every enabled connector)."""

    def block_salt(self, request: Request) -> tuple[int, str] | None:
        """(first block, salt): the request's blocks from that index on hold K/V this connector
        writes approximately, so the prefix cache keys them apart (`Request.extra_salt`). None:
        every block is exact."""
        return None

    # ---- blocks in and out of the device pool ----------------------------------

    @abstractmethod
    def on_evict(self, block: EvictedBlock) -> None:
        """The prefix cache dropped this block; it may be copied out with the next step."""

    @abstractmethod
    def lookup(self, request: Request, start_block: int, max_blocks: int) -> list[TierHit]:
        """Consecutive full blocks start_block, start_block + 1, ... (below max_blocks) of the
        request's prompt that can be loaded in this step. Takes nothing out of anywhere."""

    @abstractmethod
    def count_lookup(self, request: Request) -> None:
        """The request was scheduled with its last lookup's hits: count that lookup in the hit
        rates (a request that waits for room looks up again every step; it counts once)."""

    @abstractmethod
    def on_allocated(self, request: Request, block_ids: list[int], hits: list[TierHit]) -> None:
        """The request was scheduled: block_ids[i] takes hits[i]'s K/V in this step."""

    def extra_tokens(self, request: Request) -> int:
        """Tokens the worker computes for the request in this step besides its scheduled ones
        (asked right after `on_allocated`): charged to the step's token budget."""
        return 0

    @abstractmethod
    def build_meta(self, out: SchedulerOutput, requests: Mapping[str, Request]) -> Any:
        """This step's plan for the worker half. `out` names the scheduled requests, `requests`
        holds them by id (their num_computed_tokens already count this step's tokens). Called
        once per step."""

    # ---- requests that wait for their KV ------------------------------------------

    @abstractmethod
    def start_load(self, request: Request, num_device_blocks: int) -> bool:
        """A new request whose first num_device_blocks blocks are on the device: start bringing
        its next blocks from wherever they are, in the background. True: it waits
        (WAITING_FOR_REMOTE_KV) until `finished_loading` names it."""

    @abstractmethod
    def finished_loading(self) -> list[str]:
        """Request ids whose load has finished (successfully or not) since the last call."""

    def load_error(self, request_id: str) -> str | None:
        """Asked once for each request `finished_loading` names: why it must fail rather than run
        without the K/V it waited for, or None (it runs, with whatever `lookup` now finds)."""
        return None

    def wait(self, timeout: float) -> None:
        """Nothing but loads to wait for: block until one may have finished, or `timeout`."""
        time.sleep(timeout)

    # ---- requests that end ------------------------------------------------------------

    def request_finished(self, request: Request) -> bool:
        """The request finished. True: the connector still reads its blocks (sending them
        somewhere); they stay held until `finished_sending` names it."""
        return False

    def finished_sending(self) -> list[str]:
        """Request ids whose held blocks may now be freed."""
        return []

    def take_output_params(self, request_id: str) -> dict[str, Any] | None:
        """What the finished request's output tells its caller about its K/V (`kv_transfer_params`:
        where a decode engine fetches it), once."""
        return None

    def needs_step(self, meta: Any) -> bool:
        """Whether the step must reach the ranks although no token is scheduled: this step's plan
        (`meta`, from build_meta) has work for the worker role, or the connector waits for news
        from it (`update_connector_output`)."""
        return False

    def update_connector_output(self, output: Any) -> None:
        """What this connector's worker role reported for a finished step (`take_output` on the
        output rank); called before the step's tokens are processed."""

    def stats(self) -> dict[str, Any]:
        """Counters for the engine's stats (and /metrics)."""
        return {}

    def close(self) -> None:
        """Stop background work; the engine is going away."""

    @abstractmethod
    def forget(self, request_id: str) -> None:
        """The request is gone for good: drop everything kept for it."""


class KVConnectorWorker(ABC):
    """The worker role: carries out the scheduler half's plan around the forward, inside a rank;
    `runner` is that rank's ModelRunner. Called with `meta` None on steps the scheduler half
    planned nothing for."""

    @abstractmethod
    def before_forward(self, meta: Any, runner: Any) -> None:
        """Before the step's forward writes anything."""

    @abstractmethod
    def after_forward(self, meta: Any, runner: Any) -> None:
        """After the step's forward: its K/V are in the blocks."""

    def take_output(self) -> Any:
        """What the scheduler half's `update_connector_output` hears of this step (None: nothing)."""
        return None

    def configure(self, info: Any) -> Any:
        """What the engine knows only once every rank is up (the model's fingerprint, the whole
        block's shape); returns what the scheduler role needs from this rank (None: nothing)."""
        return None

    def stats(self) -> dict[str, Any]:
        """Counters of this rank's role (the engine reads the output rank's)."""
        return {}

    def close(self) -> None:
        """Stop background work; the rank is going away."""


class MultiConnector(KVConnector):
    """Several connectors as one (vLLM's MultiConnector), e.g. the KV tiers and prefill/decode
    transfer on one engine. Each hears every eviction and every request. A lookup asks them in
    order, each from where the previous one's hits end, and the allocated blocks go back to
    the connector whose hits they take. A request waits while any of them loads for it and
    stays held while any of them sends it. The step's plan is a dict, each connector's under its
    `name` (the worker roles run in order in each rank, the tiers first, so they read evicted
    blocks out before anything is written into the step's new blocks). The engine always wraps
    its connectors in one of these, even a single one."""

    def __init__(self, connectors: list[Any]) -> None:
        names = [c.name for c in connectors]
        if len(set(names)) != len(names):
            raise ValueError(f"connector names must differ, got {names}")
        self.connectors = connectors
        self._hits: dict[str, list[tuple[Any, list[TierHit]]]] = {}  # request -> its last lookup, by connector
        self._loading: dict[str, set[int]] = {}  # request -> the connectors still loading for it
        self._sending: dict[str, set[int]] = {}  # finished request -> the connectors still sending it
        self._failed: dict[str, str] = {}

    def validate_request(self, params: Any, num_prompt_tokens: int) -> None:
        for c in self.connectors:
            c.validate_request(params, num_prompt_tokens)

    def block_salt(self, request: Request) -> tuple[int, str] | None:
        salts = [s for c in self.connectors if (s := c.block_salt(request)) is not None]
        return min(salts) if salts else None

    def on_evict(self, block: EvictedBlock) -> None:
        for c in self.connectors:
            c.on_evict(block)

    def lookup(self, request: Request, start_block: int, max_blocks: int) -> list[TierHit]:
        found: list[tuple[Any, list[TierHit]]] = []
        block = start_block
        for c in self.connectors:
            hits = c.lookup(request, block, max_blocks)
            found.append((c, hits))
            block += len(hits)
        self._hits[request.request_id] = found
        return [h for _, hits in found for h in hits]

    def count_lookup(self, request: Request) -> None:
        for c in self.connectors:
            c.count_lookup(request)

    def on_allocated(self, request: Request, block_ids: list[int], hits: list[TierHit]) -> None:
        start = 0
        for c, mine in self._hits.pop(request.request_id, []):
            if mine:
                c.on_allocated(request, block_ids[start:start + len(mine)], mine)
                start += len(mine)

    def extra_tokens(self, request: Request) -> int:
        return sum(c.extra_tokens(request) for c in self.connectors)

    def build_meta(self, out: SchedulerOutput, requests: Mapping[str, Request]) -> dict[str, Any]:
        return {c.name: c.build_meta(out, requests) for c in self.connectors}

    def needs_step(self, meta: Mapping[str, Any]) -> bool:
        return any(c.needs_step(meta.get(c.name)) for c in self.connectors)

    def update_connector_output(self, output: Mapping[str, Any]) -> None:
        for c in self.connectors:
            if c.name in output:
                c.update_connector_output(output[c.name])

    def start_load(self, request: Request, num_device_blocks: int) -> bool:
        waiting = {i for i, c in enumerate(self.connectors) if c.start_load(request, num_device_blocks)}
        if waiting:
            self._loading[request.request_id] = waiting
        return bool(waiting)

    def finished_loading(self) -> list[str]:
        done = []
        for i, c in enumerate(self.connectors):
            rids = c.finished_loading()
            for rid in rids:
                why = c.load_error(rid)
                if why is not None:
                    self._failed.setdefault(rid, why)
            done += _all_done(self._loading, i, rids)
        return done

    def load_error(self, request_id: str) -> str | None:
        return self._failed.pop(request_id, None)

    def wait(self, timeout: float) -> None:
        loading = set().union(*self._loading.values())
        if loading:  # one connector's load at a time is waited on: any one finishing ends the wait soon
            self.connectors[min(loading)].wait(timeout)
        else:
            time.sleep(timeout)

    def request_finished(self, request: Request) -> bool:
        holding = {i for i, c in enumerate(self.connectors) if c.request_finished(request)}
        if holding:
            self._sending[request.request_id] = holding
        return bool(holding)

    def finished_sending(self) -> list[str]:
        return [rid for i, c in enumerate(self.connectors) for rid in _all_done(self._sending, i, c.finished_sending())]

    def take_output_params(self, request_id: str) -> dict[str, Any] | None:
        params = [p for c in self.connectors if (p := c.take_output_params(request_id)) is not None]
        return params[0] if params else None

    def forget(self, request_id: str) -> None:
        self._hits.pop(request_id, None)
        self._loading.pop(request_id, None)
        self._sending.pop(request_id, None)
        self._failed.pop(request_id, None)
        for c in self.connectors:
            c.forget(request_id)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for c in self.connectors:
            out.update(c.stats())
        return out

    def close(self) -> None:
        for c in self.connectors:
            c.close()


def _all_done(pending: dict[str, set[int]], i: int, rids: list[str]) -> list[str]:
    """Connector i is done with `rids`: those no other connector still works on (dropped from
    `pending`, request -> the connectors still at it)."""
    done = []
    for rid in rids:
        left = pending.get(rid)
        if left is not None:
            left.discard(i)
            if not left:
                del pending[rid]
                done.append(rid)
    return done
