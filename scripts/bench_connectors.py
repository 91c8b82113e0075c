"""The KV connectors' paths, timed offline on the default model (issue 33: before and after moving
the connectors' worker halves into the ranks). Public API only, so one copy of this script times
any version of kvserve (`PYTHONPATH=OTHER_CHECKOUT` picks the version):

- tiers, host RAM: 6 prompts of --prompt-len tokens through a pool that holds about two of them,
  with a host-RAM tier; then each again: TTFT of the second round, whose prompts come back from RAM;
- tiers, disk: the same with a disk tier only (the second round waits for the disk prefetch);
- P/D: a prefill engine and a decode engine in this process (uni executors, shared-memory
  transport); each prompt is prefilled there, fetched here, and decoded for --decode-tokens tokens:
  decode TTFT (the fetch included) and ITL.

Each number is the median over the prompts. Prints one JSON line per measurement and a table.
    .venv/bin/python scripts/bench_connectors.py [--prompt-len 1024] [--decode-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time

from kvserve import LLM, SamplingParams

BLOCK = 16
KEY = "bench-connectors-deployment-key"


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(n)]


def _ttft(out) -> float:
    return out.metrics.first_token_time - out.metrics.arrival_time


def _engine(**kw) -> LLM:
    return LLM(model=None, block_size=BLOCK, **kw)


def tiers(prompts: list[list[int]], kind: str) -> dict:
    pool = (2 * len(prompts[0]) // BLOCK) + 8
    with tempfile.TemporaryDirectory() as disk:
        extra = {"kv_offload_cpu": "512MiB"} if kind == "cpu" else {"kv_offload_disk": disk}
        llm = _engine(num_kv_blocks=pool, **extra)
        try:
            one = SamplingParams(max_tokens=1, temperature=0)
            cold = [_ttft(llm.generate([{"prompt_token_ids": p}], one, use_tqdm=False)[0]) for p in prompts]
            warm, cached = [], []
            for p in prompts:
                out = llm.generate([{"prompt_token_ids": p}], one, use_tqdm=False)[0]
                warm.append(_ttft(out))
                cached.append(out.num_cached_tokens_by_tier.get(kind, 0))
        finally:
            llm.close()
    return {"bench": f"tiers-{kind}", "ttft_cold_ms": 1000 * statistics.median(cold),
            "ttft_from_tier_ms": 1000 * statistics.median(warm), "tokens_from_tier": statistics.median(cached)}


def pd(prompts: list[list[int]], decode_tokens: int) -> dict:
    cfg = {"kv_connector_extra_config": {"auth_key": KEY}}
    p = _engine(kv_cache_memory="512MiB", kv_role="prefill", kv_transfer_config=cfg)
    d = _engine(kv_cache_memory="512MiB", kv_role="decode", kv_transfer_config=cfg)
    ttft, itl, moved = [], [], []
    try:
        send = SamplingParams(max_tokens=1, temperature=0, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
        for prompt in prompts:
            t = p.generate([{"prompt_token_ids": prompt}], send, use_tqdm=False)[0].kv_transfer_params
            while p.engine.has_unfinished_requests():  # the blocks go to the sender
                p.engine.step()
            params = SamplingParams(max_tokens=decode_tokens, temperature=0, ignore_eos=True,
                                    extra_args={"kv_transfer_params": t})
            out = d.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
            m = out.metrics
            ttft.append(m.first_token_time - m.arrival_time)
            itl.append((m.last_token_time - m.first_token_time) / (decode_tokens - 1))
            moved.append(out.num_cached_tokens_by_tier.get("kv_transfer", 0))
    finally:
        p.close()
        d.close()
    return {"bench": "pd", "decode_ttft_ms": 1000 * statistics.median(ttft), "itl_ms": 1000 * statistics.median(itl),
            "tokens_transferred": statistics.median(moved)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--decode-tokens", type=int, default=64)
    args = ap.parse_args()
    prompts = _prompts(args.prompts, args.prompt_len, seed=1)
    start = time.time()
    rows = [tiers(prompts, "cpu"), tiers(prompts, "disk"), pd(prompts, args.decode_tokens)]
    for r in rows:
        print(json.dumps(r))
    print(f"\n{'bench':<12} {'measure':<20} {'value':>10}")
    for r in rows:
        for k, v in r.items():
            if k != "bench":
                print(f"{r['bench']:<12} {k:<20} {v:>10.1f}")
    print(f"({time.time() - start:.0f} s)")


if __name__ == "__main__":
    main()
