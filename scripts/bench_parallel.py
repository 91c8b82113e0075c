"""The parallelism table in BENCHMARKS.md: TP=1 with all cores, TP=2 with one share of the cores
per rank, PP=2, on the same cores, for the default model and a random Llama of ~1B parameters.

For each row: offline throughput (N random prompts of IN tokens, OUT tokens each, all submitted at
once) and single-stream decode (one prompt, tokens/s after the first). Then the all-reduce itself
(shared memory vs gloo, 2 ranks pinned one core each) at the sizes a step sends, so the table can
say where the time goes: a TP=2 decode step does 2 all-reduces per layer plus one all-gather of
the logits.

    .venv/bin/python scripts/bench_parallel.py                    # both models, every row
    MODELS=default ROWS="tp1 tp2" .venv/bin/python scripts/bench_parallel.py

Results go to $OUT (default bench-results/parallel/) as JSON, and a table to stdout.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

OUT = Path(os.environ.get("OUT", "bench-results/parallel"))
ROWS = os.environ.get("ROWS", "tp1 tp2 pp2").split()  # "none": only the all-reduce table
MODELS = os.environ.get("MODELS", "default llama1b").split()
CONFIGS = {"tp1": {}, "tp2": {"tensor_parallel_size": 2}, "pp2": {"pipeline_parallel_size": 2}}
# (prompts, input tokens, output tokens) per model: the 1B model is ~8x the work per token.
WORK = {"default": (32, 128, 64), "llama1b": (8, 64, 32)}


def llama_1b() -> str:
    """A random Llama with TinyLlama-1.1B's shapes (saved once, bf16 on disk, run in float32)."""
    path = OUT / "llama-1b"
    if (path / "config.json").exists():
        return str(path)
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.conftest import make_tokenizer

    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                      num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=2048,
                      tie_word_embeddings=False, initializer_range=0.02)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer(32000).save_pretrained(path)
    return str(path)


def run_row(model: str | None, work: tuple[int, int, int], row: str) -> dict:
    """One configuration in a fresh process (so each starts with cold caches and its own ranks)."""
    code = f"""
import json, time, random
from kvserve import LLM, SamplingParams
llm = LLM(model={model!r}, dtype="float32", quantization="none", kv_cache_memory="1GiB", **{CONFIGS[row]!r})
n, inp, out = {work!r}
rng = random.Random(0)
vocab = llm.engine.vocab_size
prompts = [[rng.randrange(100, vocab) for _ in range(inp)] for _ in range(n)]
p = SamplingParams(temperature=0, max_tokens=out, ignore_eos=True)
llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm up
llm.engine.clear_kv_cache()
llm.engine.executor.collective_rpc("comm_stats", True)
t = time.perf_counter(); llm.generate(prompts, p, use_tqdm=False); batch = time.perf_counter() - t
comm = llm.engine.executor.collective_rpc("comm_stats", True)
single = SamplingParams(temperature=0, max_tokens=out + 1, ignore_eos=True)
t = time.perf_counter(); llm.generate([prompts[1][:16]], single, use_tqdm=False); one = time.perf_counter() - t
print("RESULT", json.dumps({{"output_tok_s": n * out / batch, "total_tok_s": n * (inp + out) / batch,
                            "single_stream_tok_s": (out + 1) / one, "batch_s": batch,
                            "comm_share": [(c["tp_seconds"] + c["pp_seconds"]) / batch for c in comm],
                            "comm_calls": [c["tp_calls"] + c["pp_calls"] for c in comm]}}))
llm.close()
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=3600)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{model} {row} failed:\n{res.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


ALLREDUCE = """
import os, sys, time, json, torch, torch.distributed as dist, torch.multiprocessing as mp
from kvserve.distributed.parallel import init_distributed
def run(rank, port, q):
    os.sched_setaffinity(0, {rank}); torch.set_num_threads(1)
    par = init_distributed(rank, 2, 1, f"tcp://127.0.0.1:{port}")
    out = {}
    for hidden in (576, 2048):
        for rows in (1, 32, 512):
            x = torch.ones(rows, hidden)
            for name, fn in (("shm", par.tp.all_reduce), ("gloo", lambda t: dist.all_reduce(t, group=par.tp.pg))):
                for _ in range(20): fn(x)
                n = 200 if rows < 512 else 50
                t = time.perf_counter()
                for _ in range(n): fn(x)
                out[f"{name} {rows}x{hidden}"] = (time.perf_counter() - t) / n * 1e6
    if rank == 0: q.put(out)
if __name__ == "__main__":
    import socket
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    q = mp.get_context("spawn").SimpleQueue()
    mp.spawn(run, args=(port, q), nprocs=2)
    print("RESULT", json.dumps(q.get()))
"""


def allreduce_table() -> dict:
    script = OUT / "allreduce.py"  # a file: spawned ranks re-import __main__
    script.write_text(ALLREDUCE)
    res = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    line = next((ln for ln in res.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"all-reduce benchmark failed:\n{res.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def cpu_line() -> str:
    flags = ""
    try:
        text = Path("/proc/cpuinfo").read_text()
        name = next(ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name"))
        flags = next(ln.split(":", 1)[1] for ln in text.splitlines() if ln.startswith("flags")).split()
        isa = [f for f in ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16") if f in flags]
        return f"{name}, {os.cpu_count()} cores, {' '.join(isa)}"
    except (OSError, StopIteration):
        return platform.processor()


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    saved = OUT / "results.json"
    results: dict[str, dict] = json.loads(saved.read_text()) if saved.exists() else {}
    results["cpu"] = cpu_line()
    for model in MODELS if ROWS != ["none"] else []:
        path = None if model == "default" else llama_1b()
        for row in ROWS:
            r = run_row(path, WORK[model], row)
            results[f"{model} {row}"] = r
            saved.write_text(json.dumps(results, indent=2))
            print(f"{model:8s} {row:4s} output {r['output_tok_s']:8.1f} tok/s  total {r['total_tok_s']:8.1f} tok/s  "
                  f"single stream {r['single_stream_tok_s']:6.1f} tok/s  in collectives "
                  f"{', '.join(f'{c:.0%}' for c in r['comm_share'])} of the batch time", flush=True)
    results["allreduce_us"] = allreduce_table()
    for k, v in results["allreduce_us"].items():
        print(f"all-reduce {k:14s} {v:9.1f} us")
    saved.write_text(json.dumps(results, indent=2))
    print(f"CPU: {results['cpu']}; results in {saved}")


if __name__ == "__main__":
    main()
