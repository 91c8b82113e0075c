"""BlendConnector: chunks of a prompt reuse their K/V wherever they appear (CacheBlend), as a KV
connector (core/kv_connector.py).

A chunk's K/V are computed on their own, as a prompt made of the chunk alone, and cached like any
prompt: full blocks in the device prefix cache under the chunk's chain hash, from where they go
down to the KV tiers and come back like any block. (Computed after the model's BOS instead, as a
sink for the attention a model puts on a prompt's first token, naive reuse got better but blending
at the default ratio worse: BENCHMARKS.md.) So a chunk cached once is found again by its
content, in any prompt, at any position.

The scheduler half offers a blended request's blocks from where its device (and tier) hits end
up to the last full block of its last chunk (the "span"), as hits of origin "blend". When the
request is scheduled, each chunk's blocks are looked up (device, then tiers) and held; a chunk's
blocks found nowhere are allocated and computed on their own first, in the same step (a warm-up),
so the cache has them next time. The plan goes to the worker role (forward.py's BlendWorker, inside the rank), which copies the
chunks' K/V into the request's blocks re-rotated to their positions, recomputes every token of the
span through the first layers, picks the tokens whose V moved most from the reused copy, weighed
by the attention the question pays them, and recomputes those through the remaining layers. The
rest of the prompt (the question after the last chunk) runs in the step's ordinary forward.

The span's blocks hold approximate K/V: the connector has the prefix cache key them apart
(`block_salt`), so a plain prefill never reuses them. (A later prompt with the same
chunks in the same order but another question reuses them as they are, picked for the first
question.)
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvserve.blend.chunks import BLENDED, RECOMPUTED, blend_spec, check_blend_spec
from kvserve.config import BlendConfig
from kvserve.core.kv_connector import EvictedBlock, KVConnector, TierHit
from kvserve.core.prefix_cache import compute_block_hashes
from kvserve.core.sched_output import SchedulerOutput
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

BLEND_ORIGIN = "blend"


@dataclass
class ChunkSource:
    """Prompt tokens [start, end) of a request take the K/V of a chunk computed on its own (from
    position 0), whose first token sits at prompt position `offset`: prompt position p is chunk
    position p - offset of `block_ids`, and its K are rotated by `offset`."""

    start: int
    end: int
    offset: int
    block_ids: list[int]


@dataclass
class Warmup:
    """Compute a chunk's tokens [start, len(token_ids)) on their own into block_ids (a prefill
    from position 0 whose first `start` tokens are cached)."""

    token_ids: list[int]
    start: int
    block_ids: list[int]


@dataclass
class BlendPlan:
    """One request's span [start, end): its blocks, the chunks that supply K/V, and the knobs."""

    request_id: str
    token_ids: list[int]  # the prompt up to `query_end`
    block_ids: list[int]
    start: int
    end: int
    # the prompt's tokens [end, query_end) run in this step's ordinary forward after the blend (the
    # question after the last chunk): the attention they pay the span ranks the tokens to recompute
    query_end: int
    sources: list[ChunkSource]
    forced: list[tuple[int, int]]  # prompt spans always recomputed (chunks' first tokens)
    recompute_ratio: float
    check_layer: int
    max_deviation: float


@dataclass
class BlendStepMeta:
    warmups: list[Warmup] = field(default_factory=list)
    plans: list[BlendPlan] = field(default_factory=list)


@dataclass
class BlendResult:
    """What the worker did to one span: tokens whose reused K/V were kept, tokens recomputed, the
    mean relative K/V deviation it measured at the check layer (None: not measured), and whether
    the quality guard turned it into a full recompute."""

    blended: int
    recomputed: int
    deviation: float | None
    fallback: bool


