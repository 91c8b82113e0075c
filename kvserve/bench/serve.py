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

`--dataset multiturn` replays ShareGPT conversations: sessions (not requests) arrive as the
Poisson process and count against the concurrency cap, and a session sends its turns one
after another, each prompt holding the whole conversation so far: by default with the
server's own earlier replies (`--multiturn-history generated`, a real chat, whose prefix the
server computed before), or with the dataset's reference replies (`reference`). Every turn
is a request in the stats above; first and later turns' TTFT are also reported apart, since later turns
are the ones that can reuse the previous turn's KV.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import time
from pathlib import Path
from typing import Any

from kvserve.bench.datasets import (
    DEFAULT_RANDOM_LEN,
    BenchRequest,
    load_sharegpt,
    multiturn_sessions,
    prefix_requests,
    random_requests,
)
from kvserve.bench.serve_report import RequestTiming, ServeBenchResult, format_serve_table, result_dict, summarize

DEFAULT_PREFIX_LEN = 2048
DEFAULT_PREFIX_OUTPUT_LEN = 32
DEFAULT_SHAREGPT_PROMPT_LEN = 512
DEFAULT_MULTITURN_PROMPT_LEN = 2048
DEFAULT_MAX_TURNS = 6
# The server has no key unless started with --api-key; the client library insists on one.
PLACEHOLDER_API_KEY = "EMPTY"


# ---- command line -------------------------------------------------------------


def add_serve_bench_parser(bench_sub: Any) -> None:
    p = bench_sub.add_parser("serve", help="online serving load test against an OpenAI-compatible server")
    p.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="server address; /v1 is appended unless the URL already ends with it")
    p.add_argument("--dataset", default="sharegpt", choices=["sharegpt", "random", "prefix", "multiturn"],
                   help="multiturn: ShareGPT conversations sent turn by turn, each prompt the conversation so far")
    p.add_argument("--num-prompts", type=int, default=100,
                   help="requests to send; multiturn: sessions (conversations of up to --max-turns requests)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrival rate in requests/s, multiturn: sessions/s (default inf: all at once)")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="requests in flight at most, multiturn: sessions in flight (default: no cap)")
    p.add_argument("--seed", type=int, default=0, help="dataset selection and arrival times")
    p.add_argument("--input-len", type=int, default=None,
                   help=f"random: prompt tokens per request (default {DEFAULT_RANDOM_LEN})")
    p.add_argument("--output-len", type=int, default=None,
                   help=f"output tokens per request (random default {DEFAULT_RANDOM_LEN}; prefix default "
                        f"{DEFAULT_PREFIX_OUTPUT_LEN}; sharegpt, multiturn default: the reference reply's length)")
    p.add_argument("--prefix-len", type=int, default=DEFAULT_PREFIX_LEN, help="prefix: tokens of the shared prompt")
    p.add_argument("--max-prompt-len", type=int, default=None,
                   help=f"sharegpt: longest prompt kept (default {DEFAULT_SHAREGPT_PROMPT_LEN}); multiturn: a "
                        f"session ends before a turn whose prompt + output exceed it (default "
                        f"{DEFAULT_MULTITURN_PROMPT_LEN})")
    p.add_argument("--max-output-len", type=int, default=256,
                   help="sharegpt: longest completion kept; multiturn: cap on a turn's output")
    p.add_argument("--max-turns", type=int, default=DEFAULT_MAX_TURNS, help="multiturn: turns per session at most")
    p.add_argument("--system-prompts", type=int, default=0,
                   help="multiturn: K tenants' system prompts, session i's prompts start with number i %% K "
                        "(a multi-tenant service; default 0: none)")
    p.add_argument("--system-prompt-len", type=int, default=1024,
                   help="multiturn: tokens of each system prompt (default 1024)")
    p.add_argument("--turn-gap", type=float, default=0.0,
                   help="multiturn: seconds between a turn's end and the next turn's request (default 0)")
    p.add_argument("--multiturn-history", choices=["generated", "reference"], default="generated",
                   help="multiturn: the previous replies in a prompt are the server's own (as in a real chat: "
                        "their KV can be reused) or the dataset's reference replies (default generated)")
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
    if args.max_turns < 2:
        raise ValueError(f"--max-turns must be at least 2, got {args.max_turns}")
    if not 0 <= args.turn_gap < math.inf:
        raise ValueError(f"--turn-gap must be >= 0 seconds, got {args.turn_gap}")


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
        tokenizer = _load_tokenizer(args.tokenizer or root)
        sessions = build_sessions(args, tokenizer)
        start = time.perf_counter()
        metrics = await _issue_all(client, model, sessions, args, tokenizer)
        duration = time.perf_counter() - start
    finally:
        await client.close()
    return summarize(metrics, duration, args, model, not_sent=sum(map(len, sessions)) - len(metrics))


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
    max_prompt_len = DEFAULT_SHAREGPT_PROMPT_LEN if args.max_prompt_len is None else args.max_prompt_len
    reqs = load_sharegpt(tokenizer, args.num_prompts, max_prompt_len, args.max_output_len, seed=args.seed)
    if args.output_len is not None:
        for r in reqs:
            r.output_len = args.output_len
    return reqs


