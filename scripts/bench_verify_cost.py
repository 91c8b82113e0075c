"""What a verify step of speculative decoding costs on a model: one stream decoding with k forced
drafts (k = 0 is a plain decode step) through the whole engine step, median over the run.

The drafts are the request's last token repeated, so on a random-weight model they are rejected
and every step emits one token: what is measured is the price of k more query rows, the number the
adaptive rule (spec_decode/adaptive.py) learns online, independent of how good the drafts are.
Where decode waits on memory (a 1-3B model) more rows should be nearly free; where the kernels
are bound by arithmetic (the 135M default model on a 2-core CPU) each costs a share of a step.

    .venv/bin/python scripts/bench_verify_cost.py [--model FILE] [--k 0 1 2 4] [--tokens 48] [--rounds 3]

k values alternate within each round, so a machine that slows down mid-run shifts them alike.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def step_times(llm, prompt: list[int], k: int, tokens: int) -> list[float]:
    from kvserve import SamplingParams

    eng = llm.engine
    eng.spec.propose = (lambda req, n: [req.all_token_ids[-1]] * k) if k else (lambda req, n: [])
    eng.add_request(None, prompt, SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True))
    times, first = [], True
    while eng.has_unfinished_requests():
        t = time.perf_counter()
        eng.step()
        if not first:  # the prefill
            times.append(time.perf_counter() - t)
        first = False
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF or HF directory (default: the embedded model)")
    ap.add_argument("--k", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--tokens", type=int, default=48, help="tokens decoded per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--engine-args", default="{}", help="more LLM keyword arguments (JSON)")
    args = ap.parse_args()

    from kvserve import LLM
    from kvserve.bench.table import cpu_model

    spec = {"method": "ngram", "num_speculative_tokens": max(max(args.k), 1), "adaptive": False,
            "disable_by_batch_size": 1 << 30}
    llm = LLM(model=args.model, enable_prefix_caching=False, speculative_config=spec, **json.loads(args.engine_args))
    prompt = list(range(100, 164))
    step_times(llm, prompt, 0, 8)  # warm-up
    per_k: dict[int, list[float]] = {k: [] for k in args.k}
    for _ in range(args.rounds):
        for k in args.k:
            per_k[k] += step_times(llm, prompt, k, args.tokens)
    base = statistics.median(per_k[args.k[0]])
    print(f"# {cpu_model()}; model {args.model or 'default'}; median engine step of one stream, {args.rounds} rounds "
          f"of {args.tokens} tokens")
    print("| k (drafts) | query rows | step (ms) | x the first | per extra row |")
    print("|---|---|---|---|---|")
    for k in args.k:
        med = statistics.median(per_k[k])
        extra = (med / base - 1) / k if k else 0.0
        print(f"| {k} | {k + 1} | {med * 1e3:.1f} | {med / base:.2f} | {extra:.2f} |")
    llm.close()


if __name__ == "__main__":
    main()
