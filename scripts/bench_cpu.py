"""Single-stream decode and prefill on a GGUF: kvserve's configurations and llama.cpp, measured in
one run on one machine, decode judged as a share of the measured memory read bandwidth (issues 11, 30).

    .venv/bin/python scripts/bench_cpu.py [--model FILE.gguf] [--llama-python PATH]
        [--configs default,f32,bf16,none-f32,...] [--decode-tokens 128] [--prefill 512,2048]
        [--threads 2] [--rounds 1] [--paired N] [--context N] [--out FILE.json] [--ppl]

- --model: any llama-architecture GGUF (default: the embedded default model), e.g. one written by
  scripts/make_random_gguf.py (random weights with TinyLlama-1.1B's or Llama-3.2-3B's shapes).
- kvserve: `LLM(model=FILE, **config)`; decode = --decode-tokens greedy tokens after a short prompt
  (ignore_eos), median of 3 runs; prefill = one request of each --prefill length (ShareGPT text)
  and one output token, median of 2 runs (prefix caching off, so nothing is reused).
- llama.cpp: llama-cpp-python run by `--llama-python` (a python with llama_cpp installed, built
  for the instruction set you name) on the same file, thread count and token ids: decode =
  `generate` (top_k=1), median of 3 runs after a warm-up; prefill = `eval` of the same ids.
Each configuration runs in a fresh process, so none sees another's caches or threads.

--rounds N: run every configuration and llama.cpp N times, interleaved (round 1: each of them once,
then round 2, ...), so a machine whose speed drifts over minutes (a shared VM) moves all of them
alike; each round starts one engine later than the one before, so no engine always runs first
(on a busy VM the first run after the bandwidth read has come out up to 15% slow). The table
shows each engine's median over the rounds, and the ratios to llama.cpp are the median of the
ratios within each round (a configuration against the llama.cpp run beside it).

Two decode rates: `tok/s` is tokens over the wall time of the whole request (as recorded before
issue 30); `decode-only` is the tokens after the first over the time after the first, the rate the
bandwidth share is computed from. Bytes read per decoded token = the weights (kvserve: the
engine's resident weight bytes; llama.cpp: the GGUF's tensor data, which it reads in place) + the
K/V of the context at the middle of the decode (kvserve in its KV dtype, llama.cpp in F16). The
share = bytes per token x decode-only tok/s / the read bandwidth (kvserve.kernels.bandwidth:
a streaming read with --threads threads, measured before each round; the best of those readings,
since a neighbour's load during one only lowers it).

--paired N (with --llama-python): after the rounds, every configuration and llama.cpp loaded once,
side by side in resident processes, and N decode replies each taken in turns (ABBA), so the two
replies a ratio compares are seconds apart instead of a round's minute; the ratios are the median
over the N passes. (On a 2-vCPU VM whose read bandwidth moved between 26 and 54 GB/s, paired ratios
still spread over 0.89-1.33 in 12 passes: the machine's speed moves within seconds too. Take N of
12 or more and read the median; the idle engines' threads sleep, measured at 0.01 CPU-s in 5 s.)
Each pass also times a plain streaming read of the weight bytes a decode token reads (every tensor
but an untied token table, of which a token reads one row) with the same threads
(kvserve.kernels.bandwidth, median of 3 reads) as a third resident process: the tokens per second a
decode would reach if a token cost nothing but reading its weights once. Every engine's reply is
also given as a share of that read in the same pass (`x pure read`): how far each is from the
memory's limit at that moment, and so what ratio between the two engines the memory leaves room for.
The ratios to llama.cpp are also printed for the passes whose read was at or above the run's
median read and for the rest: a VM's memory can switch speed within minutes, and the ratio with it.

--context N: decode after N tokens of ShareGPT text instead of the short prompt, in the rounds and
the paired replies, so attention over a long context is part of every step. Each engine computes
the context once and keeps it (kvserve's prefix cache, llama.cpp's own prefix reuse), so a reply is
its last prompt token and the decode; `decode-only` is the rate to read. The pure read stays the
weights' bytes: the engines' K/V differ (kvserve's in its KV dtype, llama.cpp's in F16).

--ppl: what int8 activations cost in perplexity on the default model. Every quantized linear is
forced through the blocks kernel at every batch size (prefill included), with float32 and then
int8 activations, scored with `kvserve eval ppl`'s recipe (ShareGPT, 16,384 tokens, windows of
1024 every 512). Takes ~10 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

PROMPT = "Tell me a story about a cat."
KV_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}
LLAMA_KV_BYTES = 2  # llama.cpp's default K/V cache type is F16

# name -> (LLM keyword arguments, extra environment)
CONFIGS = {
    "default": ({}, {}),
    "f32": ({"dtype": "float32"}, {}),
    "bf16": ({"dtype": "bfloat16"}, {}),
    "int8-activations": ({}, {"KVSERVE_INT8_ACTIVATIONS": "1"}),
    "int16-activations": ({}, {"KVSERVE_INT8_ACTIVATIONS": "0"}),  # int8 never a decode candidate
    "no-prefill-int8": ({}, {"KVSERVE_PREFILL_INT8": "0"}),
    "no-amx": ({}, {"KVSERVE_AMX": "0"}),  # torch's dense matmul on a dequantized copy where AMX exists
    "tuning-off": ({}, {"KVSERVE_KERNEL_TUNING": "off"}),
    "no-decode-stack": ({}, {"KVSERVE_DECODE_STACK": "0"}),
    "kv-bf16": ({"kv_cache_dtype": "bfloat16"}, {}),  # what "auto" gives a GGUF on a CPU
    "kv-f32": ({"kv_cache_dtype": "float32"}, {}),  # a GGUF's K/V as computed
    "none-f32": ({"quantization": "none", "dtype": "float32"}, {}),
    "none-bf16": ({"quantization": "none", "dtype": "bfloat16"}, {}),
    "int8-f32": ({"quantization": "int8", "dtype": "float32"}, {}),
    "thp": ({}, {"THP_MEM_ALLOC_ENABLE": "1"}),  # torch's CPU allocations on transparent huge pages
}


def run_kvserve(spec: dict) -> dict:
    from kvserve import LLM, SamplingParams

    n = spec["decode_tokens"]
    llm = _kvserve_llm(spec)
    greedy = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    warm = llm.generate([_kvserve_prompt(spec)], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0]
    decode, decode_only = [], []
    for _ in range(3):
        rate, only = kvserve_decode(llm, greedy, _kvserve_prompt(spec))
        decode.append(rate)
        if only is not None:
            decode_only.append(only)
    prefill = {}
    for length in spec["prefill"]:
        ids = spec["ids"][:length]
        runs = []
        for _ in range(2):
            if spec.get("context"):
                llm.engine.clear_kv_cache()  # the decode's context must not shorten a prefill
            t = time.perf_counter()
            llm.generate([ids], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
            runs.append(len(ids) / (time.perf_counter() - t))
        prefill[str(length)] = {"tok_s": statistics.median(runs), "runs": runs}
    info = llm.stats()
    return {"decode_tok_s": statistics.median(decode), "decode_runs": decode,
            "decode_only_tok_s": statistics.median(decode_only) if decode_only else None,
            "prompt_tokens": len(warm.prompt_token_ids), "prefill": prefill,
            "dtype": str(llm.engine.dtype).removeprefix("torch."), "quantization": info.get("quantization"),
            "weight_bytes": info["weight_bytes"], "kv_bytes_per_element": KV_BYTES.get(info["kv_cache_dtype"], 4)}


def _kvserve_llm(spec: dict):
    """kvserve's engine for a decode spec: the prefix cache on only to keep a --context."""
    from kvserve import LLM

    return LLM(model=spec["model"], enable_prefix_caching=bool(spec.get("context")), **spec["kwargs"])


