"""Where a single stream's decode time goes, by kind of weight: every decoder linear of a model
called at one row in the model's order (so each reads its weight from DRAM, as a decode step
does), then the LM head, timed per call and summed by kind (issue 30).

    .venv/bin/python scripts/profile_linears.py --model FILE.gguf [--passes 5] [--threads 2]

Each linear runs through its module's forward (the layer-by-layer path: the same kernels as the
C decode stack, plus ~10-20 us of Python per call, which the table's call count lets you weigh).
The kind names the module and, for a GGUF K-quant linear read in place (kquant.c) or a stacked
one, its parts' GGML types. GB/s is the weight bytes the calls read over their time: against
`kvserve env`'s read bandwidth it says which kernels keep up with memory and which are bound by
their own arithmetic (compare with the same weights hot in cache: `--hot`).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch


def kind(mod: torch.nn.Module) -> str:
    """The module's class; a GGUF K-quant linear's GGML types, a stacked linear's parts."""
    kern = getattr(mod, "kernel", mod)
    name = type(kern).__name__
    if getattr(kern, "qtypes", None):
        from gguf import GGMLQuantizationType

        return f"{name}({','.join(GGMLQuantizationType(t).name for t in kern.qtypes)})"
    if getattr(kern, "kernels", None):
        return f"{name}({' + '.join(kind(k) for k in kern.kernels)})"
    return name


def weight_bytes(mod: torch.nn.Module) -> int:
    return sum(b.numel() * b.element_size() for b in mod.buffers()) + \
        sum(p.numel() * p.element_size() for p in mod.parameters())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: the embedded model)")
    ap.add_argument("--passes", type=int, default=5, help="passes over all linears after a warm-up (median)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--hot", action="store_true", help="each linear called 20 times in a row (weights in cache)")
    a = ap.parse_args()
    from kvserve import LLM
    from kvserve.kernels import cpu

    torch.set_num_threads(a.threads)
    llm = LLM(model=a.model, kv_cache_memory="256MiB", max_model_len=512)
    model = llm.engine.executor.worker.runner.model
    calls = []
    for layer in model.model.layers:
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            mod = layer.get_submodule(name)
            k = getattr(mod, "kernel", mod).in_features
            calls.append((f"{name.split('.')[-1]} {kind(mod)}", mod, torch.randn(1, k), weight_bytes(mod)))
    head = getattr(model, "lm_head", None)
    if head is not None:
        k = getattr(getattr(head, "kernel", head), "in_features", None) or model.config.hidden_size
        calls.append((f"lm_head {kind(head)}", head.compute_logits, torch.randn(1, k), weight_bytes(head)))
    reps = 20 if a.hot else 1
    per_pass: dict[str, list[float]] = defaultdict(list)
    nbytes: dict[str, int] = defaultdict(int)
    count: dict[str, int] = defaultdict(int)
    with torch.inference_mode():
        for p in range(a.passes + 1):
            spent: dict[str, float] = defaultdict(float)
            for label, mod, x, b in calls:
                t = time.perf_counter()
                for _ in range(reps):
                    mod(x)
                spent[label] += (time.perf_counter() - t) / reps
                if p == 0:
                    nbytes[label] += b
                    count[label] += 1
            if p:  # the first pass warms up
                for label, s in spent.items():
                    per_pass[label].append(s)
    flags = " ".join(cpu.reported_flags())
    print(f"cpu {cpu.cpu_model()} ({flags}); {a.threads} threads; "
          f"model {a.model or 'default'}; {'hot' if a.hot else 'streaming'}; median of {a.passes} passes")
    print(f"{'linear and kind':48s} {'calls':>5s} {'ms/token':>9s} {'MiB':>8s} {'GB/s':>6s}")
    total_t = total_b = 0.0
    for label in sorted(per_pass, key=lambda s: -statistics.median(per_pass[s])):
        t = statistics.median(per_pass[label])
        total_t, total_b = total_t + t, total_b + nbytes[label]
        print(f"{label:48s} {count[label]:5d} {t * 1e3:9.2f} {nbytes[label] / 2**20:8.1f} {nbytes[label] / t / 1e9:6.1f}")
    print(f"{'all':48s} {sum(count.values()):5d} {total_t * 1e3:9.2f} {total_b / 2**20:8.1f} {total_b / total_t / 1e9:6.1f}")


if __name__ == "__main__":
    main()
