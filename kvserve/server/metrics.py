"""Prometheus metrics at /metrics, all under the `kvserve:` prefix.

Two sources:
- per-request latencies and token counts, measured here in the API process as
  each request's deltas arrive (so TTFT includes the hop over ZeroMQ, as a
  client sees it);
- engine state (running / waiting requests, KV usage, prefix-cache and
  preemption counters), read from the engine process at scrape time.

Each app has its own CollectorRegistry, so several servers in one process (tests)
never share counts.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvserve.engine.wire import RequestDelta

PREFIX = "kvserve:"

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


class _EngineCollector(Collector):
    """Gauges and counters from the engine's latest stats snapshot (EngineCore.stats())."""

    def __init__(self) -> None:
        self.snapshot: dict[str, float | int] | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot
        if s is None:  # engine unreachable: report nothing rather than stale zeros
            return
        for stat, name, kind, doc in _ENGINE_METRICS:
            yield kind(f"{PREFIX}{name}", doc, value=s[stat])
        yield from _tier_metrics(s)
        yield from _transfer_metrics(s)
        yield from _blend_metrics(s)
        yield from _spec_decode_metrics(s)


_ENGINE_METRICS = (  # (EngineCore.stats() key, metric name, kind, help)
    ("num_running", "num_requests_running", GaugeMetricFamily, "Requests in the running batch."),
    ("num_waiting", "num_requests_waiting", GaugeMetricFamily, "Requests waiting to be scheduled."),
    ("kv_usage", "kv_cache_usage_perc", GaugeMetricFamily, "Fraction of KV blocks in use (1 = 100%)."),
    ("prefix_cache_queries", "prefix_cache_queries", CounterMetricFamily,
     "Prompt tokens looked up in the prefix cache."),
    ("prefix_cache_hits", "prefix_cache_hits", CounterMetricFamily, "Prompt tokens found in the prefix cache."),
    ("num_preemptions", "num_preemptions", CounterMetricFamily, "Requests preempted (to be recomputed)."),
    ("max_num_batched_tokens", "max_num_batched_tokens", GaugeMetricFamily,
     "The step budget: the most tokens one engine step computes (as given, or sized by the machine at start)."),
)


_TIER_METRICS = (  # (stat suffix, metric name, kind, help)
    ("queries", "kv_tier_queries", CounterMetricFamily, "Prompt tokens looked up in a KV tier."),
    ("hits", "kv_tier_hits", CounterMetricFamily, "Prompt tokens found in a KV tier."),
    ("bytes_offloaded", "kv_tier_bytes_offloaded", CounterMetricFamily, "Bytes of KV written to a tier."),
    ("bytes_used", "kv_tier_usage_bytes", GaugeMetricFamily, "Bytes held by a tier."),
    ("capacity_bytes", "kv_tier_capacity_bytes", GaugeMetricFamily, "A tier's size limit (0: managed elsewhere)."),
    ("available", "kv_tier_available", GaugeMetricFamily, "1 while the tier is reachable."),
    ("write_failures", "kv_tier_write_failures", CounterMetricFamily,
     "Writes a tier did not store (I/O error, disk full, unreachable)."),
    ("degraded", "kv_tier_degraded", GaugeMetricFamily,
     "1 while a tier is unreachable or its writes fail (KV is not being kept there)."),
)


def _tier_metrics(s: dict[str, float | int]) -> Iterator[Metric]:
    tiers = [t for t in ("cpu", "disk", "remote") if f"kv_tier_{t}_queries" in s]
    if not tiers:
        return
    for suffix, name, kind, doc in _TIER_METRICS:
        fam = kind(f"{PREFIX}{name}", doc, labels=["tier"])
        for t in tiers:
            fam.add_metric([t], float(s[f"kv_tier_{t}_{suffix}"]))
        yield fam
    yield CounterMetricFamily(f"{PREFIX}kv_tier_bytes_onloaded", "Bytes of KV loaded back into the KV cache.",
                              value=s["kv_tier_bytes_onloaded"])
    yield CounterMetricFamily(f"{PREFIX}kv_tier_writes_dropped", "Blocks not written to a slower tier because "
                              "its write queue was full.", value=s["kv_tier_writes_dropped"])


def _transfer_metrics(s: dict[str, float | int]) -> Iterator[Metric]:
    """Prefill/decode KV transfer (--kv-role), from the PD connector's stats."""
    if "kv_transfer_sent" not in s:
        return
    fam = CounterMetricFamily(f"{PREFIX}kv_transfer_requests", "Requests whose K/V were sent to, received from, "
                              "or failed to come from another engine, or expired unfetched.", labels=["outcome"])
    for outcome in ("sent", "received", "failed", "expired"):
        if f"kv_transfer_{outcome}" in s:
            fam.add_metric([outcome], float(s[f"kv_transfer_{outcome}"]))
    yield fam
    yield CounterMetricFamily(f"{PREFIX}kv_transfer_tokens_received", "Prompt tokens whose K/V came from a "
                              "prefill engine.", value=s["kv_transfer_tokens_received"])
    if "kv_transfer_bytes_sent" in s:
        yield CounterMetricFamily(f"{PREFIX}kv_transfer_bytes_sent", "Bytes of K/V sent to decode engines.",
                                  value=s["kv_transfer_bytes_sent"])
        yield GaugeMetricFamily(f"{PREFIX}kv_transfer_pending", "Finished prompts whose K/V wait to be fetched.",
                                value=s["kv_transfer_pending"])