def _kvserve_prompt(spec: dict) -> str | dict:
    """The decode's prompt: the short one, or the first --context ids of the ShareGPT text."""
    return {"prompt_token_ids": spec["ids"][:spec["context"]]} if spec.get("context") else PROMPT


def kvserve_decode(llm, greedy, prompt: str | dict = PROMPT) -> tuple[float, float | None]:
    """One greedy reply of greedy.max_tokens tokens: (tok/s over the request, decode-only tok/s)."""
    n = greedy.max_tokens
    t = time.perf_counter()
    out = llm.generate([prompt], greedy, use_tqdm=False)[0]
    rate = n / (time.perf_counter() - t)
    m = out.metrics
    if m is not None and m.first_token_time and m.last_token_time and m.last_token_time > m.first_token_time:
        return rate, (n - 1) / (m.last_token_time - m.first_token_time)
    return rate, None


def llama_decode(llm, toks: list[int], n: int, keep: bool = False) -> tuple[float, float | None]:
    """One greedy reply of n tokens from llama.cpp: (tok/s over the request, decode-only tok/s).
    keep: reuse what the context holds of toks (generate keeps the longest common prefix)."""
    if not keep:
        llm.reset()
    t = time.perf_counter()
    count, first = 0, None
    for _tok in llm.generate(toks, top_k=1, temp=0.0):
        count += 1
        first = first or time.perf_counter()
        if count == n:
            break
    end = time.perf_counter()
    return count / (end - t), (count - 1) / (end - first) if count > 1 else None


