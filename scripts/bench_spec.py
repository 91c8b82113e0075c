"""Speculative decoding (issue 35): what n-gram drafts buy, and what they cost, on the default model.

1. single stream, copy-heavy set (kvserve/bench/spec_prompts.py, 50 chats): each prompt alone,
   greedy, up to --max-tokens; without speculation and with --spec, alternating prompt by prompt
   (two engines in this process). Output tok/s = all output tokens / the sum of request times
   (arrival to last token); decode tok/s = tokens after the first / time after the first token.
   The greedy outputs are checked equal.
2. the same on --sharegpt ShareGPT first turns (chat);
3. concurrency: --batch ShareGPT prompts at --max-num-seqs, --batch-tokens each (ignore_eos), output
   tok/s without speculation and with it (adaptive k turns it off at large batches).

    .venv/bin/python scripts/bench_spec.py [--max-tokens 128] [--sharegpt 50] [--batch 64]
        [--spec '{"method": "ngram", "num_speculative_tokens": 4}']
"""

from __future__ import annotations

import argparse
import json
import time

from kvserve import LLM, SamplingParams
from kvserve.bench.spec_prompts import copy_heavy_prompts


def _spec_stats(llm: LLM) -> dict[str, int]:
    return {k: v for k, v in llm.engine.stats().items() if k.startswith("spec_decode_num_")}


def single_stream(engines: dict[str, LLM], chats: list, max_tokens: int) -> dict[str, dict[str, float]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    acc = {name: {"tokens": 0, "seconds": 0.0, "decode_tokens": 0, "decode_seconds": 0.0} for name in engines}
    outputs: dict[str, list[list[int]]] = {name: [] for name in engines}
    before = {name: _spec_stats(llm) for name, llm in engines.items()}
    for chat in chats:
        for name, llm in engines.items():  # alternate: drift in the machine's speed hits both
            out = llm.chat(chat, params, use_tqdm=False)[0]
            m, toks = out.metrics, out.outputs[0].token_ids
            a = acc[name]
            a["tokens"] += len(toks)
            a["seconds"] += m.last_token_time - m.arrival_time
            a["decode_tokens"] += len(toks) - 1
            a["decode_seconds"] += m.last_token_time - m.first_token_time
            outputs[name].append(list(toks))
    names = list(engines)
    same = sum(x == y for x, y in zip(outputs[names[0]], outputs[names[1]]))
    res = {}
    for name, a in acc.items():
        after = _spec_stats(engines[name])
        drafted = after.get("spec_decode_num_draft_tokens", 0) - before[name].get("spec_decode_num_draft_tokens", 0)
        accepted = (after.get("spec_decode_num_accepted_tokens", 0)
                    - before[name].get("spec_decode_num_accepted_tokens", 0))
        res[name] = {"output_tok_s": a["tokens"] / a["seconds"], "decode_tok_s": a["decode_tokens"] / a["decode_seconds"],
                     "tokens": a["tokens"], "drafted": drafted, "accepted": accepted,
                     "acceptance": accepted / drafted if drafted else 0.0}
    res["outputs_equal"] = f"{same}/{len(chats)}"
    return res


def batch_throughput(spec: dict, n: int, max_num_seqs: int, tokens: int) -> dict[str, float]:
    from kvserve.bench.datasets import load_sharegpt

    out = {}
    for name, cfg in (("off", None), ("on", spec), ("off again", None), ("on again", spec)):
        llm = LLM(max_num_seqs=max_num_seqs, speculative_config=cfg)
        reqs = load_sharegpt(llm.get_tokenizer(), n, max_output_len=tokens)
        params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        res = llm.generate([r.prompt_token_ids for r in reqs], params, use_tqdm=False)
        out[name] = sum(len(o.outputs[0].token_ids) for o in res) / (time.perf_counter() - start)
        llm.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--spec", default='{"method": "ngram", "num_speculative_tokens": 4}')
    ap.add_argument("--sharegpt", type=int, default=50, help="ShareGPT prompts for the single stream (0: skip)")
    ap.add_argument("--batch", type=int, default=64, help="ShareGPT prompts for the concurrency run (0: skip)")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--batch-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=50, help="copy-heavy prompts (of 50)")
    args = ap.parse_args()
    spec = json.loads(args.spec)
    engines = {"off": LLM(), "on": LLM(speculative_config=spec)}
    chats = copy_heavy_prompts()[:args.prompts]
    print("copy-heavy, single stream:", json.dumps(single_stream(engines, chats, args.max_tokens)), flush=True)
    if args.sharegpt:
        from kvserve.bench.datasets import load_sharegpt

        reqs = load_sharegpt(engines["off"].get_tokenizer(), args.sharegpt)
        sg = [[{"role": "user", "content": r.prompt}] for r in reqs]
        print("ShareGPT, single stream:", json.dumps(single_stream(engines, sg, args.max_tokens)), flush=True)
    for llm in engines.values():
        llm.close()
    if args.batch:
        print(f"ShareGPT x{args.batch} at max_num_seqs {args.max_num_seqs}, output tok/s:",
              json.dumps(batch_throughput(spec, args.batch, args.max_num_seqs, args.batch_tokens)), flush=True)


if __name__ == "__main__":
    main()
