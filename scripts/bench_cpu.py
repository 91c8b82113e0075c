"""Single-stream decode and 2k-token prefill on the default GGUF: kvserve's configurations and
llama.cpp, measured in one run on one machine (issue 11).

    .venv/bin/python scripts/bench_cpu.py [--llama-python PATH] [--configs default,none-f32,...]
                                          [--threads 2] [--out FILE.json] [--ppl]

- kvserve: `LLM(**config)`; decode = 128 greedy tokens after a short prompt (ignore_eos), median
  of 3 runs, tokens / wall time of generate(); prefill = one request of 2048 prompt tokens and one
  output token, median of 2 runs (prefix caching off, so nothing is reused).
- llama.cpp: llama-cpp-python run by `--llama-python` (a python with llama_cpp installed, built
  for the instruction set you name) on the same file and thread count: decode = 128 tokens of
  `generate` (top_k=1) after the same prompt; prefill = `eval` of the same 2048 token ids.
Each configuration runs in a fresh process, so none sees another's caches or threads.

--ppl: what int8 activations cost in perplexity. Every quantized linear of the default model is
forced through the blocks kernel at every batch size (prefill included, where the dense path
would otherwise run), with float32 and then int8 activations, and scored with `kvserve eval ppl`'s
recipe (ShareGPT, 16,384 tokens, windows of 1024 every 512). Takes ~10 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

PROMPT = "Tell me a story about a cat."
DECODE_TOKENS, PREFILL_TOKENS = 128, 2048

# name -> (LLM keyword arguments, extra environment)
CONFIGS = {
    "default": ({}, {}),
    "int8-activations": ({}, {"KVSERVE_INT8_ACTIVATIONS": "1"}),
    "tuning-off": ({}, {"KVSERVE_KERNEL_TUNING": "off"}),
    "no-decode-stack": ({}, {"KVSERVE_DECODE_STACK": "0"}),
    "none-f32": ({"quantization": "none", "dtype": "float32"}, {}),
    "none-bf16": ({"quantization": "none", "dtype": "bfloat16"}, {}),
    "int8-f32": ({"quantization": "int8", "dtype": "float32"}, {}),
}


def _prefill_ids(tokenizer) -> list[int]:
    from kvserve.eval.ppl import load_text_tokens

    return load_text_tokens(tokenizer, "sharegpt", PREFILL_TOKENS)


def run_kvserve(kwargs: dict) -> dict:
    from kvserve import LLM, SamplingParams

    llm = LLM(enable_prefix_caching=False, **kwargs)
    greedy = SamplingParams(max_tokens=DECODE_TOKENS, temperature=0, ignore_eos=True)
    llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
    decode = []
    for _ in range(3):
        t = time.perf_counter()
        llm.generate([PROMPT], greedy, use_tqdm=False)
        decode.append(DECODE_TOKENS / (time.perf_counter() - t))
    ids = _prefill_ids(llm.get_tokenizer())
    prefill = []
    for _ in range(2):
        t = time.perf_counter()
        llm.generate([ids], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        prefill.append(len(ids) / (time.perf_counter() - t))
    info = llm.stats()
    return {"decode_tok_s": statistics.median(decode), "decode_runs": decode,
            "prefill_tok_s": statistics.median(prefill), "prefill_runs": prefill,
            "dtype": str(llm.engine.dtype).removeprefix("torch."), "quantization": info.get("quantization")}


def run_llama_cpp(path: str, threads: int, prefill_ids: list[int]) -> dict:
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=4096, n_batch=512,
                verbose=False, seed=0)
    toks = llm.tokenize(PROMPT.encode())
    decode = []
    for _ in range(4):
        llm.reset()
        t = time.perf_counter()
        n = 0
        for _tok in llm.generate(toks, top_k=1, temp=0.0):
            n += 1
            if n == DECODE_TOKENS:
                break
        decode.append(n / (time.perf_counter() - t))
    prefill = []
    for _ in range(2):
        llm.reset()
        t = time.perf_counter()
        llm.eval(prefill_ids)
        prefill.append(len(prefill_ids) / (time.perf_counter() - t))
    return {"decode_tok_s": statistics.median(decode[1:]), "decode_runs": decode[1:],
            "prefill_tok_s": statistics.median(prefill), "prefill_runs": prefill}


def run_ppl() -> dict:
    import math

    from kvserve import LLM
    from kvserve.eval.ppl import load_text_tokens, perplexity
    from kvserve.worker.kernels import tuning

    llm = LLM()
    model = llm.engine.executor.worker.runner.model
    blocks = [m for m in model.modules() if getattr(m, "path", None) == "blocks"]
    ids = load_text_tokens(llm.get_tokenizer(), "sharegpt", 16384)
    out = {}
    for mode in ("float32", "int8"):
        for m in blocks:
            m.activations, m.dense_from = mode, tuning.NEVER
        _, scored, nll = perplexity(llm, ids)
        out[mode] = math.exp(nll / scored)
    return out


def _child(args: argparse.Namespace) -> None:
    spec = json.loads(args.child)
    if spec["kind"] == "ppl":
        result = run_ppl()
    elif spec["kind"] == "llama.cpp":
        result = run_llama_cpp(spec["path"], spec["threads"], spec["ids"])
    else:
        result = run_kvserve(spec["kwargs"])
    print("RESULT " + json.dumps(result), flush=True)


def _run(python: str, spec: dict, env: dict) -> dict:
    out = subprocess.run([python, os.path.abspath(__file__), "--child", json.dumps(spec)], env=env,
                         capture_output=True, text=True, timeout=1800)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode or not lines:
        raise RuntimeError(f"{spec.get('kind', 'kvserve')} failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--llama-python", default=None, help="a python with llama_cpp installed")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--out", default=None)
    p.add_argument("--ppl", action="store_true", help="also measure int8 activations' perplexity cost")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return _child(args)
    unknown = [c for c in args.configs.split(",") if c not in CONFIGS]
    if unknown:
        p.error(f"--configs: unknown {', '.join(unknown)} (known: {', '.join(CONFIGS)})")
    from kvserve.models.loader import default_model_path, load_tokenizer
    from kvserve.worker.kernels import cpu

    path = default_model_path()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    results = {"cpu": cpu.cpu_model(), "flags": cpu.reported_flags(), "isa_level": cpu.isa_level(),
               "threads": args.threads, "model": path, "runs": {}}
    for name in args.configs.split(","):
        kwargs, extra = CONFIGS[name]
        r = _run(sys.executable, {"kind": "kvserve", "kwargs": kwargs}, {**env, **extra})
        results["runs"][name] = r
        print(f"kvserve {name:18s} decode {r['decode_tok_s']:6.1f} tok/s  prefill {r['prefill_tok_s']:6.1f} tok/s"
              f"  ({r['dtype']}, {r['quantization']})", flush=True)
    if args.llama_python:
        ids = _prefill_ids(load_tokenizer(None))
        r = _run(args.llama_python, {"kind": "llama.cpp", "path": path, "threads": args.threads, "ids": ids}, env)
        results["runs"]["llama.cpp"] = r
        print(f"llama.cpp {'':17s} decode {r['decode_tok_s']:6.1f} tok/s  prefill {r['prefill_tok_s']:6.1f} tok/s",
              flush=True)
    if args.ppl:
        r = results["ppl"] = _run(sys.executable, {"kind": "ppl"}, env)
        print(f"perplexity, every linear through the blocks kernel: float32 activations {r['float32']:.4f}, "
              f"int8 {r['int8']:.4f} ({100 * (r['int8'] / r['float32'] - 1):+.2f}%)", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