class BlendConnector(KVConnector):
    """The scheduler role; the engine thread calls everything. Its worker role is forward.py's
    BlendWorker, whose results come back through `update_connector_output`."""

    name = "blend"

    def __init__(self, cfg: BlendConfig, kv: Any, num_layers: int, tiers: KVConnector | None = None) -> None:
        self.cfg = cfg
        self.kv = kv  # the KVCacheManager: chunks are looked up, held and allocated in its pool
        self.num_layers = num_layers
        self.tiers = tiers  # where chunks evicted from the device are found again
        self.block_size = kv.block_size
        self._ids = itertools.count()
        self._step = BlendStepMeta()
        self._requests: dict[str, Request] = {}  # planned this step, for their usage split
        self._holders: list[Request] = []  # chunks held for this step (pseudo requests of the KV manager)
        self._warmup: dict[str, int] = {}  # request -> warm-up tokens planned for it this step
        self.recent: deque[BlendResult] = deque(maxlen=256)  # the last blends' results, to inspect
        self.counts = {"requests": 0, "blended_tokens": 0, "recomputed_tokens": 0, "fallbacks": 0,
                       "warmup_tokens": 0}

    # ---- scheduler half ---------------------------------------------------------

    def validate_request(self, params: Any, num_prompt_tokens: int) -> None:
        check_blend_spec(blend_spec(params), self.cfg, num_prompt_tokens, self.num_layers)

    def block_salt(self, request: Request) -> tuple[int, str] | None:
        """The blocks from the first chunk's on may hold reused (approximate) K/V."""
        spec = blend_spec(request.sampling_params)
        return None if spec is None else (spec["chunks"][0][0] // self.block_size, "approx")

    def on_evict(self, block: EvictedBlock) -> None:
        pass

    def _span_end_block(self, request: Request, max_blocks: int) -> int:
        spec = blend_spec(request.sampling_params)
        if spec is None:
            return 0
        return min(max_blocks, spec["chunks"][-1][1] // self.block_size)

    def lookup(self, request: Request, start_block: int, max_blocks: int) -> list[TierHit]:
        end = self._span_end_block(request, max_blocks)
        if end <= start_block:
            return []
        hashes = compute_block_hashes(request, end, self.block_size)
        return [TierHit(hashes[i], BLEND_ORIGIN) for i in range(start_block, end)]

    def count_lookup(self, request: Request) -> None:
        pass

    def on_allocated(self, request: Request, block_ids: list[int], hits: list[TierHit]) -> None:
        bs = self.block_size
        first = request.block_ids.index(block_ids[0])
        start, end = first * bs, (first + len(block_ids)) * bs
        spec = blend_spec(request.sampling_params)
        skip = self.cfg.recompute_chunk_start
        sources: list[ChunkSource] = []
        forced: list[tuple[int, int]] = []
        for a, b in spec["chunks"]:
            if b <= start or a >= end:
                continue
            if skip:
                forced.append((a, min(b, a + skip)))
            blocks = self._hold_chunk(request, request.prompt_token_ids[a:b])
            lo, hi = max(a, start), min(b, end, a + len(blocks) * bs)
            if lo < hi:
                sources.append(ChunkSource(lo, hi, a, blocks))
        ratio = spec.get("recompute_ratio")
        layer = spec.get("check_layer")
        self._step.plans.append(BlendPlan(
            request.request_id, request.prompt_token_ids[:end], list(request.block_ids), start, end, end, sources, forced,
            self.cfg.recompute_ratio if ratio is None else ratio, self.cfg.check_layer if layer is None else layer,
            self.cfg.max_deviation))
        self._requests[request.request_id] = request

    def _hold_chunk(self, request: Request, tokens: list[int]) -> list[int]:
        """The device blocks holding the chunk's K/V computed on its own (its full blocks), held
        until the step's forward is done: found in the prefix cache, brought back from the tiers,
        or allocated and computed first (a warm-up). [] when the pool has no room for them."""
        bs = self.block_size
        n = len(tokens) // bs
        if n == 0:
            return []
        holder = Request(f"blend-chunk:{next(self._ids)}", tokens, SamplingParams(max_tokens=1),
                         cache_salt=request.cache_salt)
        cached = self.kv.cache.match(holder, n)
        hits = self.tiers.lookup(holder, len(cached), n) if self.tiers is not None else []
        num_new = (n - len(cached) - len(hits)) * bs
        new = self.kv.allocate_slots(holder, len(hits) * bs + num_new, cached)
        if new is None:
            self.kv.free(holder)
            if self.tiers is not None:
                self.tiers.forget(holder.request_id)
            return []
        if self.tiers is not None:
            self.tiers.count_lookup(holder)
            if hits:
                self.tiers.on_allocated(holder, new[:len(hits)], hits)
        self._holders.append(holder)
        if num_new:
            self._step.warmups.append(Warmup(tokens[:n * bs], n * bs - num_new, list(holder.block_ids)))
            self.counts["warmup_tokens"] += num_new
            self._warmup[request.request_id] = self._warmup.get(request.request_id, 0) + num_new
        return list(holder.block_ids)

    def extra_tokens(self, request: Request) -> int:
        """The chunks' warm-ups run in the step beside the request's own tokens."""
        return self._warmup.pop(request.request_id, 0)

    def build_meta(self, out: SchedulerOutput, requests: Mapping[str, Request]) -> BlendStepMeta | None:
        meta, self._step = self._step, BlendStepMeta()
        for plan in meta.plans:  # the prompt tokens after the span that this step computes
            req = requests[plan.request_id]
            plan.query_end = max(plan.end, min(req.num_computed_tokens, req.num_prompt_tokens))
            plan.token_ids = req.prompt_token_ids[:plan.query_end]
        return meta if meta.plans or meta.warmups else None

    def start_load(self, request: Request, num_device_blocks: int) -> bool:
        return False

    def finished_loading(self) -> list[str]:
        return []

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._warmup.pop(request_id, None)

    def stats(self) -> dict[str, Any]:
        return {f"blend_{k}": v for k, v in self.counts.items()}

    def update_connector_output(self, output: dict[str, BlendResult] | None) -> None:
        """The step is done: count what the worker did to each span, and let the chunks' blocks go
        (they stay cached, no longer held)."""
        for rid, res in (output or {}).items():
            self.recent.append(res)
            self.counts["requests"] += 1
            self.counts["blended_tokens"] += res.blended
            self.counts["recomputed_tokens"] += res.recomputed
            self.counts["fallbacks"] += res.fallback
            req = self._requests.pop(rid, None)
            if req is not None:  # the span was counted as cached when scheduled: report it apart
                split = req.num_cached_tokens_by_tier
                req.num_cached_tokens -= split.pop(BLEND_ORIGIN, 0)
                split[BLENDED] = split.get(BLENDED, 0) + res.blended
                split[RECOMPUTED] = split.get(RECOMPUTED, 0) + res.recomputed
        for holder in self._holders:
            self.kv.free(holder)
            if self.tiers is not None:
                self.tiers.forget(holder.request_id)
        self._holders = []


def num_to_recompute(ratio: float, num_tokens: int) -> int:
    """How many of a span's tokens a recompute ratio asks for."""
    return min(num_tokens, math.ceil(ratio * num_tokens - 1e-9))