def run_llama_cpp(spec: dict) -> dict:
    from llama_cpp import Llama

    n = spec["decode_tokens"]
    llm = Llama(model_path=spec["model"], n_threads=spec["threads"], n_threads_batch=spec["threads"],
                n_ctx=spec["n_ctx"], n_batch=512, verbose=False, seed=0)
    toks = _llama_prompt(llm, spec)
    decode, decode_only = [], []
    for _ in range(4):  # the first run warms up and is dropped
        rate, only = llama_decode(llm, toks, n, keep=bool(spec.get("context")))
        decode.append(rate)
        if only is not None:
            decode_only.append(only)
    prefill = {}
    for length in spec["prefill"]:
        runs = []
        for _ in range(2):
            llm.reset()
            t = time.perf_counter()
            llm.eval(spec["ids"][:length])
            runs.append(length / (time.perf_counter() - t))
        prefill[str(length)] = {"tok_s": statistics.median(runs), "runs": runs}
    return {"decode_tok_s": statistics.median(decode[1:]), "decode_runs": decode[1:],
            "decode_only_tok_s": statistics.median(decode_only[1:]), "prompt_tokens": len(toks), "prefill": prefill}


def _llama_prompt(llm, spec: dict) -> list[int]:
    return list(spec["ids"][:spec["context"]]) if spec.get("context") else llm.tokenize(PROMPT.encode())


def run_ppl() -> dict:
    import math

    from kvserve import LLM
    from kvserve.eval.ppl import load_text_tokens, perplexity
    from kvserve.kernels import tuning

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


def _resident(spec: dict) -> None:
    """--paired's child: load the engine, warm it up, print READY, then one greedy reply per
    "decode" line on stdin (a RESULT line each) until stdin closes."""
    n = spec["decode_tokens"]
    if spec["kind"] == "read":
        from kvserve.kernels import bandwidth

        def once() -> tuple[float, float]:
            m = bandwidth.measure(spec["threads"], spec["bytes"], reps=3)
            rate = 1.0 / statistics.median(m["seconds"])  # tokens/s if a token were one read of the weights
            return rate, rate
    elif spec["kind"] == "llama.cpp":
        from llama_cpp import Llama

        llm = Llama(model_path=spec["model"], n_threads=spec["threads"], n_threads_batch=spec["threads"],
                    n_ctx=spec["n_ctx"], n_batch=512, verbose=False, seed=0)
        toks = _llama_prompt(llm, spec)
        once = lambda: llama_decode(llm, toks, n, keep=bool(spec.get("context")))  # noqa: E731
    else:
        from kvserve import SamplingParams

        llm = _kvserve_llm(spec)
        greedy = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
        once = lambda: kvserve_decode(llm, greedy, _kvserve_prompt(spec))  # noqa: E731
    once()
    print("READY", flush=True)
    for line in sys.stdin:
        if line.strip() != "decode":
            break
        rate, only = once()
        print("RESULT " + json.dumps({"decode_tok_s": rate, "decode_only_tok_s": only}), flush=True)