def build_sessions(args: argparse.Namespace, tokenizer: Any) -> list[list[BenchRequest]]:
    """The turns of each session; every dataset but multiturn has one-turn sessions, one per request."""
    if args.dataset != "multiturn":
        return [[r] for r in build_serve_requests(args, tokenizer)]
    max_prompt_len = DEFAULT_MULTITURN_PROMPT_LEN if args.max_prompt_len is None else args.max_prompt_len
    sessions = multiturn_sessions(tokenizer, args.num_prompts, args.max_turns, max_prompt_len,
                                  args.max_output_len, seed=args.seed, system_prompts=args.system_prompts,
                                  system_prompt_len=args.system_prompt_len)
    if args.output_len is not None:
        for r in (r for turns in sessions for r in turns):
            r.output_len = args.output_len
    return sessions


def arrival_gaps(n: int, rate: float, seed: int) -> list[float]:
    """Seconds to wait before each request: exponential gaps (a Poisson process), or none for inf."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    return [rng.expovariate(rate) for _ in range(n)]


async def _issue_all(client: Any, model: str, sessions: list[list[BenchRequest]],
                     args: argparse.Namespace, tokenizer: Any) -> list[RequestTiming]:
    """Timings of the turns sent, session by session; a failed turn ends its session."""
    from tqdm import tqdm

    # The cap gates sending, not arrival: a session waiting for a slot is already late,
    # so its queueing shows in its latency as it would for a real client.
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    bar = tqdm(total=sum(map(len, sessions)), desc="requests", unit="req")

    async def session(turns: list[BenchRequest]) -> list[RequestTiming]:
        timings: list[RequestTiming] = []
        async with limit if limit is not None else contextlib.nullcontext():
            sent: BenchRequest | None = None
            for k, req in enumerate(turns):
                if k and args.turn_gap > 0:
                    await asyncio.sleep(args.turn_gap)
                if sent is not None and args.multiturn_history == "generated":
                    req = _with_generated_history(timings[-1], sent, req, tokenizer)
                sent = req
                m = await send_request(client, model, req, args.cache_salt)
                m.turn = k
                timings.append(m)
                bar.update(1)
                if not m.ok:
                    break
        return timings

    tasks = []
    try:
        for turns, gap in zip(sessions, arrival_gaps(len(sessions), args.request_rate, args.seed)):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(session(turns)))
        return [m for timings in await asyncio.gather(*tasks) for m in timings]
    finally:
        for t in tasks:
            t.cancel()
        bar.close()


def _with_generated_history(prev: RequestTiming, prev_req: BenchRequest, req: BenchRequest,
                            tokenizer: Any) -> BenchRequest:
    """This turn with the previous reply as the server wrote it (a real chat's next prompt, whose
    prefix the server has computed before), in place of the reference reply."""
    reply = list(tokenizer([prev.text], add_special_tokens=False)["input_ids"][0])
    ids = list(prev_req.prompt_token_ids or []) + reply + list(req.turn_ids or [])
    return BenchRequest(req.prompt, len(ids), req.output_len, ids, turn_ids=req.turn_ids, user=req.user)


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
            stream_options={"include_usage": True}, extra_body=extra, **({"user": req.user} if req.user else {}))
        async with stream:
            async for chunk in stream:
                now = time.perf_counter()
                if chunk.choices:
                    m.text += chunk.choices[0].text or ""
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
