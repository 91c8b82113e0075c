"""Non-prefix KV reuse (CacheBlend) on RAG prompts: TTFT and answer quality against a full prefill.

Workload (issue 15): a pool of chunks of ~CHUNK tokens cut from ShareGPT text; each request takes
6 of them in shuffled order between a fixed system prompt and a question (a ShareGPT user turn):
    system SEP chunk SEP chunk ... SEP question
Every configuration runs on a fresh engine in this process, one request at a time. The pool is
warmed first (warm-up requests that use every chunk once, in other orders, not measured), as a
RAG service whose documents were seen before.

Configurations: full prefill (no prefix caching), prefix caching only, naive reuse (blending at a
0% recompute ratio), blending at 5/15/30/100%, and 15% with each chunk's first 4 tokens recomputed
as well (EPIC).

Reported per configuration:
- TTFT p50 / mean (engine metrics: first token time - arrival) of the measured requests;
- KL(full || config) of the next-token distributions over a 32-token answer, teacher-forced on the
  full prefill's greedy answer: the prompt plus the answer's first k tokens, for k = 0..31, each a
  one-token request with the top 1000 logprobs. The reference is a plain engine with prefix
  caching (exact K/V). The KL is taken over the reference's top 1000 tokens plus one bucket for
  the rest of the vocabulary (a lower bound of the full KL; the top 1000 hold nearly all the mass
  on these answers); a token missing from the configuration's top list is given that list's
  smallest logprob;
- greedy agreement: the configuration's own greedy answer (32 tokens) against the reference's, as
  the share of positions equal before the first difference, and the share of answers equal;
- the blend's measured check-layer deviation (mean relative K/V deviation), for the quality guard.

    python scripts/bench_blend.py --requests 8 --out blend.json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time

from kvserve import LLM, SamplingParams
from kvserve.bench.datasets import sharegpt_conversations
from kvserve.blend.chunks import make_spec
from kvserve.config import BLEND_SEPARATOR

SYSTEM = "You answer the question from the documents below. Be precise and brief."
LOGPROBS = 1000  # top tokens per position compared (the engines get max_logprobs=LOGPROBS)
ANSWER = 32


def build_pool(tok, num: int, chunk_tokens: int, seed: int) -> tuple[list[str], list[str]]:
    """`num` chunks of about chunk_tokens tokens (ShareGPT turns, cut) and short user questions."""
    chunks: list[str] = []
    questions: list[str] = []
    buf = ""
    for turns in sharegpt_conversations("eval"):
        q = turns[0].strip()
        if 5 <= len(q.split()) <= 40 and BLEND_SEPARATOR.strip() not in q and "\n" not in q:
            questions.append(q)
        for t in turns:
            if BLEND_SEPARATOR.strip() in t:
                continue
            buf = (buf + " " + t.strip()).strip()
            ids = tok(buf, add_special_tokens=False)["input_ids"]
            if len(ids) >= chunk_tokens:
                chunks.append(tok.decode(ids[:chunk_tokens]).strip())
                buf = ""
        if len(chunks) >= num and len(questions) >= 200:
            break
    rng = random.Random(seed)
    rng.shuffle(questions)
    return chunks[:num], questions


def requests(pool: list[str], questions: list[str], n: int, k: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        docs = rng.sample(pool, k)
        out.append(SYSTEM + BLEND_SEPARATOR + BLEND_SEPARATOR.join(docs) + BLEND_SEPARATOR
                   + f"Question: {questions[i % len(questions)]}\nAnswer:")
    return out


def warmups(pool: list[str], k: int, seed: int) -> list[str]:
    """Every chunk of the pool once, k per prompt, in an order the measured requests do not use."""
    rng = random.Random(seed + 1)
    order = list(pool)
    rng.shuffle(order)
    return [SYSTEM + BLEND_SEPARATOR + BLEND_SEPARATOR.join(order[i:i + k]) + BLEND_SEPARATOR + "Question: ?"
            for i in range(0, len(order), k)]


CONFIGS = {
    "full prefill": dict(enable_prefix_caching=False),
    "prefix caching": {},
    "naive reuse (0%)": dict(enable_blending=True, blend_recompute_ratio=0.0),
    "blend 5%": dict(enable_blending=True, blend_recompute_ratio=0.05),
    "blend 15%": dict(enable_blending=True, blend_recompute_ratio=0.15),
    "blend 15% + 4 first tokens": dict(enable_blending=True, blend_recompute_ratio=0.15,
                                       blend_recompute_chunk_start=4),
    "blend 30%": dict(enable_blending=True, blend_recompute_ratio=0.30),
    "blend 100%": dict(enable_blending=True, blend_recompute_ratio=1.0),
}


def ttft(out) -> float:
    m = out.metrics
    return m.first_token_time - m.arrival_time


def top(out) -> dict[int, float]:
    return {tid: lp.logprob for tid, lp in out.outputs[0].logprobs[0].items()}


def kl(ref: dict[int, float], got: dict[int, float]) -> float:
    """KL(ref || got) over the reference's top tokens plus one bucket for the rest of the vocabulary:
    a lower bound of the full-vocabulary KL, exact as the lists grow. A token missing from `got`'s
    list takes that list's smallest logprob."""
    floor = min(got.values())
    p = [math.exp(v) for v in ref.values()]
    q = [math.exp(got.get(t, floor)) for t in ref]
    p_rest, q_rest = max(1.0 - sum(p), 0.0), max(1.0 - sum(q), 1e-12)
    out = sum(a * math.log(a / b) for a, b in zip(p, q) if a > 0)
    return out + (p_rest * math.log(p_rest / q_rest) if p_rest > 0 else 0.0)


