"""Speculative decoding (issue 35): what n-gram drafts buy, and what they cost, on the default model.

1. single stream, copy-heavy set (kvserve/bench/spec_prompts.py, 50 chats): each prompt alone,
   greedy, up to --max-tokens; without speculation and with --spec, alternating prompt by prompt
   (two engines in this process). Output tok/s = all output tokens / the sum of request times
   (arrival to last token); decode tok/s = tokens after the first / time after the first token.
   The greedy outputs are checked equal.
2. the same on --sharegpt ShareGPT first turns (chat);
3. concurrency: --batch ShareGPT prompts at --max-num-seqs, --batch-tokens each (ignore_eos), output
   tok/s without speculation and with it, --batch-rounds pairs alternating (adaptive k turns it off
   at large batches).
4. with --llama-python PY (a python with llama_cpp): llama.cpp on the copy-heavy set's token ids,
   the same GGUF, without drafts and with its prompt-lookup decoding (LlamaPromptLookupDecoding).

    .venv/bin/python scripts/bench_spec.py [--max-tokens 128] [--sharegpt 50] [--batch 64]
        [--spec '{"method": "ngram", "num_speculative_tokens": 4}'] [--engine-args JSON] [--peer-args JSON]

--engine-args: LLM keyword arguments of both engines (the target), e.g. '{"quantization": "none",
"dtype": "float32"}' for a float32 target; --peer-args: a third engine without speculation, with
these arguments instead, timed in the same alternation (e.g. '{"quantization": "int4"}': the
int4 model's own speed, what self_quantized drafting is compared with).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

# kvserve is imported where it is used: the llama.cpp child (--llama-child) runs in a python without it.


def _spec_stats(llm) -> dict[str, int]:
    return {k: v for k, v in llm.engine.stats().items() if k.startswith("spec_decode_num_")}


def single_stream(engines: dict, chats: list, max_tokens: int) -> dict[str, dict[str, float]]:
    from kvserve import SamplingParams

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
    same = sum(x == y for x, y in zip(outputs["off"], outputs["on"]))
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
    res["outputs"] = outputs
    return res


def batch_throughput(spec: dict, n: int, max_num_seqs: int, tokens: int, engine_args: dict,
                     rounds: int = 2) -> dict:
    """Output tok/s without speculation and with it, `rounds` times each, alternating off / on
    with a fresh engine per run (this machine's runs drift by ~15% between minutes, so a single
    pair says little); on_vs_off is the median of each round's on / off."""
    from kvserve import LLM, SamplingParams
    from kvserve.bench.datasets import load_sharegpt

    runs: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(rounds):
        for name, cfg in (("off", None), ("on", spec)):
            llm = LLM(max_num_seqs=max_num_seqs, speculative_config=cfg, **engine_args)
            reqs = load_sharegpt(llm.get_tokenizer(), n, max_output_len=tokens)
            params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
            start = time.perf_counter()
            res = llm.generate([r.prompt_token_ids for r in reqs], params, use_tqdm=False)
            runs[name].append(sum(len(o.outputs[0].token_ids) for o in res) / (time.perf_counter() - start))
            llm.close()
    return {**runs, "on_vs_off": statistics.median(on / off for on, off in zip(runs["on"], runs["off"]))}


