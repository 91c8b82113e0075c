"""`kvserve bench serve`: online serving benchmark over the OpenAI streaming completions API.

Requests arrive as a Poisson process (or all at once), optionally capped by a concurrency
limit, and are timed on the client side. Prompts are sent as token id lists so every prompt
length is exact, with `ignore_eos` so every request produces its full output length.

Timing of one request (time.perf_counter, from just before the HTTP request is sent):
  TTFT  first stream chunk that carries a choice, i.e. the first generated token. A chunk
        whose text is held back by the detokenizer (an incomplete UTF-8 character) still
        counts: the token was produced, and only its text waits for the next one.
  ITL   gaps between successive chunks that carry a choice.
  TPOT  (E2E - TTFT) / (completion_tokens - 1), for requests with more than one output token.
  E2E   until the stream ends.
Token counts (prompt, completion, cached) come from the final usage chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvserve.bench.datasets import (
    BenchRequest,
    load_sharegpt,
    prefix_requests,
    random_requests,
)
from kvserve.bench.throughput import DEFAULT_RANDOM_LEN, cpu_model

DEFAULT_PREFIX_LEN = 2048
DEFAULT_PREFIX_OUTPUT_LEN = 32
# The server has no key unless started with --api-key; the client library insists on one.
PLACEHOLDER_API_KEY = "EMPTY"


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


# ---- command line -------------------------------------------------------------


def add_serve_bench_parser(bench_sub: Any) -> None:
    p = bench_sub.add_parser("serve", help="online serving load test against an OpenAI-compatible server")
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="server address; /v1 is appended unless the URL already ends with it")
    p.add_argument("--dataset", default="sharegpt", choices=["sharegpt", "random", "prefix"])
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrival rate in requests/s (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most (default: no cap)")
    p.add_argument("--seed", type=int, default=0, help="dataset selection and arrival times")
    p.add_argument("--input-len", type=int, default=None,
                   help=f"random: prompt tokens per request (default {DEFAULT_RANDOM_LEN})")
    p.add_argument("--output-len", type=int, default=None,
                   help=f"output tokens per request (random default {DEFAULT_RANDOM_LEN}; prefix default "
                        f"{DEFAULT_PREFIX_OUTPUT_LEN}; sharegpt default: the reference completion's length)")
    p.add_argument("--prefix-len", type=int, default=DEFAULT_PREFIX_LEN, help="prefix: tokens of the shared prompt")
    p.add_argument("--max-prompt-len", type=int, default=512, help="sharegpt: longest prompt kept")
    p.add_argument("--max-output-len", type=int, default=256, help="sharegpt: longest completion kept")
    p.add_argument("--tokenizer", default=None, help="model path for the tokenizer (default: the server's model root)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--api-key", default=None, help="bearer token for a server started with --api-key")
    p.add_argument("--cache-salt", default=None, help="sent with every request; isolates this run's prefix cache")
    p.add_argument("--output-json", default=None, help="also write the numbers to this JSON file")
    p.set_defaults(func=cmd_serve_bench)


def cmd_serve_bench(args: argparse.Namespace) -> int:
    result = run_serve_bench(args)
    print(format_serve_table(result))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result_dict(result), indent=2) + "\n")
    return 0


def _check_args(args: argparse.Namespace) -> None:
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be at least 1, got {args.num_prompts}")
    if not args.request_rate > 0:  # also rejects nan
        raise ValueError(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be at least 1, got {args.max_concurrency}")
    for flag in ("input_len", "output_len", "prefix_len"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")


def _v1_url(base_url: str) -> str:
    url = base_url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


# ---- the run ------------------------------------------------------------------


def run_serve_bench(args: argparse.Namespace) -> ServeBenchResult:
    """Run the benchmark described by parsed `bench serve` arguments; ValueError on bad ones."""
    _check_args(args)
    return asyncio.run(_run(args))


async def _run(args: argparse.Namespace) -> ServeBenchResult:
    from openai import AsyncOpenAI

    base = _v1_url(args.base_url)
    client = AsyncOpenAI(base_url=base, api_key=args.api_key or PLACEHOLDER_API_KEY, max_retries=0)
    try:
        model, root = await _server_model(client, args)
        reqs = build_serve_requests(args, _load_tokenizer(args.tokenizer or root))
        start = time.perf_counter()
        metrics = await _issue_all(client, model, reqs, args)
        duration = time.perf_counter() - start
    finally:
        await client.close()
    return summarize(metrics, duration, args, model)


async def _server_model(client: Any, args: argparse.Namespace) -> tuple[str, str | None]:
    """(model name to send, model path on the server) from GET /v1/models."""
    import openai

    try:
        cards = [m async for m in client.models.list()]
    except openai.APIStatusError as e:
        raise ValueError(f"--base-url {args.base_url}: GET /v1/models failed: {e}") from None
    except openai.APIError as e:
        raise ValueError(f"--base-url {args.base_url}: cannot reach the server ({e})") from None
    if not cards:
        raise ValueError(f"--base-url {args.base_url}: the server lists no model")
    root = getattr(cards[0], "root", None)
    return args.model or cards[0].id, root if isinstance(root, str) else None


def _load_tokenizer(path: str | None) -> Any:
    from kvserve.models.loader import load_tokenizer

    if path is None:
        raise ValueError("the server does not report its model path; pass --tokenizer MODEL_PATH")
    if not Path(path).expanduser().exists():
        raise ValueError(f"tokenizer path {path!r} does not exist on this machine; pass --tokenizer MODEL_PATH")
    return load_tokenizer(path)


def build_serve_requests(args: argparse.Namespace, tokenizer: Any) -> list[BenchRequest]:
    if args.dataset == "random":
        input_len = DEFAULT_RANDOM_LEN if args.input_len is None else args.input_len
        output_len = DEFAULT_RANDOM_LEN if args.output_len is None else args.output_len
        return random_requests(tokenizer, args.num_prompts, input_len, output_len, seed=args.seed)
    if args.dataset == "prefix":
        output_len = DEFAULT_PREFIX_OUTPUT_LEN if args.output_len is None else args.output_len
        return prefix_requests(tokenizer, args.num_prompts, args.prefix_len, output_len, seed=args.seed)
    reqs = load_sharegpt(tokenizer, args.num_prompts, args.max_prompt_len, args.max_output_len, seed=args.seed)
    if args.output_len is not None:
        for r in reqs:
            r.output_len = args.output_len
    return reqs


def arrival_gaps(n: int, rate: float, seed: int) -> list[float]:
    """Seconds to wait before each request: exponential gaps (a Poisson process), or none for inf."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    return [rng.expovariate(rate) for _ in range(n)]


