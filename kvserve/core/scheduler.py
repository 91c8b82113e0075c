"""The one scheduling rule: hand out a token budget so every request catches up.

Each step, running requests are served first (a decode needs one token, an
unfinished prompt gets a chunk), then waiting requests are admitted in
(priority, arrival) order while the budget, `max_num_seqs` and the KV pool
allow. When blocks run out, the lowest-priority, newest running request is
preempted by recompute: its blocks are freed and it waits again, reusing
whatever of its prefix is still cached when it resumes.

One refinement keeps a short prompt from waiting behind a long one: while
waiting prompts of the first waiting priority could finish within
`short_prompt_share` of what decodes leave of the budget (counting what the
device cache and the KV tiers already hold), running prompt chunks leave them
that many tokens, and they are admitted first. So a long prompt still gets
at least the rest of the budget each step.
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections.abc import Callable

from kvserve.config import SchedulerConfig
from kvserve.core.kv_connector import DEVICE_TIER, KVConnector, TierHit
from kvserve.core.kv_manager import KVCacheManager
from kvserve.core.prefix_cache import max_cached_blocks
from kvserve.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from kvserve.request import Request, RequestStatus


# Waiting requests _short_prompts looks at each step: each costs a prefix-cache (and tier) lookup.
SHORT_PROMPT_LOOKAHEAD = 16


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager,
                 connector: KVConnector | None = None, is_ready: Callable[[str], bool] | None = None,
                 propose: Callable[[Request, int], list[int]] | None = None) -> None:
        """is_ready(request_id): False keeps a waiting request waiting without holding up the
        others (a request whose grammar still compiles, kvserve/structured/).

        propose(request, num_decodes): speculative decoding's drafts for a running request about
        to decode (kvserve/spec_decode/proposer.py); it is scheduled for 1 + len(drafts) tokens."""
        if not config.resolved:
            raise ValueError("the scheduler needs max_num_batched_tokens and max_model_len set "
                             "(EngineCore fills them in from the model)")
        self.config = config
        self.kv = kv_manager
        self.connector = connector
        self.is_ready = is_ready
        self.propose = propose
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # kept sorted by _order_key
        self.running: list[Request] = []
        self._seq = itertools.count()
        self._order: dict[str, tuple[int, float, int]] = {}
        self._finished_ids: set[str] = set()
        # Finished requests whose blocks the connector still reads (request_finished -> True).
        self.held: dict[str, Request] = {}
        # Requests finished because their connector could not load their KV: id -> why.
        self.failed: dict[str, str] = {}
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self._order[request.request_id] = (request.priority, request.arrival_time, next(self._seq))
        if (self.connector is not None and not request.skip_prefix_cache
                and self.connector.start_load(request, self.kv.num_cached_blocks(request))):
            request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self._enqueue(request)

    def _enqueue(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=lambda r: self._order[r.request_id])

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """Finish (stop string, abort) requests wherever they are; frees their blocks."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self._finish(req, status)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        req.finished_time = time.time()
        self._finished_ids.add(req.request_id)
        del self.requests[req.request_id]
        del self._order[req.request_id]
        if self.connector is not None and self.connector.request_finished(req):
            self.held[req.request_id] = req  # freed once the connector has sent its blocks
            return
        self._release(req)

    def _release(self, req: Request) -> None:
        self.kv.free(req)
        if self.connector is not None:
            self.connector.forget(req.request_id)

    def take_failed(self) -> dict[str, str]:
        out, self.failed = self.failed, {}
        return out

    def block_holders(self) -> list[Request]:
        """Every request holding blocks: live ones and finished ones still being sent."""
        return [*self.requests.values(), *self.held.values()]

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.held)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- scheduling -------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_ids)
        self._finished_ids = set()
        if self.connector is not None:
            for rid in self.connector.finished_sending():
                req = self.held.pop(rid, None)
                if req is not None:
                    self._release(req)
            for rid in self.connector.finished_loading():
                req = self.requests.get(rid)
                if req is None or req.status != RequestStatus.WAITING_FOR_REMOTE_KV:
                    continue
                why = self.connector.load_error(rid)
                if why is None:
                    req.status = RequestStatus.WAITING
                else:
                    self.waiting.remove(req)
                    self._finish(req, RequestStatus.FINISHED_ABORTED)
                    self.failed[rid] = why
        num_decodes = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)
        reserve, short = self._short_prompts(self.config.max_num_batched_tokens - num_decodes)
        budget = self._schedule_running(out, self.config.max_num_batched_tokens, num_decodes, reserve)
        if not out.preempted_req_ids:
            self._schedule_waiting(out, budget, short)
        if self.connector is not None:
            out.kv_connector_meta = self.connector.build_meta(out, self.requests)
        return out

    @property
    def num_loading(self) -> int:
        """Waiting requests held back until their KV arrives (WAITING_FOR_REMOTE_KV)."""
        return sum(1 for r in self.waiting if r.status == RequestStatus.WAITING_FOR_REMOTE_KV)

    def _short_prompts(self, room: int) -> tuple[int, list[Request]]:
        """Waiting requests of the first waiting priority, in order among the first
        SHORT_PROMPT_LOOKAHEAD, whose prompts finish within short_prompt_share of room and fit in
        the KV pool, and the tokens they need: what running prompt chunks leave this step."""
        share = int(room * self.config.short_prompt_share)
        slots = self.config.max_num_seqs - len(self.running)
        if share <= 0 or slots <= 0 or not self.waiting:
            return 0, []
        picked: list[Request] = []
        need_tokens = need_blocks = 0
        priority = self.waiting[0].priority
        for req in self.waiting[:SHORT_PROMPT_LOOKAHEAD]:
            if len(picked) == slots or req.priority != priority:
                break
            if (req.status == RequestStatus.WAITING_FOR_REMOTE_KV or req.leader_id is not None
                    or (self.is_ready is not None and not self.is_ready(req.request_id))):
                continue
            num_device = self.kv.num_cached_blocks(req)
            num_cached = (num_device + len(self._tier_hits(req, num_device))) * self.kv.block_size
            need = req.num_tokens - num_cached
            blocks = -(-req.num_tokens // self.kv.block_size) - num_device
            if need_tokens + need <= share and need_blocks + blocks <= self.kv.num_free_blocks:
                picked.append(req)
                need_tokens += need
                need_blocks += blocks
        return need_tokens, picked

    def _schedule_running(self, out: SchedulerOutput, budget: int, num_decodes: int, reserve: int) -> int:
        """Serve running requests in order; num_computed_tokens advances as they are scheduled
        (over drafted tokens too: update() rolls it back over the rejected ones). Prompt chunks
        leave `reserve` tokens and the decodes after them."""
        decodes_left = num_decodes
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new == 1:
                decodes_left -= 1
            elif num_new > 1:
                num_new = min(num_new, budget - reserve - decodes_left)
            if num_new <= 0:  # its last step is still in flight (pipeline parallel), or it yields
                i += 1
                continue
            drafts = self.propose(req, num_decodes)[:budget - 1] if self.propose and num_new == 1 else []
            num_new += len(drafts)
            blocks = self.kv.allocate_slots(req, num_new)
            if blocks is None and drafts:  # drafts never preempt anyone: decode without them
                num_new -= len(drafts)
                drafts = []
                blocks = self.kv.allocate_slots(req, num_new)
            while blocks is None:
                victim = max(self.running, key=lambda r: self._order[r.request_id])
                if victim.request_id in out.num_scheduled_tokens:
                    budget += out.num_scheduled_tokens.pop(victim.request_id)
                    out.draft_token_ids.pop(victim.request_id, None)
                    out.cached_reqs = [c for c in out.cached_reqs if c.req_id != victim.request_id]
                    i -= 1
                self._preempt(victim)
                out.preempted_req_ids.add(victim.request_id)
                if victim is req:
                    break
                blocks = self.kv.allocate_slots(req, num_new)
            if blocks is None:
                continue  # req itself was preempted; self.running shrank at index i
            out.num_scheduled_tokens[req.request_id] = num_new
            if drafts:
                out.draft_token_ids[req.request_id] = drafts
            start = req.num_computed_tokens
            new_ids = req.all_token_ids[start:start + num_new] if start >= req.num_prompt_tokens else []
            out.cached_reqs.append(CachedRequestData(req.request_id, blocks, start, new_ids,
                                                     len(req.block_ids) - len(blocks)))
            req.num_computed_tokens += num_new
            budget -= num_new
            i += 1
        return budget

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(req)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, first: list[Request]) -> None:
        """Admit `first` (the short prompts) and then the others, in order."""
        if first:
            ids = {r.request_id for r in first}
            self.waiting = first + [r for r in self.waiting if r.request_id not in ids]
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting.pop(0)
            if (req.status == RequestStatus.WAITING_FOR_REMOTE_KV
                    or (self.is_ready is not None and not self.is_ready(req.request_id))
                    or (req.leader_id is not None and not self._fork_from_leader(req, out))):
                skipped.append(req)
                continue
            computed: list[int] = []
            hits: list[TierHit] = []
            num_cached = req.num_computed_tokens  # > 0 only after a fork
            looked_up = not req.block_ids
            if looked_up:
                computed, num_cached = self.kv.get_computed_blocks(req)
                hits = self._tier_hits(req, len(computed))
            num_loaded = len(hits) * self.kv.block_size
            num_new = min(req.num_tokens - num_cached - num_loaded, budget)
            blocks = self.kv.allocate_slots(req, num_loaded + num_new, computed)
            if blocks is None:
                self.kv.free(req)  # undoes a fork; a no-op otherwise
                req.num_computed_tokens = 0
                self.waiting.insert(0, req)
                break
            if hits:  # the first new blocks take the loaded K/V; the connector may add work
                self.connector.on_allocated(req, blocks[:len(hits)], hits)
                budget -= self.connector.extra_tokens(req)
            if looked_up:
                self.kv.count_lookup(req, num_cached)
                if self.connector is not None and not req.skip_prefix_cache:
                    self.connector.count_lookup(req)
            num_cached += num_loaded
            req.num_computed_tokens = num_cached + num_new
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
                req.num_cached_tokens_by_tier = _by_tier(num_cached - num_loaded, hits, self.kv.block_size)
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.time()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.new_reqs.append(NewRequestData(
                req.request_id, req.prompt_token_ids, list(req.output_token_ids),
                req.sampling_params, list(req.block_ids), num_cached))
            out.num_scheduled_tokens[req.request_id] = num_new
            budget -= num_new
        if first:
            self.waiting.sort(key=lambda r: self._order[r.request_id])
        for req in skipped:
            self._enqueue(req)

    def _tier_hits(self, req: Request, num_device_blocks: int) -> list[TierHit]:
        if self.connector is None or req.skip_prefix_cache:
            return []
        return self.connector.lookup(req, num_device_blocks, max_cached_blocks(req, self.kv.block_size))

    def _fork_from_leader(self, req: Request, out: SchedulerOutput) -> bool:
        """n > 1: share the leader's full prompt blocks once it has computed them."""
        leader = self.requests.get(req.leader_id or "")
        if leader is None or leader.is_finished:
            req.leader_id = None  # the leader is gone: fall back to the prefix cache
            return True
        if leader.status != RequestStatus.RUNNING:
            return False
        share = (req.num_prompt_tokens - 1) // self.kv.block_size * self.kv.block_size
        # The leader's count already includes tokens scheduled this step: their K/V are
        # written before any attention runs, so the follower may read them in the same step.
        if leader.num_computed_tokens < share:
            return False
        req.leader_id = None
        if share:
            self.kv.fork(leader, req, share)
            req.num_computed_tokens = share
        return True

    # ---- after the model ran ----------------------------------------------

    def update(self, out: SchedulerOutput, sampled: dict[str, list[int]]) -> list[Request]:
        """Append each request's new tokens (one, or with drafts, the accepted drafts and the token
        after them), stopping at the first that ends it; returns the requests that got tokens."""
        updated: list[Request] = []
        now = time.time()
        for rid, tokens in sampled.items():
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.RUNNING:
                continue  # aborted or preempted meanwhile
            num_drafts = len(out.draft_token_ids.get(rid, ()))
            if num_drafts:  # the rejected drafts' K/V are not the request's: compute those positions again
                req.num_computed_tokens -= num_drafts - (len(tokens) - 1)
                self.kv.free_tail(req, req.num_computed_tokens + 1)
            if req.first_token_time is None:
                req.first_token_time = now
            status = None
            for token in tokens:
                req.append_output_token(token)
                status = self._check_stop(req, token)
                if status is not None:
                    break
            if num_drafts:
                self.kv.cache_computed(req)
            if status is not None:
                self.running.remove(req)
                self._finish(req, status)
            updated.append(req)
        return updated

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        p = req.sampling_params
        if req.num_output_tokens >= p.min_tokens:
            if token == req.eos_token_id and not p.ignore_eos:
                req.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if token in p.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None


def _by_tier(num_device_tokens: int, hits: list[TierHit], block_size: int) -> dict[str, int]:
    split = {DEVICE_TIER: num_device_tokens}
    for h in hits:
        split[h.origin] = split.get(h.origin, 0) + block_size
    return split