def agreement(a: list[int], b: list[int]) -> float:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n / max(len(a), 1)


def run_config(name: str, kw: dict, args, prompts: list[str], warm: list[str], ref: list[dict] | None) -> dict:
    llm = LLM(args.model, kv_cache_memory=args.kv_cache_memory, max_logprobs=LOGPROBS, **kw,
              **({"blend_max_deviation": args.max_deviation} if kw.get("enable_blending") else {}))
    tok = llm.engine.tokenizer
    salt = name
    blending = kw.get("enable_blending", False)
    for w in warm:  # warm the chunks (and the system prompt)
        llm.generate({"prompt": w, "cache_salt": salt}, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    res: dict = {"config": name, "ttft_s": [], "answers": [], "kl": [], "deviation": []}
    conn = getattr(llm.engine, "blend", None)
    for i, p in enumerate(prompts):
        ids = tok(p)["input_ids"]
        extra = {"blend": make_spec(tok, p, ids, BLEND_SEPARATOR)} if blending else None
        params = SamplingParams(temperature=0, max_tokens=ANSWER, extra_args=extra)
        if conn is not None:
            conn.recent.clear()
        out = llm.generate({"prompt_token_ids": ids, "cache_salt": salt}, params, use_tqdm=False)[0]
        res["ttft_s"].append(ttft(out))
        res["answers"].append(out.outputs[0].token_ids)
        if conn is not None:
            res["deviation"] += [r.deviation for r in conn.recent if r.deviation is not None]
        if ref is None:
            continue
        answer = ref[i]["answer"]
        kls = []
        for k in range(len(answer)):
            q = llm.generate({"prompt_token_ids": ids + answer[:k], "cache_salt": salt},
                             SamplingParams(temperature=0, max_tokens=1, logprobs=LOGPROBS, extra_args=extra),
                             use_tqdm=False)[0]
            kls.append(kl(ref[i]["dists"][k], top(q)))
        res["kl"].append(statistics.fmean(kls))
    res["stats"] = {k: v for k, v in llm.engine.stats().items() if k.startswith("blend_")}
    return res


def reference(args, prompts: list[str], warm: list[str]) -> list[dict]:
    """The full prefill's greedy answers and next-token distributions along them (prefix caching on:
    the K/V are exact)."""
    llm = LLM(args.model, kv_cache_memory=args.kv_cache_memory, max_logprobs=LOGPROBS)
    tok = llm.engine.tokenizer
    out = []
    for p in prompts:
        ids = tok(p)["input_ids"]
        answer = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=ANSWER),
                              use_tqdm=False)[0].outputs[0].token_ids
        dists = [top(llm.generate({"prompt_token_ids": ids + answer[:k]},
                                  SamplingParams(temperature=0, max_tokens=1, logprobs=LOGPROBS), use_tqdm=False)[0])
                 for k in range(len(answer))]
        out.append({"answer": answer, "dists": dists})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--pool", type=int, default=50)
    ap.add_argument("--chunks", type=int, default=6)
    ap.add_argument("--chunk-tokens", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-deviation", type=float, default=1e9,
                    help="the quality guard for every blend configuration (default: off, to measure)")
    ap.add_argument("--configs", nargs="*", default=list(CONFIGS))
    ap.add_argument("--kv-cache-memory", default="6GiB", help="room for the whole pool and every request's blocks")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    probe = LLM(args.model, num_kv_blocks=64)
    tok = probe.engine.tokenizer
    del probe
    pool, questions = build_pool(tok, args.pool, args.chunk_tokens, args.seed)
    prompts = requests(pool, questions, args.requests, args.chunks, args.seed)
    warm = warmups(pool, args.chunks, args.seed)
    print(f"{len(pool)} chunks of {args.chunk_tokens} tokens, {len(prompts)} requests of "
          f"{statistics.fmean(len(tok(p)['input_ids']) for p in prompts):.0f} tokens", flush=True)
    t = time.time()
    ref = reference(args, prompts, warm)
    print(f"reference: {time.time() - t:.0f} s", flush=True)
    results = []
    full_ttft = None
    for name in args.configs:
        t = time.time()
        # the full prefill is the reference itself (KL 0): its TTFT is what is measured
        r = run_config(name, CONFIGS[name], args, prompts, warm, None if name == "full prefill" else ref)
        agree = [agreement(a, x["answer"]) for a, x in zip(r["answers"], ref)]
        row = {"config": name, "ttft_p50_s": statistics.median(r["ttft_s"]), "ttft_mean_s": statistics.fmean(r["ttft_s"]),
               "kl_mean": statistics.fmean(r["kl"]) if r["kl"] else 0.0, "agreement_prefix": statistics.fmean(agree),
               "answers_equal": sum(a == 1.0 for a in agree) / len(agree),
               "deviation_mean": statistics.fmean(r["deviation"]) if r["deviation"] else None,
               "deviation_max": max(r["deviation"]) if r["deviation"] else None, "stats": r["stats"]}
        if name == "full prefill":
            full_ttft = row["ttft_p50_s"]
        if full_ttft:
            row["ttft_vs_full"] = row["ttft_p50_s"] / full_ttft
        results.append(row)
        print(json.dumps(row), f"({time.time() - t:.0f} s)", flush=True)
    naive = next((r["kl_mean"] for r in results if r["config"].startswith("naive")), None)
    print("\n| configuration | TTFT p50 | vs full | KL vs full | KL vs naive | greedy prefix agreement | answers equal |"
          " deviation mean / max |\n|---|---|---|---|---|---|---|---|")
    for r in results:
        dev = f"{r['deviation_mean']:.3f} / {r['deviation_max']:.3f}" if r["deviation_mean"] is not None else "-"
        rel = f"{r['kl_mean'] / naive:.2f}x" if naive else "-"
        print(f"| {r['config']} | {r['ttft_p50_s']:.2f} s | {r.get('ttft_vs_full', float('nan')):.2f}x | "
              f"{r['kl_mean']:.4f} | {rel} | {r['agreement_prefix']:.2f} | {r['answers_equal']:.2f} | {dev} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