_BLEND_METRICS = (  # (stat, metric name, help)
    ("blend_requests", "blend_requests", "Requests whose chunks were blended (reused K/V out of prefix order)."),
    ("blend_blended_tokens", "blend_blended_tokens", "Prompt tokens that kept K/V reused from a cached chunk."),
    ("blend_recomputed_tokens", "blend_recomputed_tokens", "Prompt tokens of blended spans recomputed in full."),
    ("blend_fallbacks", "blend_fallbacks", "Blends the quality guard turned into a full recompute."),
    ("blend_warmup_tokens", "blend_warmup_tokens", "Chunk tokens computed on their own to be cached for reuse."),
)


def _blend_metrics(s: dict[str, float | int]) -> Iterator[Metric]:
    """Non-prefix chunk reuse (--enable-blending), from the blend connector's stats."""
    for stat, name, doc in _BLEND_METRICS:
        if stat in s:
            yield CounterMetricFamily(f"{PREFIX}{name}", doc, value=s[stat])


_SPEC_METRICS = (  # (stat, metric name, help), as vLLM names them
    ("spec_decode_num_drafts", "spec_decode_num_drafts", "Verify steps of a request with drafted tokens."),
    ("spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens", "Drafted tokens verified."),
    ("spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens", "Drafted tokens accepted."),
)


def _spec_decode_metrics(s: dict[str, float | int]) -> Iterator[Metric]:
    """Speculative decoding (--speculative-config), from the engine's proposer."""
    if "spec_decode_num_drafts" not in s:
        return
    for stat, name, doc in _SPEC_METRICS:
        yield CounterMetricFamily(f"{PREFIX}{name}", doc, value=s[stat])
    fam = CounterMetricFamily(f"{PREFIX}spec_decode_num_accepted_tokens_per_pos",
                              "Drafted tokens accepted, by their position in the draft.", labels=["position"])
    pos = 0
    while f"spec_decode_num_accepted_tokens_pos_{pos}" in s:
        fam.add_metric([str(pos)], float(s[f"spec_decode_num_accepted_tokens_pos_{pos}"]))
        pos += 1
    yield fam


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(f"{PREFIX}time_to_first_token_seconds", "Time to the first output token.",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(f"{PREFIX}inter_token_latency_seconds", "Time between output tokens of a request.",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}e2e_request_latency_seconds", "Request latency, arrival to last token.",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram(f"{PREFIX}request_queue_time_seconds", "Time from arrival to first scheduling.",
                               buckets=_LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens of started requests.", registry=r)
        self.generation_tokens = Counter(f"{PREFIX}generation_tokens", "Generated tokens.", registry=r)
        self.success = Counter(f"{PREFIX}request_success", "Finished completions by finish reason.",
                               ["finished_reason"], registry=r)
        self.engine = _EngineCollector()
        r.register(self.engine)
        # Sequences (an engine request's n completions) sent and not yet given their first token;
        # --max-waiting bounds it.
        self.num_waiting_first_token = 0

    async def render(self, engine: Any) -> bytes:
        """The exposition text; engine gauges are read fresh (skipped if the engine is dead)."""
        try:
            self.engine.snapshot = await engine.stats(timeout=5.0) if engine.is_alive() else None
        except Exception:  # noqa: BLE001 - a dead or stuck engine must not break /metrics
            self.engine.snapshot = None
        return generate_latest(self.registry)

    def track(self, n: int) -> RequestTracker:
        return RequestTracker(self, n)


class RequestTracker:
    """Observes one engine request's deltas (n completions); `close()` once it is over, however it
    ended: completions that never finished (the client left, the engine died) count as aborted."""

    def __init__(self, m: ServerMetrics, n: int) -> None:
        self.m = m
        self.unfinished = n
        self.start = time.perf_counter()
        self.last: float | None = None  # when the last token-carrying delta arrived
        self.counted_prompt = False
        self.closed = False
        self.waiting = set(range(n))  # completions without a token yet
        m.num_waiting_first_token += n

    def on_delta(self, d: RequestDelta) -> None:
        now = time.perf_counter()
        if d.num_prompt_tokens and not self.counted_prompt:
            self.counted_prompt = True
            self.m.prompt_tokens.inc(d.num_prompt_tokens)
        tokens = sum(len(c.token_ids) for c in d.outputs)
        if tokens:
            self.m.generation_tokens.inc(tokens)
            if self.last is None:
                self.m.ttft.observe(now - self.start)
            else:
                self.m.itl.observe(now - self.last)
            self.last = now
        for c in d.outputs:
            if c.index in self.waiting and (c.token_ids or c.finish_reason is not None):
                self.waiting.discard(c.index)
                self.m.num_waiting_first_token -= 1
            if c.finish_reason is not None:
                self.m.success.labels(finished_reason=c.finish_reason).inc()
                self.unfinished -= 1
        if d.finished:
            self.m.e2e.observe(now - self.start)
            met = d.metrics
            if met is not None and met.first_scheduled_time is not None:
                self.m.queue.observe(max(0.0, met.first_scheduled_time - met.arrival_time))
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.m.num_waiting_first_token -= len(self.waiting)
            self.waiting.clear()
            if self.unfinished > 0:
                self.m.success.labels(finished_reason="abort").inc(self.unfinished)