def _child(args: argparse.Namespace) -> None:
    spec = json.loads(args.child)
    if spec.get("resident"):
        return _resident(spec)
    if spec["kind"] == "ppl":
        result = run_ppl()
    elif spec["kind"] == "llama.cpp":
        result = run_llama_cpp(spec)
    else:
        result = run_kvserve(spec)
    print("RESULT " + json.dumps(result), flush=True)


def _run(python: str, spec: dict, env: dict) -> dict:
    out = subprocess.run([python, os.path.abspath(__file__), "--child", json.dumps(spec)], env=env,
                         capture_output=True, text=True, timeout=3600)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode or not lines:
        raise RuntimeError(f"{spec.get('kind', 'kvserve')} failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


class Resident:
    """An engine loaded once in its own process (_resident), asked for one reply at a time."""

    def __init__(self, python: str, spec: dict, env: dict) -> None:
        self.kind = spec["kind"]
        self.err = tempfile.TemporaryFile(mode="w+")  # a file, not a pipe: loading bars cannot fill it and stall
        self.proc = subprocess.Popen([python, os.path.abspath(__file__), "--child", json.dumps({**spec, "resident": 1})],
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True)
        self._expect("READY")

    def _expect(self, prefix: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix):]
        self.err.seek(0)
        raise RuntimeError(f"{self.kind}: the resident process ended (exit {self.proc.wait()}):\n"
                           f"{self.err.read()[-3000:]}")

    def decode(self) -> dict:
        self.proc.stdin.write("decode\n")
        self.proc.stdin.flush()
        return json.loads(self._expect("RESULT "))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)
        self.err.close()


def measure_paired(args: argparse.Namespace, configs: list[str], common: dict, env: dict, geo: dict) -> dict:
    """--paired N: every configuration and llama.cpp loaded once, side by side in their own
    processes, then N replies each, taken in turns (ABBA: each pass runs the engines in the
    reverse order of the one before), so two replies compared are seconds apart rather than a
    round's minute: the ratios are the median over the N passes of each configuration's reply
    over llama.cpp's in the same pass. The idle engines wait (their threads sleep); they hold
    memory, not cores. A third process reads geo's decode bytes each pass (the pure read)."""
    n_ctx = 64 + args.context + args.decode_tokens + 64
    engines = {name: Resident(sys.executable, {"kind": "kvserve", "kwargs": CONFIGS[name][0], **common},
                              {**env, **CONFIGS[name][1]}) for name in configs}
    engines["llama.cpp"] = Resident(args.llama_python, {"kind": "llama.cpp", "threads": args.threads,
                                                         "n_ctx": n_ctx, **common}, env)
    engines[READ] = Resident(sys.executable, {"kind": "read", "threads": args.threads,
                                              "bytes": geo["decode_bytes"], **common}, env)
    passes: list[dict[str, dict]] = []
    try:
        names = list(engines)
        for i in range(args.paired):
            one = {}
            for name in (names if i % 2 == 0 else names[::-1]):
                one[name] = engines[name].decode()
            passes.append(one)
            print(f"pass {i + 1}/{args.paired}: " + ", ".join(
                f"{name} {r['decode_only_tok_s']:.1f}" for name, r in one.items()) + " decode-only tok/s", flush=True)
    finally:
        for e in engines.values():
            e.close()
    return paired_summary(passes, configs)


