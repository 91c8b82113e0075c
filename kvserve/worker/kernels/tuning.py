"""Choose dtype and linear kernels by measuring them on this machine, on the model's own shapes.

Two decisions, both cached as JSON under `<cache_dir>/tuning/` keyed by the CPU (model name and
flags), the C kernels' ISA level, the torch version and the shapes measured, and each logged in
one line that says what was chosen and the times that chose it (the linears' key also holds the
kernels' source, so a changed kernel is measured again):

- `choose_dtype` (before the model is built, for `--dtype auto` on a CPU): float32 or bfloat16
  (float16 too where the CPU computes it natively), by the time of a dense linear of the model's
  hidden x intermediate shape at a decode-sized (1 row) and a prefill-sized (256 rows) batch; a
  lower precision than float32 only when clearly faster (`pick_dtype`).
- `tune_linears` (after loading, for linears stored as Blocks): int8 or float32 activations for
  the quantized kernel (by its time at 1 row; int8 only with KVSERVE_INT8_ACTIVATIONS=1), and per
  weight shape the batch size from which
  dequantizing and one dense matmul beat the quantized kernel.

`choose` is the selection rule alone, unit-tested with injected timings.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.worker.kernels import build, cpu, qmatmul

logger = logging.getLogger(__name__)

DECODE_ROWS, PREFILL_ROWS = 1, 256
LOWER_PRECISION_GAIN = 1.25  # pick_dtype: how much faster than float32 a lower precision must be
GRID = (2, 4, 8, 16, 32, 64, 128, 256)  # batch sizes at which the dense path is tried against the kernel
NEVER = 1 << 30  # dense_from when the kernel wins at every size measured
DEFAULT_DENSE_FROM = 32  # before (or without) tuning
TUNING_ENV = "KVSERVE_KERNEL_TUNING"  # "off": no measuring; float32 activations, the defaults above
# "1": int8 activations are a candidate. Off by default: within perplexity bounds (+0.35% on the
# default model) but they turned the default model's greedy answer to a plain chat question wrong.
INT8_ENV = "KVSERVE_INT8_ACTIVATIONS"


def int8_allowed() -> bool:
    return os.environ.get(INT8_ENV, "0") == "1"


def enabled() -> bool:
    return os.environ.get(TUNING_ENV, "auto").lower() != "off"


def _time(fn: Callable[[], object], reps: int = 3) -> float:
    """Best of `reps` timed calls after one warm-up, in seconds."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def _cache_path(kind: str, what: object) -> Path:
    key = json.dumps([kind, cpu.cpu_model(), sorted(cpu.cpu_flags()), cpu.isa_level(), torch.__version__,
                      torch.get_num_threads(), what], default=str)
    return build.cache_dir() / "tuning" / f"{kind}_{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _cached(kind: str, what: object, measure: Callable[[], dict]) -> tuple[dict, str]:
    """measure() once per key; ('cached' or 'measured') tells the log line which it was."""
    path = _cache_path(kind, what)
    try:
        return json.loads(path.read_text()), "cached"
    except (OSError, ValueError):
        pass
    result = measure()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(result, indent=1))
        os.replace(tmp, path)
    except OSError as e:
        logger.debug("tuning cache %s not written: %s", path, e)
    return result, "measured"


def dtype_candidates() -> list[torch.dtype]:
    """float32 and bfloat16 everywhere; float16 only where the CPU has float16 arithmetic."""
    flags = cpu.cpu_flags()
    extra = [torch.float16] if {"avx512_fp16", "amx_fp16"} & flags else []
    return [torch.float32, torch.bfloat16, *extra]


def choose_dtype(hidden: int, intermediate: int) -> torch.dtype:
    """The fastest activation dtype here for a model of these sizes (see the module docstring)."""
    names = [dtype_name(d) for d in dtype_candidates()]
    if not enabled():
        flags = cpu.cpu_flags()
        return torch.bfloat16 if {"avx512_bf16", "amx_bf16"} & flags else torch.float32

    def measure() -> dict:
        g = torch.Generator().manual_seed(0)
        w32 = torch.randn(intermediate, hidden, generator=g) * 0.02
        x32 = torch.randn(PREFILL_ROWS, hidden, generator=g)
        times = {}
        for name in names:
            dt = getattr(torch, name)
            w, x = w32.to(dt), x32.to(dt)
            times[name] = {str(rows): _time(lambda w=w, x=x, r=rows: F.linear(x[:r], w))
                           for rows in (DECODE_ROWS, PREFILL_ROWS)}
        return {"times": times}

    result, how = _cached("dtype", [hidden, intermediate, names], measure)
    times = result["times"]
    best = pick_dtype(times)
    logger.info("dtype auto -> %s (%s; linear %dx%d: %s)", best, how, intermediate, hidden,
                ", ".join(f"{n} {times[n][str(DECODE_ROWS)] * 1e6:.0f} us at 1 row / "
                          f"{times[n][str(PREFILL_ROWS)] * 1e3:.2f} ms at {PREFILL_ROWS}" for n in names))
    return getattr(torch, best)


