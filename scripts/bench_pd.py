"""Prefill/decode disaggregation benchmark (issue 14): long RAG prompts arriving while chat
streams decode, on the same cores, in three configurations behind `kvserve router`:

  aggregated     --launch 2: two plain replicas, a share of the cores each (kv_aware routing)
  disaggregated  --launch-pd 1 1 --pd-decision always: a prefill engine and a decode engine
  conditional    --launch-pd 1 1 --pd-decision conditional: the router decides per request

Workload: --chat-streams clients each send chat-sized requests (random token ids, ignore_eos)
back to back for --duration seconds; meanwhile a RAG prompt of --rag-min..--rag-max tokens
arrives every --rag-interval seconds. Reported per configuration: TTFT p50 / p99 of chat and
of RAG requests, ITL p50 / p99 and TPOT of chat requests, output throughput.

    .venv/bin/python scripts/bench_pd.py [--model PATH] [--duration 120] [--out results.json]
        [-- extra engine flags]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kvserve.bench.datasets import random_requests
from kvserve.bench.serve import send_request
from kvserve.router.launch import free_ports

CONFIGS = {
    "aggregated": ["--launch", "2"],
    "disaggregated": ["--launch-pd", "1", "1", "--pd-decision", "always"],
    "conditional": ["--launch-pd", "1", "1", "--pd-decision", "conditional"],
}


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] * 1000


def start_router(config: str, model: str | None, engine_args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_ports(1)[0]
    args = [sys.executable, "-m", "kvserve.cli", "router", "--port", str(port), *CONFIGS[config], "--",
            *([model] if model else []), *engine_args]
    proc = subprocess.Popen(args, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited: {log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                if r.status == 200:
                    return proc, base
        except OSError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"router not healthy: {log.read_text()[-3000:]}")


async def workload(base: str, model: str, tokenizer, args: argparse.Namespace) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="EMPTY", timeout=600)
    rng = random.Random(args.seed)
    chat_pool = random_requests(tokenizer, 256, args.chat_prompt_len, args.chat_output_len, seed=args.seed)
    n_rag = max(1, int(args.duration // args.rag_interval))
    rag = [random_requests(tokenizer, 1, rng.randint(args.rag_min, args.rag_max), args.rag_output_len,
                           seed=args.seed + 1 + i)[0] for i in range(n_rag)]
    await send_request(client, model, chat_pool[0], None)  # warm-up
    chats, rags = [], []
    start = time.perf_counter()
    stop_at = start + args.duration

    async def stream(i: int) -> None:
        k = i
        while time.perf_counter() < stop_at:
            chats.append(await send_request(client, model, chat_pool[k % len(chat_pool)], None))
            k += args.chat_streams

    async def one_rag(i: int, req) -> None:  # each arrives on time, whether or not the last has finished
        await asyncio.sleep(max(0.0, start + (i + 0.5) * args.rag_interval - time.perf_counter()))
        rags.append(await send_request(client, model, req, None))

    async def rag_arrivals() -> None:
        await asyncio.gather(*(one_rag(i, req) for i, req in enumerate(rag)))

    await asyncio.gather(*(stream(i) for i in range(args.chat_streams)), rag_arrivals())
    duration = time.perf_counter() - start
    ok_chat = [m for m in chats if m.ok]
    ok_rag = [m for m in rags if m.ok]
    itl = [x for m in ok_chat for x in m.itl_s]
    tpot = [(m.e2e_s - m.ttft_s) / (m.completion_tokens - 1) for m in ok_chat if m.completion_tokens > 1]
    out_tokens = sum(m.completion_tokens for m in ok_chat + ok_rag)
    errors = [m.error for m in chats + rags if not m.ok]
    return {
        "chat_requests": len(ok_chat), "rag_requests": len(ok_rag), "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "chat_ttft_p50_ms": pct([m.ttft_s for m in ok_chat], 0.5), "chat_ttft_p99_ms": pct([m.ttft_s for m in ok_chat], 0.99),
        "rag_ttft_p50_ms": pct([m.ttft_s for m in ok_rag], 0.5), "rag_ttft_p99_ms": pct([m.ttft_s for m in ok_rag], 0.99),
        "itl_p50_ms": pct(itl, 0.5), "itl_p99_ms": pct(itl, 0.99),
        "tpot_mean_ms": statistics.fmean(tpot) * 1000 if tpot else float("nan"),
        "output_tok_s": out_tokens / duration, "duration_s": duration,
    }


def router_decisions(base: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "kvserve_router:pd_decisions_total":
                out[f"{s.labels['decision']}/{s.labels['reason']}"] = s.value
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model path (default: the embedded default model)")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--duration", type=float, default=120.0)
    p.add_argument("--chat-streams", type=int, default=16)
    p.add_argument("--chat-prompt-len", type=int, default=128)
    p.add_argument("--chat-output-len", type=int, default=64)
    p.add_argument("--rag-min", type=int, default=2048)
    p.add_argument("--rag-max", type=int, default=4096)
    p.add_argument("--rag-interval", type=float, default=20.0)
    p.add_argument("--rag-output-len", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("engine_args", nargs=argparse.REMAINDER)
    args = p.parse_args()
    engine_args = [a for a in args.engine_args if a != "--"]
    from kvserve.models.loader import default_model_path, open_checkpoint

    model_path = args.model or str(default_model_path())
    tokenizer = open_checkpoint(model_path).tokenizer()
    results = {}
    for config in args.configs.split(","):
        log = Path(f"/tmp/bench_pd_{config}.log")
        proc, base = start_router(config, args.model, engine_args, log)
        try:
            with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as r:
                served = json.loads(r.read())["data"][0]["id"]
            res = asyncio.run(workload(base, served, tokenizer, args))
            res["decisions"] = router_decisions(base)
        finally:
            proc.terminate()
            proc.wait(60)
        results[config] = res
        print(config, json.dumps(res), flush=True)
    print("\n| config | chat TTFT p50 / p99 ms | RAG TTFT p50 / p99 ms | ITL p50 / p99 ms | TPOT ms | output tok/s |")
    print("|---|---|---|---|---|---|")
    for c, r in results.items():
        print(f"| {c} | {r['chat_ttft_p50_ms']:.0f} / {r['chat_ttft_p99_ms']:.0f} | {r['rag_ttft_p50_ms']:.0f} / "
              f"{r['rag_ttft_p99_ms']:.0f} | {r['itl_p50_ms']:.0f} / {r['itl_p99_ms']:.0f} | {r['tpot_mean_ms']:.0f} | "
              f"{r['output_tok_s']:.1f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