READ = "pure read"  # --paired's streaming read of the weight bytes, a rate like an engine's


def _label(name: str) -> str:
    """A --paired process's name in the table: kvserve's configurations say whose they are."""
    return name if name in ("llama.cpp", READ) else f"kvserve {name}"


def paired_summary(passes: list[dict[str, dict]], configs: list[str]) -> dict:
    """--paired's passes as each engine's median rates, each configuration's median ratio to
    llama.cpp and each engine's to the pure read (when the passes have one) over the passes (a
    pass's replies against each other, never across passes).

    With the pure read, the ratios to llama.cpp also come split by the memory's speed in each pass
    (`by_read`): the passes whose read was at least the run's median read, and the others. A VM's
    memory can switch between two speeds within minutes (BENCHMARKS.md, issue 30), and the engines'
    ratio follows it: when the memory is fast both are bound by their arithmetic, when it is slow
    both wait on it; one median over a mix of the two says little about either."""
    out: dict = {"passes": passes, "medians": {}, "vs_llama_cpp": {}, "vs_read": {}, "by_read": {}}

    def ratio(name: str, base: str, among: list[dict[str, dict]] = passes) -> dict:
        return {key: _median([p[name][key] / p[base][key] for p in among if p[name][key] and p[base][key]])
                for key in RATED}
    for name in passes[0]:
        out["medians"][name] = {key: _median([p[name][key] for p in passes]) for key in RATED}
    for name in configs:
        out["vs_llama_cpp"][name] = ratio(name, "llama.cpp")
    if READ in passes[0]:
        out["vs_read"] = {name: ratio(name, READ)["decode_only_tok_s"] for name in passes[0] if name != READ}
        def read(p: dict[str, dict]) -> float:
            return p[READ]["decode_only_tok_s"]
        mid = _median([read(p) for p in passes])
        halves = {"read at or above its median": [p for p in passes if read(p) >= mid],
                  "read below its median": [p for p in passes if read(p) < mid]}
        out["by_read"] = {half: {"passes": len(among), "read_tok_s": _median([read(p) for p in among]),
                                 "vs_llama_cpp": {name: ratio(name, "llama.cpp", among)["decode_only_tok_s"]
                                                  for name in configs}}
                          for half, among in halves.items() if among}
    return out


def model_geometry(path: str) -> dict:
    """What the bandwidth share needs of a GGUF: its tensor data bytes and its K/V per token."""
    from kvserve.models.gguf_loader import gguf_config, open_gguf

    reader = open_gguf(path)
    cfg = gguf_config(reader, path)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    sizes = {t.name: int(t.n_bytes) for t in reader.tensors}
    # a decode token reads one row of the token table, unless the table is the LM head too (tied)
    table = sizes.get("token_embd.weight", 0) if "output.weight" in sizes else 0
    return {"tensor_bytes": sum(sizes.values()), "decode_bytes": sum(sizes.values()) - table,
            "file_bytes": os.path.getsize(path),
            "layers": cfg.num_hidden_layers, "kv_heads": cfg.num_key_value_heads, "head_dim": head_dim,
            # K and V elements one token adds to every layer's cache
            "kv_elements_per_token": 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim}


def bandwidth_share(r: dict, weight_bytes: int, kv_element_bytes: int, geo: dict, decode_tokens: int,
                    gb_s: float | None) -> None:
    """Add bytes read per decoded token, GB/s and % of the read bandwidth to a decode result."""
    context = r["prompt_tokens"] + (decode_tokens + 1) / 2  # the middle of the decode
    kv = context * geo["kv_elements_per_token"] * kv_element_bytes
    r["bytes_per_token"] = weight_bytes + kv
    r["weight_bytes_per_token"], r["kv_bytes_per_token"] = weight_bytes, kv
    rate = r.get("decode_only_tok_s")
    r["read_gb_s"] = r["bytes_per_token"] * rate / 1e9 if rate else None
    r["bandwidth_pct"] = 100 * r["read_gb_s"] / gb_s if rate and gb_s else None