async def _issue_all(client: Any, model: str, reqs: list[BenchRequest],
                     args: argparse.Namespace) -> list[RequestTiming]:
    from tqdm import tqdm

    # The cap gates sending, not arrival: a request waiting for a slot is already late,
    # so its queueing shows in its latency as it would for a real client.
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    bar = tqdm(total=len(reqs), desc="requests", unit="req")

    async def one(req: BenchRequest) -> RequestTiming:
        if limit is None:
            m = await send_request(client, model, req, args.cache_salt)
        else:
            async with limit:
                m = await send_request(client, model, req, args.cache_salt)
        bar.update(1)
        return m

    tasks = []
    try:
        for req, gap in zip(reqs, arrival_gaps(len(reqs), args.request_rate, args.seed)):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(req)))
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        bar.close()


async def send_request(client: Any, model: str, req: BenchRequest, cache_salt: str | None) -> RequestTiming:
    """One streamed completion, timed; failures are recorded in the result, never raised."""
    import openai

    extra: dict[str, Any] = {"ignore_eos": True}
    if cache_salt is not None:
        extra["cache_salt"] = cache_salt
    m = RequestTiming()
    usage = None
    last = None
    start = time.perf_counter()
    try:
        stream = await client.completions.create(
            model=model, prompt=req.prompt_token_ids, max_tokens=req.output_len, temperature=0.0, stream=True,
            stream_options={"include_usage": True}, extra_body=extra)
        async with stream:
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.choices:
                    if last is None:
                        m.ttft_s = now - start
                    else:
                        m.itl_s.append(now - last)
                    last = now
                if chunk.usage is not None:
                    usage = chunk.usage
        m.e2e_s = time.perf_counter() - start
    except openai.APIStatusError as e:  # HTTP 4xx/5xx, 503 overload included: not retried
        m.error = f"HTTP {e.status_code}: {_error_message(e)}"
    except openai.APIError as e:  # an error event mid-stream, or a connection failure
        m.error = f"{type(e).__name__}: {_error_message(e)}"
    except Exception as e:  # noqa: BLE001 - a benchmark records failures and carries on
        m.error = f"{type(e).__name__}: {e}"
    if not m.error:
        if usage is None or last is None:
            m.error = "the stream ended without " + ("any token" if last is None else "a usage chunk")
        else:
            m.ok = True
            m.prompt_tokens, m.completion_tokens = usage.prompt_tokens, usage.completion_tokens
            details = usage.prompt_tokens_details
            m.cached_tokens = (details.cached_tokens or 0) if details is not None else 0
    return m


