"""Decode step time on a CUDA GPU (issue 17's targets), with CUDA graphs and without.

    .venv/bin/python scripts/bench_gpu_decode.py [--model PATH] [--batches 1,64] [--steps 64]
        [--quantization int8]

The model: --model, else the embedded default if installed, else random weights in its shape
(SmolLM2-135M: 30 layers, hidden 576, 9 / 3 heads of 64, vocabulary 49152; built with the tests'
tiny-model builder, so run from the repository root) -- the device machine has no room for the
default model's package. Timing does not depend on the weights' values.

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
import os
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kvserve import LLM, SamplingParams

# Compiled Triton kernels: the tests' builder (tests/conftest.py), imported for a random model,
# would otherwise turn on Triton's interpreter (nothing here has imported triton yet).
os.environ.setdefault("TRITON_INTERPRET", "0")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(llm: LLM, prompts: list[list[int]], tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    sync()
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    sync()
    return time.perf_counter() - t


def step_time(llm: LLM, batch: int, steps: int) -> float:
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(100, 20000, (32,), generator=g).tolist() for _ in range(batch)]
    timed(llm, prompts, 4)  # warm-up
    return (timed(llm, prompts, 1 + steps) - timed(llm, prompts, 1)) / steps


def linears_ceiling(model: torch.nn.Module, batch: int, dtype: torch.dtype, device: str) -> float:
    """Seconds for one pass over the model's linear shapes (and the LM head) as dense matmuls,
    replayed from a CUDA graph on CUDA. The layers' linears are nn.Linear (a quantized one keeps
    its kernel module inside, not counted again)."""
    shapes = [(m.out_features, m.in_features) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    shapes.append((model.config.vocab_size, model.config.hidden_size))  # the LM head
    weights = [torch.randn(n, k, device=device, dtype=dtype) * 0.02 for n, k in shapes]
    xs = {k: torch.randn(batch, k, device=device, dtype=dtype) for _, k in shapes}

    def run() -> None:
        for w in weights:
            F.linear(xs[w.shape[1]], w)

    run()
    sync()
    replay = run
    if device == "cuda":
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        replay = graph.replay
    replay()
    sync()
    t = time.perf_counter()
    for _ in range(20):
        replay()
    sync()
    return (time.perf_counter() - t) / 20


def default_or_random_model(tmp: str) -> str | None:
    """None (the embedded default) when installed, else a random model of its shape under tmp."""
    from kvserve.models.loader import default_model_path

    try:
        default_model_path()
        return None
    except ValueError:
        from tests.conftest import build_tiny_model

        shape = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=2048,
                     tie_word_embeddings=True)
        return str(build_tiny_model(Path(tmp), "llama", **shape))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--batches", default="1,64")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--quantization", "-q", default=None, help="as kvserve's flag (default: the checkpoint's)")
    p.add_argument("--device", default="cuda", help="cuda; cpu only checks the script (no graphs there)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    tmp = tempfile.TemporaryDirectory()
    model = args.model or default_or_random_model(tmp.name)
    batches = [int(b) for b in args.batches.split(",")]
    cuda = args.device == "cuda"
    print(torch.cuda.get_device_name() if cuda else args.device, "model", model or "default", flush=True)
    results: dict[str, dict[int, float]] = {}
    for eager in (False, True):
        llm = LLM(model=model, device=args.device, attention_backend="triton" if cuda else "auto", enforce_eager=eager,
                  quantization=args.quantization, max_num_seqs=max(batches), max_model_len=512)
        try:
            name = "eager" if eager else "graphs"
            results[name] = {b: step_time(llm, b, args.steps) for b in batches}
            if not eager:
                runner = llm.engine.executor.runner
                print("graphs captured:", runner.graphs is not None, flush=True)
                results["ceiling"] = {b: linears_ceiling(runner.model, b, runner.dtype, args.device) for b in batches}
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