RATED = ("decode_tok_s", "decode_only_tok_s")


def _median(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def median_run(runs: list[dict]) -> dict:
    """One engine's rounds as one result: the median of each rate (the rest from the first round)."""
    r = json.loads(json.dumps(runs[0]))
    for key in RATED:
        r[key] = _median([x[key] for x in runs])
    for n in r["prefill"]:
        r["prefill"][n]["tok_s"] = _median([x["prefill"][n]["tok_s"] for x in runs])
        r["prefill"][n]["runs"] = [v for x in runs for v in x["prefill"][n]["runs"]]
    r["decode_runs"] = [v for x in runs for v in x["decode_runs"]]
    return r


def ratio_to_llama(rounds: list[dict[str, dict]], name: str, lengths: list[int]) -> dict:
    """A configuration's rates over llama.cpp's in the same round, median over the rounds."""
    def ratio(get) -> float | None:
        qs = [get(one[name]) / get(one["llama.cpp"]) for one in rounds if get(one[name]) and get(one["llama.cpp"])]
        return statistics.median(qs) if qs else None
    out: dict = {key: ratio(lambda r, key=key: r[key]) for key in RATED}
    out["prefill"] = {str(n): ratio(lambda r, n=n: r["prefill"][str(n)]["tok_s"]) for n in lengths}
    return out


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_table(results: dict) -> None:
    bw, per_round = results["bandwidth"], results.get("bandwidth_rounds_gb_s", [])
    print(f"\ncpu        {results['cpu']} ({results['isa_level']}; {' '.join(results['flags'])})")
    print(f"threads    {results['threads']}; read bandwidth "
          + (f"{bw['gb_s']:.1f} GB/s ({bw['bytes'] >> 20} MiB, best of {len(bw['seconds'])} reads)" if bw else "n/a")
          + (" before each round: " + ", ".join(_fmt(x, ".1f") for x in per_round) if len(per_round) > 1 else ""))
    geo = results["geometry"]
    print(f"model      {results['model']} ({geo['file_bytes'] / 2**20:.0f} MiB)")
    print(f"command    {results['command']}")
    lengths = results["prefill_lengths"]
    head = (f"{'engine':44s} {'decode tok/s':>12s} {'decode-only':>11s} {'MB/token':>9s} {'GB/s':>6s} "
            f"{'% of BW':>7s}" + "".join(f" {'prefill ' + str(n):>13s}" for n in lengths))
    rounds = len(results.get("rounds", [])) or 1
    print(f"\n{head}{'  (median of ' + str(rounds) + ' rounds)' if rounds > 1 else ''}\n{'-' * len(head)}")
    for name, r in results["runs"].items():
        label = name if name == "llama.cpp" else f"kvserve {name} ({r['dtype']}, {r['quantization']})"
        print(f"{label[:44]:44s} {r['decode_tok_s']:12.1f} {_fmt(r['decode_only_tok_s'], '11.1f')} "
              f"{r['bytes_per_token'] / 1e6:9.1f} {_fmt(r['read_gb_s'], '6.1f')} {_fmt(r['bandwidth_pct'], '6.1f')}%"
              + "".join(f" {r['prefill'][str(n)]['tok_s']:13.1f}" for n in lengths), flush=True)
    ratios = results.get("vs_llama_cpp")
    if ratios:
        print(f"\n{'x llama.cpp (median of per-round ratios)':44s} {'decode':>12s} {'decode-only':>11s}"
              + "".join(f" {'prefill ' + str(n):>13s}" for n in lengths))
        for name, q in ratios.items():
            print(f"{'kvserve ' + name:44s} {_fmt(q['decode_tok_s'], '12.2f')} {_fmt(q['decode_only_tok_s'], '11.2f')}"
                  + "".join(f" {_fmt(q['prefill'][str(n)], '13.2f')}" for n in lengths), flush=True)
    paired = results.get("paired")
    if paired:
        print(f"\n{'paired replies (median of ' + str(len(paired['passes'])) + ' passes)':44s} {'decode':>12s} "
              f"{'decode-only':>11s}")
        for name, m in paired["medians"].items():
            print(f"{_label(name):44s} {_fmt(m['decode_tok_s'], '12.1f')} {_fmt(m['decode_only_tok_s'], '11.1f')}")
        for name, q in paired["vs_llama_cpp"].items():
            print(f"{'x llama.cpp: kvserve ' + name:44s} {_fmt(q['decode_tok_s'], '12.2f')} "
                  f"{_fmt(q['decode_only_tok_s'], '11.2f')}", flush=True)
        for name, q in paired.get("vs_read", {}).items():
            print(f"{'x pure read of the weights: ' + _label(name):44s} {'':12s} {_fmt(q, '11.2f')}", flush=True)
        for half, h in paired.get("by_read", {}).items():
            print(f"passes with the {half} ({h['passes']}, read {_fmt(h['read_tok_s'], '.1f')} tok/s):")
            for name, q in h["vs_llama_cpp"].items():
                print(f"{'  x llama.cpp: kvserve ' + name:44s} {'':12s} {_fmt(q, '11.2f')}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a GGUF file (default: the embedded default model)")
    p.add_argument("--configs", default=",".join(CONFIGS), help="kvserve configurations, comma-separated")
    p.add_argument("--llama-python", default=None, help="a python with llama_cpp installed")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--prefill", default="2048", help="prompt lengths, comma-separated (e.g. 512,2048)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every configuration and llama.cpp this many times, interleaved")
    p.add_argument("--paired", type=int, default=0, metavar="N",
                   help="then N decode replies per engine with every engine resident, in turns (needs --llama-python)")
    p.add_argument("--context", type=int, default=0, metavar="N",
                   help="decode after N tokens of ShareGPT text instead of a short prompt")
    p.add_argument("--out", default=None, help="write every number as JSON")
    p.add_argument("--ppl", action="store_true", help="also measure int8 activations' perplexity cost")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return _child(args)
    configs = [c for c in args.configs.split(",") if c]
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        p.error(f"--configs: unknown {', '.join(unknown)} (known: {', '.join(CONFIGS)})")
    try:
        lengths = [int(n) for n in args.prefill.split(",") if n]
    except ValueError:
        p.error(f"--prefill: comma-separated token counts, got {args.prefill!r}")
    if args.decode_tokens < 2 or any(n < 1 for n in lengths) or args.context < 0:
        p.error("--decode-tokens must be at least 2, every --prefill length at least 1 and --context at least 0")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.paired < 0 or args.paired and not args.llama_python:
        p.error("--paired needs a count of at least 1 and --llama-python")
    results = measure_all(args, configs, lengths)
    print_table(results)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


def measure_all(args: argparse.Namespace, configs: list[str], lengths: list[int]) -> dict:
    import torch

    from kvserve.eval.ppl import load_text_tokens
    from kvserve.models.loader import default_model_path, load_tokenizer
    from kvserve.kernels import bandwidth, cpu

    path = os.path.abspath(args.model) if args.model else default_model_path()
    geo = model_geometry(path)
    torch.set_num_threads(args.threads)
    # Measured now (and cached for `kvserve env`): a number cached on a busy day would flatter every share.
    # Again before each round: the best of them is the machine's, and the shares use it.
    bw = bandwidth.read_bandwidth(args.threads, refresh=True)
    gb_s = bw["gb_s"] if bw else None
    bw_rounds = [gb_s]
    need = max([*lengths, args.context])
    ids = load_text_tokens(load_tokenizer(path), "sharegpt", need) if need else []
    if len(ids) < need:
        raise SystemExit(f"the ShareGPT text gave only {len(ids)} tokens for --prefill / --context {need}")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    results = {"cpu": cpu.cpu_model(), "flags": cpu.reported_flags(), "isa_level": cpu.isa_level(),
               "threads": args.threads, "bandwidth": bw, "model": path, "geometry": geo,
               "command": shlex.join([os.path.relpath(sys.executable), *sys.argv]),
               "decode_tokens": args.decode_tokens, "context": args.context, "prefill_lengths": lengths, "runs": {}}
    common = {"model": path, "decode_tokens": args.decode_tokens, "prefill": lengths, "ids": ids,
              "context": args.context}
    rounds: list[dict[str, dict]] = []
    for k in range(args.rounds):
        one: dict[str, dict] = {}
        tag = f"round {k + 1}/{args.rounds}: " if args.rounds > 1 else ""
        if k and bw:
            again = bandwidth.read_bandwidth(args.threads, refresh=True)
            bw_rounds.append(again["gb_s"] if again else None)
            if again and again["gb_s"] > bw["gb_s"]:
                bw, gb_s = again, again["gb_s"]
        # each round starts one engine later, so none always runs first (after the bandwidth read)
        engines = [*configs, *(["llama.cpp"] if args.llama_python else [])]
        for name in engines[k % len(engines):] + engines[:k % len(engines)]:
            if name == "llama.cpp":
                n_ctx = max([*lengths, 64 + args.context + args.decode_tokens]) + 64
                r = one[name] = _run(args.llama_python, {"kind": "llama.cpp", "threads": args.threads,
                                                         "n_ctx": n_ctx, **common}, env)
                r.update(dtype="-", quantization="gguf")
                bandwidth_share(r, geo["tensor_bytes"], LLAMA_KV_BYTES, geo, args.decode_tokens, gb_s)
                print(f"{tag}llama.cpp: decode {r['decode_tok_s']:.1f} tok/s, {_fmt(r['bandwidth_pct'], '.1f')}% of "
                      "bandwidth", flush=True)
                continue
            kwargs, extra = CONFIGS[name]
            r = one[name] = _run(sys.executable, {"kind": "kvserve", "kwargs": kwargs, **common}, {**env, **extra})
            bandwidth_share(r, r["weight_bytes"], r["kv_bytes_per_element"], geo, args.decode_tokens, gb_s)
            print(f"{tag}kvserve {name}: decode {r['decode_tok_s']:.1f} tok/s, {_fmt(r['bandwidth_pct'], '.1f')}% "
                  f"of bandwidth ({r['dtype']}, {r['quantization']})", flush=True)
        rounds.append(one)
    for name in rounds[0]:
        r = results["runs"][name] = median_run([one[name] for one in rounds])
        weights, kv_bytes = ((geo["tensor_bytes"], LLAMA_KV_BYTES) if name == "llama.cpp"
                             else (r["weight_bytes"], r["kv_bytes_per_element"]))
        bandwidth_share(r, weights, kv_bytes, geo, args.decode_tokens, gb_s)
    results["bandwidth"], results["bandwidth_rounds_gb_s"] = bw, bw_rounds
    if args.rounds > 1:
        results["rounds"] = rounds
    if args.llama_python:
        results["vs_llama_cpp"] = {name: ratio_to_llama(rounds, name, lengths) for name in configs}
    if args.paired and args.llama_python:
        results["paired"] = measure_paired(args, configs, common, env, geo)
    if args.ppl:
        r = results["ppl"] = _run(sys.executable, {"kind": "ppl"}, env)
        print(f"perplexity, every linear through the blocks kernel: float32 activations {r['float32']:.4f}, "
              f"int8 {r['int8']:.4f} ({100 * (r['int8'] / r['float32'] - 1):+.2f}%)", flush=True)
    return results


if __name__ == "__main__":
    main()
