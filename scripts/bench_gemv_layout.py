"""The decode GEMV alone (one token, the engine's threads) on real models' 4-bit weights, read from
DRAM: row-major blocks in each activation mode against rows interleaved by 8 with int16 activations
(qmatmul.relayout, what tuning's int16 choice runs).

    .venv/bin/python scripts/bench_gemv_layout.py [--shape tinyllama-1.1b|llama-3.2-3b] [--copies 4] [--rounds 12]

Weights: one layer's q, gate/up-sized and down-sized matrices in Q4_0's form (random nibbles,
float16 scales, no offsets; `--offsets`: Q4_1-like float32 scales and offsets; `--k-scales`: Q4_K's,
6-bit codes times a float16 per 256 weights, which Blocks keeps factored), `--copies`
times over, so together they are several times the L3 and each call reads from DRAM. The variants
alternate within each round; the median per variant is printed as ms per pass and GB/s of weights.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvserve.kernels import qmatmul

SHAPES = {  # (rows, columns) of q_proj, gate (or up) and down
    "tinyllama-1.1b": ((2048, 2048), (5632, 2048), (2048, 5632)),
    "llama-3.2-3b": ((3072, 3072), (8192, 3072), (3072, 8192)),
}


def weight(n: int, k: int, form: str, g: torch.Generator) -> qmatmul.Blocks:
    q = torch.randint(0, 16, (n, k), generator=g)
    if form == "k-scales":  # Q4_K: d sc and -dmin m, d / dmin float16 per 256 weights, sc / m 6-bit
        d, dmin = ((torch.rand(n, k // 256, 1, generator=g) * 1e-3 + 1e-4).half().float() for _ in range(2))
        sc, m = (torch.randint(0, 64, (n, k // 256, 8), generator=g).float() for _ in range(2))
        return qmatmul.Blocks.from_codes(q, (d * sc).view(n, -1), (-dmin * m).view(n, -1), 4)
    scale = (torch.rand(n, k // 32, generator=g) * 0.02 + 0.001).half().float()
    offset = torch.randn(n, k // 32, generator=g) * 0.01 if form == "offsets" else -8 * scale
    return qmatmul.Blocks.from_codes(q, scale, offset, 4)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-3b")
    p.add_argument("--copies", type=int, default=4)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--offsets", action="store_true")
    p.add_argument("--k-scales", action="store_true")
    a = p.parse_args()
    g = torch.Generator().manual_seed(0)
    form = "k-scales" if a.k_scales else "offsets" if a.offsets else "q4_0"
    rows = [weight(n, k, form, g) for _ in range(a.copies) for n, k in SHAPES[a.shape]]
    xs = [torch.randn(1, w.shape[1], generator=g) for w in rows]
    laid = [qmatmul.relayout(w, True) for w in rows]
    nbytes = sum(w.nbytes() for w in rows)
    variants = {f"row-major {mode}": (rows, mode) for mode in qmatmul.MODES}
    variants["interleaved int16"] = (laid, "int16")
    times: dict[str, list[float]] = {v: [] for v in variants}
    names = list(variants)
    for r in range(a.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            ws, mode = variants[name]
            t = time.perf_counter()
            for w, x in zip(ws, xs):
                qmatmul.matmul(x, w, mode)
            times[name].append(time.perf_counter() - t)
    print(f"{a.shape}: {len(rows)} weights, {nbytes / 1e6:.0f} MB, {torch.get_num_threads()} threads, "
          f"{ {'q4_0': 'no offsets, float16 scales', 'offsets': 'float32 scales and offsets'}.get(form, form)}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:20s} {med * 1e3:8.2f} ms  {nbytes / med / 1e9:6.1f} GB/s")


if __name__ == "__main__":
    main()