def _error_message(e: Any) -> str:
    body = getattr(e, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            return inner["message"]
    return str(getattr(e, "message", e))


# ---- results ------------------------------------------------------------------


def latency_stats(seconds: list[float]) -> LatencyStats:
    if not seconds:
        return LatencyStats()
    ms = np.asarray(seconds, dtype=np.float64) * 1000.0
    return LatencyStats(float(ms.mean()), float(np.median(ms)), float(np.percentile(ms, 99)))


def summarize(metrics: list[RequestTiming], duration: float, args: argparse.Namespace,
              model: str) -> ServeBenchResult:
    done = [m for m in metrics if m.ok]
    failed = [m for m in metrics if not m.ok]
    prompt = sum(m.prompt_tokens for m in done)
    output = sum(m.completion_tokens for m in done)
    cached = sum(m.cached_tokens for m in done)
    duration = max(duration, 1e-9)
    tpot = [(m.e2e_s - m.ttft_s) / (m.completion_tokens - 1) for m in done if m.completion_tokens > 1]
    return ServeBenchResult(
        base_url=args.base_url, model=model, dataset=args.dataset, command=" ".join(sys.argv),
        hardware=cpu_model(), num_prompts=args.num_prompts, request_rate=args.request_rate,
        max_concurrency=args.max_concurrency, completed=len(done), failed=len(failed),
        first_error=failed[0].error if failed else "", duration_s=duration,
        total_prompt_tokens=prompt, total_output_tokens=output, total_cached_tokens=cached,
        cached_fraction=cached / prompt if prompt else 0.0, request_throughput=len(done) / duration,
        output_throughput=output / duration, total_token_throughput=(prompt + output) / duration,
        ttft_ms=latency_stats([m.ttft_s for m in done]), tpot_ms=latency_stats(tpot),
        itl_ms=latency_stats([g for m in done for g in m.itl_s]), e2e_ms=latency_stats([m.e2e_s for m in done]))


def result_dict(r: ServeBenchResult) -> dict[str, Any]:
    """asdict, with an infinite rate written as "inf" (JSON has no infinity)."""
    d = asdict(r)
    if math.isinf(r.request_rate):
        d["request_rate"] = "inf"
    return d


def format_serve_table(r: ServeBenchResult) -> str:
    rows = [
        ("hardware (client)", r.hardware),
        ("base url", r.base_url),
        ("model", r.model),
        ("dataset", r.dataset),
        ("command", r.command),
        ("num prompts", str(r.num_prompts)),
        ("request rate (req/s)", "inf (all at once)" if math.isinf(r.request_rate) else f"{r.request_rate:g}"),
        ("max concurrency", "unlimited" if r.max_concurrency is None else str(r.max_concurrency)),
        ("completed / failed", f"{r.completed} / {r.failed}"),
        ("duration (s)", f"{r.duration_s:.2f}"),
        ("total prompt tokens", str(r.total_prompt_tokens)),
        ("total output tokens", str(r.total_output_tokens)),
        ("request throughput (req/s)", f"{r.request_throughput:.3f}"),
        ("output token throughput (tok/s)", f"{r.output_throughput:.1f}"),
        ("total token throughput (tok/s)", f"{r.total_token_throughput:.1f}"),
        ("prompt tokens from cache", f"{r.cached_fraction:.1%} ({r.total_cached_tokens})"),
    ]
    for name, s in (("TTFT", r.ttft_ms), ("TPOT", r.tpot_ms), ("ITL", r.itl_ms), ("E2E latency", r.e2e_ms)):
        rows.append((f"{name} mean / median / p99 (ms)", f"{s.mean:.2f} / {s.median:.2f} / {s.p99:.2f}"))
    width = max(len(k) for k, _ in rows)
    lines = [f"{k:<{width}}  {v}" for k, v in rows]
    if r.first_error:
        lines.append(f"first error: {r.first_error}")
    rule = "-" * min(100, max(len(line) for line in lines))
    return "\n".join([rule, *lines, rule])
