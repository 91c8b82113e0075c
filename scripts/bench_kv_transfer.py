"""Time one prompt's K/V going from a prefill engine's KVSender into a decode engine's KV blocks
(disagg/transport.py), over TCP (zmq) and shared memory (shm), for a model's block layout. The
sender runs in its own process, as a prefill engine's would; the time runs from the fetch until
the blocks are copied into place.

    .venv/bin/python scripts/bench_kv_transfer.py [--model PATH] [--tokens 1024,4096] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time

import torch

from kvserve.disagg.transport import KVSender, fetch

BLOCK = 16
HANDSHAKE = {"model": "bench", "block_size": BLOCK, "kv_dtype": "x", "block_shape": [], "fingerprint": "x"}


def serve(shape: tuple[int, ...], dtype: str, runs: int, conn) -> None:
    sender = KVSender("127.0.0.1", 0, HANDSHAKE, lease_s=600)
    data = torch.randn(shape).to(getattr(torch, dtype))
    ids = []
    for _ in range(runs):
        tid = sender.expect([b"h"] * shape[0])
        sender.put(tid, data)
        ids.append(tid)
    conn.send((sender.port, ids))
    conn.recv()  # until the parent is done
    sender.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="model whose block layout to use (default: the embedded model)")
    p.add_argument("--tokens", default="1024,4096")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    from kvserve.models.loader import default_model_path, open_checkpoint

    cfg = open_checkpoint(args.model or default_model_path()).config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    print(f"| tokens | MB | transport | ms (median of {args.runs}) | GB/s |")
    print("|---|---|---|---|---|")
    for n in map(int, args.tokens.split(",")):
        shape = (n // BLOCK, cfg.num_hidden_layers, 2, BLOCK, cfg.num_key_value_heads, head_dim)
        for transport in ("zmq", "shm"):
            parent, child = mp.Pipe()
            proc = mp.get_context("spawn").Process(target=serve, args=(shape, args.dtype, args.runs, child))
            proc.start()
            port, ids = parent.recv()
            times = []
            cache = torch.zeros(shape, dtype=getattr(torch, args.dtype))  # the decode engine's KV blocks
            for tid in ids:
                t = time.perf_counter()
                _, data = fetch("127.0.0.1", port, tid, HANDSHAKE, 60, transport)
                cache.copy_(data)  # as write_kv_blocks does: the time counts until the K/V are in place
                times.append(time.perf_counter() - t)
            parent.send("done")
            proc.join()
            mb = data.numel() * data.element_size() / 1e6
            ms = statistics.median(times) * 1000
            print(f"| {n} | {mb:.1f} | {transport} | {ms:.1f} | {mb / ms:.2f} |")


if __name__ == "__main__":
    main()
