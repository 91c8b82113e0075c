"""Time the C kernels alone: the blocks matmul (qmatmul) against torch on the dequantized weight,
and paged decode attention, on the default model's shapes.

    .venv/bin/python scripts/bench_kernels.py [--rows 1,12,64,256,2048] [--reps 7]

Blocks weights are random codes in the default model's layouts (Q4 blocks for the layers' linears,
Q8 for the 49152-row LM head); each time is the best of --reps calls after a warm-up. Attention:
requests of 500 positions in a float32 cache, blocks in random order, 9 query / 3 kv heads of 64.
The host's speed can drift between lines: compare numbers within one line.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kvserve.kernels import paged_attention
from kvserve.kernels import qmatmul

def best(fn: Callable[[], object], reps: int) -> float:
    """Best of `reps` timed calls after one warm-up, in seconds."""
    fn()
    t_best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        t_best = min(t_best, time.perf_counter() - t)
    return t_best


SHAPES = ((960, 576, 4), (576, 576, 4), (3072, 576, 4), (576, 1536, 4), (49152, 576, 8))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,4,12,64,256,2048")
    p.add_argument("--reps", type=int, default=7)
    args = p.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    g = torch.Generator().manual_seed(0)
    print(f"threads {torch.get_num_threads()}")
    for n, k, bits in SHAPES:
        q = torch.randint(0, 2 ** bits, (n, k), generator=g)
        w = qmatmul.Blocks.from_codes(q, torch.rand(n, k // 32, generator=g) * 0.01,
                                      torch.randn(n, k // 32, generator=g) * 0.01, bits)
        dense = qmatmul.dequantize(w)
        for m in rows:
            if n * m > 49152 * 256:  # the LM head runs on decode batches only
                continue
            x = torch.randn(m, k, generator=g)
            tk = best(lambda: qmatmul.matmul(x, w, "float32"), args.reps)
            td = best(lambda: F.linear(x, dense), args.reps)
            tq = best(lambda: F.linear(x, qmatmul.dequantize(w)), args.reps)
            gf = 2 * n * k * m / 1e9
            print(f"{n}x{k} Q{bits} rows {m:5d}: blocks kernel {tk * 1e3:8.2f} ms {gf / tk:6.1f} GFLOPS | "
                  f"torch on the dequantized weight {td * 1e3:8.2f} ms {gf / td:6.1f} | "
                  f"dequantize + torch {tq * 1e3:8.2f} ms")
    for b, hq, hkv in ((1, 9, 3), (44, 9, 3), (132, 3, 1)):
        ctx, d, bs = 500, 64, 16
        nblk = b * (ctx // bs + 1)
        tables = torch.randperm(nblk, generator=g).view(b, -1)
        lens = torch.full((b,), ctx, dtype=torch.int64)
        qv = torch.randn(b, hq, d, generator=g)
        kc, vc = (torch.randn(nblk, bs, hkv, d, generator=g) * 0.3 for _ in range(2))
        t = best(lambda: paged_attention.paged_decode(qv, kc, vc, tables, lens, ctx, d ** -0.5), args.reps)
        print(f"decode attention {b:3d} requests x {ctx} positions, {hq} q / {hkv} kv heads: {t * 1e3:7.2f} ms "
              f"({t / (b * ctx * hkv) * 1e9:.1f} ns per position and kv head)")


if __name__ == "__main__":
    main()
