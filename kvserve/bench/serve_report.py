"""Results of `kvserve bench serve`: per-request timings, their summary, the printed table."""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvserve.bench.table import cpu_model, render_table


@dataclass
class RequestTiming:
    ok: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""
    turn: int = 0  # index within its session; always 0 outside multiturn
    text: str = field(default="", repr=False)  # the completion, for the next turn's prompt


@dataclass
class LatencyStats:
    """Milliseconds; all zero when there is no sample (no completed request)."""

    mean: float = 0.0
    median: float = 0.0
    p99: float = 0.0


@dataclass
class ServeBenchResult:
    base_url: str
    model: str
    dataset: str
    command: str
    hardware: str
    num_prompts: int
    request_rate: float  # req/s; inf: all requests sent at once
    max_concurrency: int | None  # None: unlimited
    completed: int
    failed: int
    first_error: str
    duration_s: float
    total_prompt_tokens: int
    total_output_tokens: int
    total_cached_tokens: int
    cached_fraction: float  # of the prompt tokens of completed requests
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: LatencyStats
    tpot_ms: LatencyStats
    itl_ms: LatencyStats
    e2e_ms: LatencyStats
    # multiturn only (None otherwise). A failed turn ends its session: the turns after it are not sent.
    turns_sent: int | None = None
    turns_not_sent: int | None = None
    first_turn_ttft_ms: LatencyStats | None = None
    later_turn_ttft_ms: LatencyStats | None = None  # turns 2+, whose prompt prefix the server may hold
    later_turn_cached_fraction: float | None = None


# ---- results ------------------------------------------------------------------


def latency_stats(seconds: list[float]) -> LatencyStats:
    if not seconds:
        return LatencyStats()
    ms = np.asarray(seconds, dtype=np.float64) * 1000.0
    return LatencyStats(float(ms.mean()), float(np.median(ms)), float(np.percentile(ms, 99)))


def summarize(metrics: list[RequestTiming], duration: float, args: argparse.Namespace,
              model: str, not_sent: int = 0) -> ServeBenchResult:
    done = [m for m in metrics if m.ok]
    failed = [m for m in metrics if not m.ok]
    prompt = sum(m.prompt_tokens for m in done)
    output = sum(m.completion_tokens for m in done)
    cached = sum(m.cached_tokens for m in done)
    duration = max(duration, 1e-9)
    tpot = [(m.e2e_s - m.ttft_s) / (m.completion_tokens - 1) for m in done if m.completion_tokens > 1]
    result = ServeBenchResult(
        base_url=args.base_url, model=model, dataset=args.dataset, command=" ".join(sys.argv),
        hardware=cpu_model(), num_prompts=args.num_prompts, request_rate=args.request_rate,
        max_concurrency=args.max_concurrency, completed=len(done), failed=len(failed),
        first_error=failed[0].error if failed else "", duration_s=duration,
        total_prompt_tokens=prompt, total_output_tokens=output, total_cached_tokens=cached,
        cached_fraction=cached / prompt if prompt else 0.0, request_throughput=len(done) / duration,
        output_throughput=output / duration, total_token_throughput=(prompt + output) / duration,
        ttft_ms=latency_stats([m.ttft_s for m in done]), tpot_ms=latency_stats(tpot),
        itl_ms=latency_stats([g for m in done for g in m.itl_s]), e2e_ms=latency_stats([m.e2e_s for m in done]))
    if args.dataset == "multiturn":
        later = [m for m in done if m.turn > 0]
        later_prompt = sum(m.prompt_tokens for m in later)
        result.turns_sent, result.turns_not_sent = len(metrics), not_sent
        result.first_turn_ttft_ms = latency_stats([m.ttft_s for m in done if m.turn == 0])
        result.later_turn_ttft_ms = latency_stats([m.ttft_s for m in later])
        result.later_turn_cached_fraction = (sum(m.cached_tokens for m in later) / later_prompt
                                             if later_prompt else 0.0)
    return result


def result_dict(r: ServeBenchResult) -> dict[str, Any]:
    """asdict, with an infinite rate written as "inf" (JSON has no infinity)."""
    d = asdict(r)
    if math.isinf(r.request_rate):
        d["request_rate"] = "inf"
    return d


def format_serve_table(r: ServeBenchResult) -> str:
    multiturn = r.turns_sent is not None
    unit = "sessions" if multiturn else "req"
    turns = [("turns sent / not sent", f"{r.turns_sent} / {r.turns_not_sent}")] if multiturn else []
    rows = [
        ("hardware (client)", r.hardware),
        ("base url", r.base_url),
        ("model", r.model),
        ("dataset", r.dataset),
        ("command", r.command),
        ("num sessions" if multiturn else "num prompts", str(r.num_prompts)),
        (f"{'session' if multiturn else 'request'} rate ({unit}/s)",
         "inf (all at once)" if math.isinf(r.request_rate) else f"{r.request_rate:g}"),
        (f"max concurrency{' (sessions)' if multiturn else ''}",
         "unlimited" if r.max_concurrency is None else str(r.max_concurrency)),
        ("completed / failed", f"{r.completed} / {r.failed}"),
        *turns,
        ("duration (s)", f"{r.duration_s:.2f}"),
        ("total prompt tokens", str(r.total_prompt_tokens)),
        ("total output tokens", str(r.total_output_tokens)),
        ("request throughput (req/s)", f"{r.request_throughput:.3f}"),
        ("output token throughput (tok/s)", f"{r.output_throughput:.1f}"),
        ("total token throughput (tok/s)", f"{r.total_token_throughput:.1f}"),
        ("prompt tokens from cache", f"{r.cached_fraction:.1%} ({r.total_cached_tokens})"),
    ]
    if multiturn:
        rows.append(("later turns: prompt tokens from cache", f"{r.later_turn_cached_fraction:.1%}"))
    for name, s in (("TTFT", r.ttft_ms), ("TPOT", r.tpot_ms), ("ITL", r.itl_ms), ("E2E latency", r.e2e_ms)):
        rows.append((f"{name} mean / median / p99 (ms)", f"{s.mean:.2f} / {s.median:.2f} / {s.p99:.2f}"))
    for name, s in (("first", r.first_turn_ttft_ms), ("later", r.later_turn_ttft_ms)):
        if s is not None:
            rows.append((f"TTFT {name} turns median / p99 (ms)", f"{s.median:.2f} / {s.p99:.2f}"))
    return render_table(rows, [f"first error: {r.first_error}"] if r.first_error else [])
