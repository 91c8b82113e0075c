"""Prefill-sized batches on GGUF K-quant rows (issue 30): int8 activations against the codes
(kquant.matmul_int8) against the dense paths tuning also weighs (dequantize, then F.linear in
float32 and in bfloat16), on a Q4_K_M file's K-quant linears' shapes.

    .venv/bin/python scripts/bench_kquant_prefill.py [--shape tinyllama-1.1b] [--rows 256] [--rounds 7]

The weights are random K-quant rows with sane scales (speed does not depend on the values). The
paths alternate within each round and the table gives each one's median time and GOPS (2 N K M
over it). The host's speed drifts: compare numbers within one line.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from kvserve.kernels import kquant

# per model: (name, [(qtype, rows)], K): the K-quant linears of a Q4_K_M file as the loader keeps
# them (ffn_down and attn_v in Q6_K; q and k beside a Q6_K v go to qmatmul's blocks), and a fused
# weight of mixed parts (as a file whose q/k/v are all K-quants other than Q4_K would give)
SHAPES = {
    "tinyllama-1.1b": [("ffn_down Q6_K", [(kquant.Q6_K, 2048)], 5632), ("attn_v Q6_K", [(kquant.Q6_K, 256)], 2048),
                       ("qkv Q4_K+Q4_K+Q6_K", [(kquant.Q4_K, 2048), (kquant.Q4_K, 256), (kquant.Q6_K, 256)], 2048)],
    "llama-3.2-3b": [("ffn_down Q6_K", [(kquant.Q6_K, 3072)], 8192), ("attn_v Q6_K", [(kquant.Q6_K, 1024)], 3072),
                     ("qkv Q4_K+Q4_K+Q6_K", [(kquant.Q4_K, 3072), (kquant.Q4_K, 1024), (kquant.Q6_K, 1024)], 3072)],
}


def random_rows(qtype: int, n: int, k: int, seed: int) -> torch.Tensor:
    """uint8 [n, row bytes]: random bytes, the float16 scales set to ~0.01 (Q6_K: d; Q4_K / Q5_K: d, dmin)."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n, k // 256, kquant.BLOCK_BYTES[qtype]), dtype=torch.uint8, generator=g)
    scale = torch.tensor([0.01], dtype=torch.float16).view(torch.uint8)
    if qtype == kquant.Q6_K:
        raw[:, :, 208:210] = scale
    else:
        raw[:, :, 0:2] = scale
        raw[:, :, 2:4] = scale
    return raw.reshape(n, -1).contiguous()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="tinyllama-1.1b")
    p.add_argument("--rows", type=int, default=256, help="tokens in the batch (a prefill chunk)")
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args()
    if kquant.load() is None:
        raise SystemExit("the K-quant C kernel did not build here")
    print(f"{args.shape}, {args.rows} tokens, {torch.get_num_threads()} threads, median of {args.rounds} rounds")
    for name, parts, k in SHAPES[args.shape]:
        rows = [(q, random_rows(q, n, k, seed=i)) for i, (q, n) in enumerate(parts)]
        m = kquant.make_matrix(rows, k)
        n = kquant.num_rows(m)
        x = torch.randn(args.rows, k, generator=torch.Generator().manual_seed(0))
        paths = {"dense float32": lambda: F.linear(x, kquant.dequantize(m, torch.float32, reuse=True)),
                 "dense bfloat16": lambda: F.linear(x.bfloat16(), kquant.dequantize(m, torch.bfloat16, reuse=True))}
        if kquant.int8_applies(m):
            paths["int8 codes"] = lambda: kquant.matmul_int8(x, m)
        times: dict[str, list[float]] = {p: [] for p in paths}
        for _ in range(args.rounds):
            for label, fn in paths.items():
                fn()
                t = time.perf_counter()
                fn()
                times[label].append(time.perf_counter() - t)
        cells = []
        for label, ts in times.items():
            med = statistics.median(ts)
            cells.append(f"{label} {med * 1e3:.2f} ms ({2 * n * k * args.rows / med / 1e9:.0f} GOPS)")
        print(f"{name} [{n} x {k}]: " + " | ".join(cells))


if __name__ == "__main__":
    main()