def llama_cpp_lookup(python: str, model: str, prompts: list[list[int]], max_tokens: int, k: int) -> dict:
    """llama.cpp on the same token ids, greedy, without drafts and with its prompt-lookup decoding
    (llama-cpp-python's LlamaPromptLookupDecoding, num_pred_tokens=k), in `python` (a python
    with llama_cpp). Output tok/s as single_stream counts it: tokens / (start to last token)."""
    spec = {"model": model, "prompts": prompts, "max_tokens": max_tokens, "k": k}
    out = subprocess.run([python, os.path.abspath(__file__), "--llama-child", json.dumps(spec)], capture_output=True,
                         text=True, timeout=7200)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode or not lines:
        raise RuntimeError(f"llama.cpp failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def _ids(out) -> list[int]:
    """apply_chat_template(tokenize=True)'s ids (transformers 5 returns a BatchEncoding)."""
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _llama_child(spec: dict) -> None:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    res = {}
    for name in ("plain", "lookup"):
        draft = LlamaPromptLookupDecoding(num_pred_tokens=spec["k"]) if name == "lookup" else None
        llm = Llama(model_path=spec["model"], n_threads=2, n_threads_batch=2, n_ctx=4096, n_batch=512,
                    verbose=False, seed=0, draft_model=draft)
        eos = llm.token_eos()
        tokens, seconds, outputs = 0, 0.0, []
        for ids in spec["prompts"]:
            llm.reset()
            start, got = time.perf_counter(), []
            for tok in llm.generate(ids, top_k=1, temp=0.0):
                if tok == eos:
                    break
                got.append(int(tok))
                if len(got) == spec["max_tokens"]:
                    break
            seconds += time.perf_counter() - start
            tokens += len(got)
            outputs.append(got)
        res[name] = {"output_tok_s": tokens / seconds, "tokens": tokens}
        res[name + "_outputs"] = outputs
    print("RESULT " + json.dumps(res), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--spec", default='{"method": "ngram", "num_speculative_tokens": 4}')
    ap.add_argument("--sharegpt", type=int, default=50, help="ShareGPT prompts for the single stream (0: skip)")
    ap.add_argument("--batch", type=int, default=64, help="ShareGPT prompts for the concurrency run (0: skip)")
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--batch-tokens", type=int, default=128)
    ap.add_argument("--batch-rounds", type=int, default=2, help="off / on pairs of the concurrency run")
    ap.add_argument("--prompts", type=int, default=50, help="copy-heavy prompts (of 50)")
    ap.add_argument("--engine-args", default="{}", help="LLM keyword arguments (JSON) of the target")
    ap.add_argument("--peer-args", default=None, help="a third engine's LLM arguments (JSON), no speculation")
    ap.add_argument("--llama-python", default=None,
                    help="a python with llama_cpp: llama.cpp's prompt-lookup decoding on the copy-heavy set too")
    ap.add_argument("--llama-child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.llama_child:
        return _llama_child(json.loads(args.llama_child))
    from kvserve import LLM
    from kvserve.bench.spec_prompts import copy_heavy_prompts

    spec = json.loads(args.spec)
    engine_args = json.loads(args.engine_args)
    engines = {"off": LLM(**engine_args), "on": LLM(speculative_config=spec, **engine_args)}
    if args.peer_args:
        engines["peer"] = LLM(**json.loads(args.peer_args))
    chats = copy_heavy_prompts()[:args.prompts]
    res = single_stream(engines, chats, args.max_tokens) if chats else None
    if res is not None:
        print("copy-heavy, single stream:", json.dumps({k: v for k, v in res.items() if k != "outputs"}), flush=True)
    if args.llama_python and res is not None:
        tok = engines["off"].get_tokenizer()
        ids = [_ids(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True)) for c in chats]
        model = engines["off"].engine.model_path
        peer = llama_cpp_lookup(args.llama_python, model, ids, args.max_tokens, spec.get("num_speculative_tokens", 4))
        same = sum(a == b for a, b in zip(peer.pop("lookup_outputs"), res["outputs"]["on"]))
        peer.pop("plain_outputs")
        print("copy-heavy, llama.cpp:", json.dumps({**peer, "outputs_equal_kvserve": f"{same}/{len(chats)}",
                                                     "kvserve_on_vs_lookup": res["on"]["output_tok_s"]
                                                     / peer["lookup"]["output_tok_s"]}), flush=True)
    if args.sharegpt:
        from kvserve.bench.datasets import load_sharegpt

        reqs = load_sharegpt(engines["off"].get_tokenizer(), args.sharegpt)
        sg = [[{"role": "user", "content": r.prompt}] for r in reqs]
        res = single_stream(engines, sg, args.max_tokens)
        print("ShareGPT, single stream:", json.dumps({k: v for k, v in res.items() if k != "outputs"}), flush=True)
    for llm in engines.values():
        llm.close()
    if args.batch:
        print(f"ShareGPT x{args.batch} at max_num_seqs {args.max_num_seqs}, output tok/s:",
              json.dumps(batch_throughput(spec, args.batch, args.max_num_seqs, args.batch_tokens, engine_args,
                                         args.batch_rounds)), flush=True)


if __name__ == "__main__":
    main()