def pick_dtype(times: dict[str, dict[str, float]]) -> str:
    """The rule for `--dtype auto`: the dtype with the least time per token (one decode-sized plus
    one prefill-sized token, times[name][rows] seconds), where a lower precision than float32 must
    be at least LOWER_PRECISION_GAIN times faster to be taken. It costs accuracy (the default
    model's greedy answers change in bfloat16), and a near tie is within the noise of a one-off
    measurement that is then cached: on an AVX2 CPU bfloat16 halves the bytes a 1-row matmul reads
    but is several times slower at 256 rows, so a noisy decode timing alone could choose it."""
    def cost(name: str) -> float:
        t = times[name]
        return t[str(DECODE_ROWS)] / DECODE_ROWS + t[str(PREFILL_ROWS)] / PREFILL_ROWS

    best = min(times, key=cost)
    if best != "float32" and "float32" in times and cost(best) * LOWER_PRECISION_GAIN > cost("float32"):
        return "float32"
    return best


def choose(times: dict, counts: dict[str, int], allow_int8: bool = True) -> dict:
    """The rule, from timings: times[shape][path][rows] seconds, path in 'float32' / 'int8' (the
    kernel with those activations) and 'dense'; counts[shape]: how many linears have that shape.

    Activations: int8 if the model's linears at DECODE_ROWS take less time with int8 (and it is
    allowed). dense_from[shape]: the smallest measured batch size from which the dense path is at
    least as fast as the kernel at it and every larger size measured; NEVER if there is none.
    """
    def total(mode: str) -> float:
        return sum(counts[s] * times[s][mode][str(DECODE_ROWS)] for s in times)

    act = "int8" if allow_int8 and total("int8") < total("float32") else "float32"
    dense_from = {}
    for shape, t in times.items():
        rows = sorted(int(r) for r in t["dense"])
        from_ = NEVER
        for r in reversed(rows):
            if t["dense"][str(r)] > t[act][str(r)]:
                break
            from_ = r
        dense_from[shape] = from_
    return {"activations": act, "dense_from": dense_from}


def _shape_key(m: nn.Module) -> str:
    return f"{m.out_features}x{m.in_features}:{m.bits}bit"


def tune_linears(model: nn.Module, dtype: torch.dtype, allow_int8: bool | None = None) -> dict | None:
    """Measure and set each Blocks linear's `activations` and `dense_from`; None if there are none."""
    mods = [m for m in model.modules() if getattr(m, "path", None) == "blocks"]
    if not mods or not enabled() or qmatmul.load() is None:
        return None
    by_shape: dict[str, nn.Module] = {}
    counts: dict[str, int] = {}
    for m in mods:
        by_shape.setdefault(_shape_key(m), m)
        counts[_shape_key(m)] = counts.get(_shape_key(m), 0) + 1

    def measure() -> dict:
        times = {}
        for key, m in by_shape.items():
            w = m.blocks()
            x = torch.randn(GRID[-1], m.in_features, generator=torch.Generator().manual_seed(0))
            xd = x.to(dtype)
            t = {"float32": {}, "int8": {}, "dense": {}}
            for rows in (DECODE_ROWS, *GRID):
                for mode in qmatmul.MODES:
                    t[mode][str(rows)] = _time(lambda r=rows, mode=mode: qmatmul.matmul(x[:r], w, mode))
                if rows in GRID:
                    t["dense"][str(rows)] = _time(lambda r=rows: F.linear(xd[:r], qmatmul.dequantize(w).to(dtype)))
            times[key] = t
        return {"times": times}

    # the kernels' source is part of the key: a changed kernel is measured again
    source = hashlib.sha256(qmatmul.SOURCE.encode()).hexdigest()[:16]
    result, how = _cached("linears", [sorted(by_shape), str(dtype), source], measure)
    chosen = choose(result["times"], counts, int8_allowed() if allow_int8 is None else allow_int8)
    for m in mods:
        m.activations = chosen["activations"]
        m.dense_from = chosen["dense_from"][_shape_key(m)]
    t1 = {mode: sum(counts[s] * result["times"][s][mode][str(DECODE_ROWS)] for s in counts) for mode in qmatmul.MODES}
    logger.info("linears: %d quantized (%s); %s activations (all linears at 1 row: int8 %.2f ms, float32 %.2f ms); "
                "dense %s from %s rows", len(mods), how, chosen["activations"], t1["int8"] * 1e3,
                t1["float32"] * 1e3, dtype_name(dtype),
                ", ".join(f"{s}: {'never' if v == NEVER else v}" for s, v in chosen["dense_from"].items()))
    return chosen


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
