"""Prefill attention on the CPU (issue 30): the C kernel over the pages (paged_attention.paged_prefill)
against what the cpu backend ran before it and still runs where the kernel does not apply (the
context gathered out of the pages, then torch's SDPA with a mask), for one request's prefill chunk
of Q tokens at the end of a context of L, with a model's head shapes; where the CPU has AVX512-BF16,
also the kernel with its dot products in bfloat16 (`bf16=True`).

    .venv/bin/python scripts/bench_prefill_attention.py [--shape tinyllama-1.1b] [--rounds 7] [--dtype float32]

The two alternate within each round; the table gives each one's median time and GFLOP/s (4 Hq D
times the query-key pairs the causal mask keeps, over it). The host's speed drifts: compare numbers
within one line.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvserve.kernels import cpu, paged_attention
from kvserve.attention.torch_backend import _prefill

SHAPES = {  # query heads, kv heads, head size
    "smollm2-135m": (9, 3, 64),
    "tinyllama-1.1b": (32, 4, 64),
    "llama-3.2-3b": (24, 8, 128),
}
CASES = ((512, 512), (256, 2048), (512, 1024), (512, 2048))  # (query tokens, context incl. them)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tinyllama-1.1b")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    hq, hkv, d = SHAPES[args.shape]
    dtype = getattr(torch, args.dtype)
    bs = args.block_size
    g = torch.Generator().manual_seed(0)
    print(f"{args.shape}: {hq} query heads, {hkv} kv heads, head size {d}, {args.dtype}, "
          f"{torch.get_num_threads()} threads, ISA level {cpu.isa_level()}")
    bf = paged_attention.bf16_products()
    print(f"{'Q x L':>12} {'C kernel ms':>12} {'GFLOP/s':>8} {'gather+SDPA ms':>15} {'GFLOP/s':>8} {'ratio':>6}"
          + (f" {'bf16 products ms':>17} {'GFLOP/s':>8} {'x kernel':>8}" if bf else ""))
    for q_len, length in CASES:
        nb = -(-length // bs) + 1
        kc, vc = (torch.randn(nb, bs, hkv, d, generator=g).to(dtype) for _ in range(2))
        table = torch.randperm(nb, generator=g)[None]
        q = torch.randn(q_len, hq, d, generator=g).to(dtype)
        starts, lens = torch.tensor([0, q_len]), torch.tensor([length])
        out = torch.empty_like(q)

        def kernel(bf16: bool = False):
            paged_attention.paged_prefill(q, kc, vc, table, starts, lens, 0, 1, d ** -0.5, None, out, bf16)

        def sdpa():
            ids = table[0, :-(-length // bs)]
            k, v = (c[ids].reshape(-1, hkv, d)[:length] for c in (kc, vc))
            return _prefill(q, k, v, length, d ** -0.5)

        paths = {"c": kernel, "sdpa": sdpa, **({"bf16": lambda: kernel(True)} if bf else {})}
        times: dict[str, list[float]] = {name: [] for name in paths}
        for fn in paths.values():
            fn()  # warm: first-touch pages, the kernel's build
        for _ in range(args.rounds):
            for name, fn in paths.items():
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
        kernel()
        err = float((out.float() - sdpa().float()).abs().max())
        flops = 4 * hq * d * (q_len * (length - q_len) + q_len * (q_len + 1) / 2)
        tc, ts = statistics.median(times["c"]), statistics.median(times["sdpa"])
        line = (f"{q_len:>5} x {length:<5} {tc * 1e3:>12.2f} {flops / tc / 1e9:>8.0f} {ts * 1e3:>15.2f} "
                f"{flops / ts / 1e9:>8.0f} {ts / tc:>5.2f}x")
        if bf:
            tb = statistics.median(times["bf16"])
            kernel(True)
            err_bf = float((out.float() - sdpa().float()).abs().max())
            line += f" {tb * 1e3:>17.2f} {flops / tb / 1e9:>8.0f} {tc / tb:>7.2f}x"
        print(line + f"   (max |difference| {err:.1e}" + (f", bf16 products {err_bf:.1e})" if bf else ")"))


if __name__ == "__main__":
    main()
