"""Decode step time on a CUDA GPU (issue 17's targets), with CUDA graphs and without.

    .venv/bin/python scripts/bench_gpu_decode.py [--model PATH] [--batches 1,64] [--steps 64]

Per batch size B: B prompts of 32 random tokens; the step time is (time of B requests for
1 + steps tokens - time of B requests for 1 token) / steps, so prefill drops out. Printed for
the engine with CUDA graphs (the default) and with --enforce-eager, and, as the ceiling, the
time of the model's linears alone as dense torch matmuls in the model dtype at the same batch,
replayed from one CUDA graph: every weight read once, no attention, no launch gaps.

Targets: decode at batch 64 within 1.5x of that ceiling; graphs at least 2x faster than eager
at batch 1.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from kvserve import LLM, SamplingParams


def timed(llm: LLM, prompts: list[list[int]], tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def step_time(llm: LLM, batch: int, steps: int) -> float:
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(100, 20000, (32,), generator=g).tolist() for _ in range(batch)]
    timed(llm, prompts, 4)  # warm-up
    return (timed(llm, prompts, 1 + steps) - timed(llm, prompts, 1)) / steps


def linears_ceiling(model: torch.nn.Module, batch: int, dtype: torch.dtype) -> float:
    """Seconds for one pass over the model's linear shapes (and the LM head) as dense matmuls."""
    shapes = [(m.out_features, m.in_features) for m in model.modules()
              if hasattr(m, "in_features") and hasattr(m, "out_features")]
    shapes.append((model.config.vocab_size, model.config.hidden_size))  # the LM head
    weights = [torch.randn(n, k, device="cuda", dtype=dtype) * 0.02 for n, k in shapes]
    xs = {k: torch.randn(batch, k, device="cuda", dtype=dtype) for _, k in shapes}

    def run() -> None:
        for w in weights:
            F.linear(xs[w.shape[1]], w)

    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / 20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--batches", default="1,64")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    print(torch.cuda.get_device_name(), flush=True)
    results: dict[str, dict[int, float]] = {}
    for eager in (False, True):
        llm = LLM(model=args.model, device="cuda", attention_backend="triton", enforce_eager=eager,
                  max_num_seqs=max(batches), max_model_len=512)
        try:
            name = "eager" if eager else "graphs"
            results[name] = {b: step_time(llm, b, args.steps) for b in batches}
            if not eager:
                runner = llm.engine.executor.runner
                print("graphs captured:", runner.graphs is not None, flush=True)
                results["ceiling"] = {b: linears_ceiling(runner.model, b, runner.dtype) for b in batches}
        finally:
            llm.close()
        print(name, {b: f"{t * 1000:.2f} ms" for b, t in results[name].items()}, flush=True)
    print("ceiling", {b: f"{t * 1000:.2f} ms" for b, t in results["ceiling"].items()})
    for b in batches:
        print(f"batch {b}: graphs {results['graphs'][b] * 1000:.2f} ms, eager {results['eager'][b] * 1000:.2f} ms "
              f"({results['eager'][b] / results['graphs'][b]:.2f}x), ceiling {results['ceiling'][b] * 1000:.2f} ms "
              f"(graphs at {results['graphs'][b] / results['ceiling'][b]:.2f}x)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
