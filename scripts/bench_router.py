"""The router benchmark in BENCHMARKS.md: every `kvserve router` policy over the same replicas
and the same multi-tenant, multi-turn workload, in one run.

    .venv/bin/python scripts/bench_router.py [--replicas 3] [--sessions 48] [--policies ...]

Starts N `kvserve serve` replicas of the embedded default model once (KV events on, each
pinned to a core, KV pools too small to hold every tenant's system prompt), then for each
policy: empties the replicas' caches, starts a router in front of them, runs
`kvserve bench serve --dataset multiturn --system-prompts K` against it (sessions are users
of K tenants, each holding a ShareGPT conversation turn by turn; the session id is the
OpenAI `user` field) and stops the router. Prints one table (cached-token share, TTFT p50 /
p99, throughput) and writes the JSON of each run to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kvserve.router.launch import stop_processes

KV = [sys.executable, "-m", "kvserve.cli"]
POLICIES = ["round_robin", "least_load", "session", "approx", "kv_aware"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{url} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    sys.exit(f"{url} not healthy after {timeout:.0f}s:\n{log.read_text()[-3000:]}")


def post(url: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def start(cmd: list[str], log: Path, cores: list[int] | None = None) -> subprocess.Popen:
    env = dict(os.environ)
    if cores is not None:
        env["OMP_NUM_THREADS"] = str(len(cores))
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env, start_new_session=True,
                            preexec_fn=(lambda: os.sched_setaffinity(0, cores)) if cores is not None else None)


def start_replicas(args: argparse.Namespace, out: Path) -> tuple[list[str], list[subprocess.Popen]]:
    cores = sorted(os.sched_getaffinity(0))
    urls, procs = [], []
    for i in range(args.replicas):
        port, ev = free_port(), free_port()
        cmd = [*KV, "serve", "--port", str(port), "--kv-events-endpoint", f"tcp://127.0.0.1:{ev}",
               "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{free_port()}", "--num-kv-blocks", str(args.kv_blocks),
               "--max-model-len", str(args.max_prompt_len + 64), *args.engine_args]
        procs.append(start(cmd, out / f"replica{i}.log", [cores[i % len(cores)]]))
        urls.append(f"http://127.0.0.1:{port}")
    for url, proc, i in zip(urls, procs, range(len(urls))):
        wait_healthy(url, proc, out / f"replica{i}.log")
        post(url + "/v1/completions", {"prompt": "warm-up", "max_tokens": 4, "cache_salt": "warm-up"})
    return urls, procs


def run_policy(policy: str, urls: list[str], args: argparse.Namespace, out: Path) -> dict:
    for url in urls:  # every policy starts from cold caches
        post(url + "/kv_cache/clear")
    port = free_port()
    router = start([*KV, "router", "--port", str(port), "--policy", policy,
                    *[a for u in urls for a in ("--replica", u)]], out / f"router-{policy}.log")
    try:
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, router, out / f"router-{policy}.log", timeout=120)
        result = out / f"{policy}.json"
        cmd = [*KV, "bench", "serve", "--base-url", base, "--dataset", "multiturn", "--seed", str(args.seed),
               "--num-prompts", str(args.sessions), "--system-prompts", str(args.tenants),
               "--system-prompt-len", str(args.system_prompt_len), "--max-turns", str(args.turns),
               "--max-prompt-len", str(args.max_prompt_len), "--max-output-len", str(args.output_len),
               "--output-len", str(args.output_len), "--max-concurrency", str(args.concurrency),
               "--output-json", str(result)]
        print(f"== {policy}: {' '.join(cmd[2:])}", flush=True)
        subprocess.run(cmd, check=True, stdout=(out / f"bench-{policy}.txt").open("w"), stderr=subprocess.STDOUT)
        return json.loads(result.read_text())
    finally:
        stop_processes([router], 30)


def table(results: dict[str, dict]) -> str:
    rows = ["| policy | cached share of prompt tokens | TTFT p50 (ms) | TTFT p99 (ms) | req/s | output tok/s | failed |",
            "|---|---|---|---|---|---|---|"]
    for policy, r in results.items():
        rows.append(f"| {policy} | {r['cached_fraction']:.1%} | {r['ttft_ms']['median']:.0f} | {r['ttft_ms']['p99']:.0f} "
                    f"| {r['request_throughput']:.2f} | {r['output_throughput']:.1f} | {r['failed']} |")
    return "\n".join(rows)


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        name = next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
        flags = next(line.split(":", 1)[1].split() for line in out.splitlines() if line.startswith("Flags"))
        isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
        return f"{name} ({'/'.join(isa) or 'no AVX2'}), {len(os.sched_getaffinity(0))} cores"
    except (OSError, StopIteration):
        return platform.processor()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--policies", nargs="+", default=POLICIES)
    p.add_argument("--tenants", type=int, default=8, help="system prompts")
    p.add_argument("--system-prompt-len", type=int, default=1024)
    p.add_argument("--sessions", type=int, default=48, help="users, each a ShareGPT conversation")
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--max-prompt-len", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=6, help="sessions in flight")
    p.add_argument("--kv-blocks", type=int, default=256, help="KV blocks per replica (16 tokens each)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results/router")
    p.add_argument("engine_args", nargs="*", help="more `kvserve serve` flags for the replicas (after --)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    urls, procs = start_replicas(args, out)
    try:
        results = {policy: run_policy(policy, urls, args, out) for policy in args.policies}
    finally:
        stop_processes(procs, 30)
    print(f"\n{cpu_model()}; {args.replicas} replicas of the default model, {args.kv_blocks} KV blocks each; "
          f"{args.sessions} sessions of {args.tenants} tenants ({args.system_prompt_len}-token system prompts), "
          f"{args.turns} turns, {args.output_len} output tokens, {args.concurrency} sessions in flight\n")
    print(table(results))
    (out / "summary.md").write_text(table(results) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
