"""Blending TTFT on the default model through the public API (issue 33 before/after): 6 chunks of
~400 tokens, each seen once (warm-up), then 6 requests of the chunks in shuffled order between a
system prompt and a question, at a 15% recompute ratio; TTFT median and a full prefill's.

    .venv/bin/python scripts/bench_blend_ttft.py [MAX_NUM_BATCHED_TOKENS]   (default: sized at start)"""
import json
import random
import statistics
import sys

from kvserve import LLM, SamplingParams

WORDS = ("cache block token layer attention prefix model batch request server memory disk page value key "
         "query chunk engine step decode prefill router replica tier host network store index").split()
rng = random.Random(0)
chunks = [" ".join(rng.choice(WORDS) for _ in range(380)) + "." for _ in range(6)]
SEP = " # # "


def prompt(order, q):
    return "Answer from the notes." + SEP + SEP.join(chunks[i] for i in order) + SEP + f"Question {q}: which word?"


def ttft(o):
    return o.metrics.first_token_time - o.metrics.arrival_time


budget = {"max_num_batched_tokens": int(sys.argv[1])} if len(sys.argv) > 1 else {}
params = SamplingParams(max_tokens=1, temperature=0)
res, budgets = {}, {}
for name, kw in [("blend 15%", dict(enable_blending=True, blend_recompute_ratio=0.15)),
                 ("full prefill", dict(enable_prefix_caching=False))]:
    llm = LLM(kv_cache_memory="2GiB", **budget, **kw)
    for i in range(6):  # each chunk once, in other company
        llm.generate(prompt([i], f"w{i}"), params, use_tqdm=False)
    times = []
    for q in range(6):
        order = list(range(6))
        random.Random(q).shuffle(order)
        times.append(ttft(llm.generate(prompt(order, q), params, use_tqdm=False)[0]))
    res[name] = statistics.median(times) * 1e3
    budgets[name + " max_num_batched_tokens"] = llm.engine.stats()["max_num_batched_tokens"]
    llm.close()
print(json.dumps({"kvserve": __import__("kvserve").__file__, **{k + " ttft_ms": v for k, v in res.items()}, **budgets}))
