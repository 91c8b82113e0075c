"""Decode speed quiet and beside busy processes (issue 32): each configuration runs in its own
process (the OpenMP runtime reads its wait policy when it loads), rounds interleaved, medians printed.

  .venv/bin/python scripts/bench_contention.py --rounds 3 --busy 2 \
      --config default= --config spin0=GOMP_SPINCOUNT=0 --config t1=--cpu-threads=1

A config is NAME=[ENV=VALUE,...][,--cpu-threads=N][,--llama]; --llama runs llama.cpp
(llama_cpp in --llama-python) on --gguf instead of kvserve.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time
args = json.loads(sys.argv[1])
if args["llama"]:
    from llama_cpp import Llama
    llm = Llama(args["gguf"], n_ctx=512, n_threads=args["threads"] or 2, verbose=False)
    llm("Hello", max_tokens=4)
    def run():
        t = time.perf_counter(); out = llm(args["prompt"], max_tokens=args["tokens"], temperature=0.0)
        return out["usage"]["completion_tokens"], time.perf_counter() - t
else:
    from kvserve import LLM, SamplingParams
    kw = {"cpu_threads": args["threads"]} if args["threads"] else {}
    llm = LLM(args["model"], **kw)
    sp = SamplingParams(max_tokens=args["tokens"], temperature=0.0, ignore_eos=True)
    llm.generate([args["prompt"]], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    def run():
        t = time.perf_counter(); out = llm.generate([args["prompt"]], sp, use_tqdm=False)
        return len(out[0].outputs[0].token_ids), time.perf_counter() - t
if args["busy"]:
    sys.stdout.write("ready\n"); sys.stdout.flush(); sys.stdin.readline()  # parent starts the busy loops
n, dt = run()
print(json.dumps({"tokens": n, "seconds": dt}))
"""


def busy(cores: set[int]) -> None:
    os.sched_setaffinity(0, cores)
    while True:
        pass


def measure(cfg: dict, args: argparse.Namespace, nbusy: int) -> float:
    """Decode tokens/s of one run (a fresh process), with nbusy busy loops on the same cores while it decodes."""
    env = {**os.environ, **cfg["env"]}
    child = {"llama": cfg["llama"], "gguf": args.gguf, "threads": cfg["threads"], "model": args.model,
             "prompt": "The history of the printing press", "tokens": args.tokens, "busy": nbusy}
    py = args.llama_python if cfg["llama"] else sys.executable
    p = subprocess.Popen([py, "-c", CHILD, json.dumps(child)], env=env, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    loops = []
    if nbusy:
        assert p.stdout.readline().strip() == "ready"
        cores = os.sched_getaffinity(0)
        loops = [multiprocessing.Process(target=busy, args=(cores,), daemon=True) for _ in range(nbusy)]
        for b in loops:
            b.start()
        time.sleep(0.2)
        p.stdin.write("\n")
        p.stdin.flush()
    try:
        out, _ = p.communicate(timeout=args.timeout)
        r = json.loads(out.strip().splitlines()[-1])
        return r["tokens"] / r["seconds"]
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        return args.tokens / args.timeout  # an upper bound: it did not finish
    finally:
        for b in loops:
            b.kill()
            b.join()


def parse_config(text: str) -> tuple[str, dict]:
    name, _, rest = text.partition("=")
    cfg = {"env": {}, "threads": None, "llama": False}
    for part in filter(None, rest.split(",")):
        if part.startswith("--cpu-threads="):
            cfg["threads"] = int(part.split("=")[1])
        elif part == "--llama":
            cfg["llama"] = True
        else:
            k, _, v = part.partition("=")
            cfg["env"][k] = v
    return name, cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", action="append", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--busy", type=int, default=2, help="busy loops beside the contended runs")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--model", default=None)
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--llama-python", default="/work/llamavenv/bin/python")
    ap.add_argument("--timeout", type=float, default=60)
    ap.add_argument("--quiet-only", action="store_true")
    args = ap.parse_args()
    configs = dict(parse_config(c) for c in args.config)
    loads = [0] if args.quiet_only else [0, args.busy]
    res: dict[tuple[str, int], list[float]] = {}
    for r in range(args.rounds):
        for nbusy in loads:
            for name, cfg in configs.items():
                tps = measure(cfg, args, nbusy)
                res.setdefault((name, nbusy), []).append(tps)
                print(f"round {r} {name:12s} busy={nbusy} {tps:7.1f} tok/s  (load {os.getloadavg()[0]:.2f})",
                      flush=True)
    print(f"\n{platform.processor() or platform.machine()}, {len(os.sched_getaffinity(0))} cores, "
          f"{args.tokens} tokens, medians of {args.rounds}")
    print(f"{'config':12s} {'quiet tok/s':>12s} " + ("" if args.quiet_only else f"{'busy tok/s':>11s} {'ratio':>6s}"))
    for name in configs:
        q = statistics.median(res[(name, 0)])
        line = f"{name:12s} {q:12.1f} "
        if not args.quiet_only:
            b = statistics.median(res[(name, args.busy)])
            line += f"{b:11.1f} {b / q:6.2f}"
        print(line)


if __name__ == "__main__":
    main()
