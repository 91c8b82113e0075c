"""What sampling costs per step: the sampler alone on a batch of logits, and the engine at a batch of
sampled streams (temperature, top-p, with and without seeds), against greedy.

    .venv/bin/python scripts/bench_sampler.py [--model FILE] [--batch 32] [--tokens 64] [--rounds 2]

Sampler alone: logits [batch, the model's vocabulary] drawn as N(0, 1) x scale, half the rows at
scale 8 (a peaked distribution: at temperature 0.8 a 0.95 nucleus of a few tokens over 49,152) and
half at 3.5 (a broad one: tens to hundreds of tokens), median of 15 calls. Engine: `LLM.generate` of
`batch` short prompts, `tokens` tokens each (ignore_eos), the best of `rounds` runs after a warm-up,
output tokens per second.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvserve import LLM, SamplingParams
from kvserve.worker.sampler import Sampler, SamplingMetadata

SETTINGS = {
    "greedy": dict(temperature=0.0),
    "temperature 0.8": dict(temperature=0.8),
    "temperature 0.8, top_p 0.95": dict(temperature=0.8, top_p=0.95),
    "temperature 0.8, top_k 50": dict(temperature=0.8, top_k=50),
}


def sampler_ms(vocab: int, batch: int, params: dict, seeded: bool) -> float:
    gen = torch.Generator().manual_seed(0)
    scale = torch.tensor([8.0 if i % 2 else 3.5 for i in range(batch)]).unsqueeze(1)
    logits = torch.randn(batch, vocab, generator=gen) * scale
    sp = [SamplingParams(**params, seed=i if seeded else None) for i in range(batch)]
    gens = {i: torch.Generator().manual_seed(i) for i in range(batch)} if seeded and params["temperature"] else {}
    meta = SamplingMetadata.build(sp, [[]] * batch, [[]] * batch, gens, [[]] * batch, vocab, torch.device("cpu"))
    sampler, times = Sampler(), []
    for _ in range(15):
        t = time.perf_counter()
        sampler(logits, meta)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a GGUF or model directory (default: the embedded default model)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    llm = LLM(model=args.model, enable_prefix_caching=False) if args.model else LLM(enable_prefix_caching=False)
    vocab = llm.engine.vocab_size
    prompts = [f"Write a short poem about the number {i} and the sea." for i in range(args.batch)]
    print(f"{'setting':32s} {'seeded':>6s} {'sampler ms/step':>15s} {'engine tok/s':>12s}")
    for name, params in SETTINGS.items():
        for seeded in (False, True) if params["temperature"] else (False,):
            ms = sampler_ms(vocab, args.batch, params, seeded)
            sp = [SamplingParams(**params, max_tokens=args.tokens, ignore_eos=True, seed=i if seeded else None)
                  for i in range(args.batch)]
            llm.generate(prompts[:4], sp[:4], use_tqdm=False)  # warm-up
            rates = []
            for _ in range(args.rounds):
                t = time.perf_counter()
                llm.generate(prompts, sp, use_tqdm=False)
                rates.append(args.batch * args.tokens / (time.perf_counter() - t))
            print(f"{name:32s} {str(seeded):>6s} {ms:15.2f} {max(rates):12.1f}", flush=True)


if __name__ == "__main__":
    main()
