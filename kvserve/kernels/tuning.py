"""Choose dtype and linear kernels by measuring them on this machine, on the model's own shapes.

Four decisions, each cached as JSON under `<cache_dir>/tuning/` keyed by the CPU (model name and
flags), the C kernels' ISA level, the torch version, the threads and the shapes measured (the
linears' keys also hold the kernels' source, so a changed kernel is measured again):

- `choose_dtype` (before the model is built, for `--dtype auto` on a CPU): float32 or bfloat16
  (float16 too where the CPU computes it natively), by the time of a dense linear of the model's
  hidden x intermediate shape at a decode-sized (1 row) and a prefill-sized (256 rows) batch;
  float32 without measuring when the linears stay compressed in the float32 kernels.
- `tune_linears` (after loading, for linears stored as Blocks): int8 or float32 activations for
  the quantized kernel (int8 where the C kernels lack VNNI, or with KVSERVE_INT8_ACTIVATIONS=1,
  and then only INT8_GAIN faster than int16); per weight shape the batch
  size from which dequantizing and one dense matmul beat the kernel (`dense_from`); and, for a
  float32 model on a CPU with bfloat16 arithmetic, whether that dense (prefill) matmul runs in
  bfloat16 (`dense_dtype`), so decode and prefill each get their own measured choice; or, for
  4-bit weights whose decode runs int16 codes, from which batch size the kernel runs int8 codes
  (`int8_from`: half the products' instructions of int16, and no dequantized copy), below the
  dense matmul's range (KVSERVE_PREFILL_INT8=0 turns it off).
- `tune_kquant_linears` (for linears over raw GGUF K-quant rows): the same `dense_from`,
  `dense_dtype` and `int8_from` by the same rule, the K-quant kernel in the place of the activation
  modes, int8 activations against the K-quant codes (kquant.matmul_int8) as the int8 prefill path.
- `choose_prefill_attention` (for the cpu attention backend, on the model's head shapes): the C
  prefill attention kernel or torch's SDPA over the gathered context.

One noisy run must not decide for every later start: the candidates are timed interleaved over
rounds and the cached entries re-checked at start (evidence.py). And a choice against the CPU's
features needs a clear margin (`gain`, `_path_gain`): a 16-bit dtype without native arithmetic
FOREIGN_GAIN, one with it LOWER_PRECISION_GAIN (it costs accuracy), the dense path at
decode-sized batches SMALL_DENSE_GAIN. Each decision is logged in one line: what was chosen, the
medians that chose it, their spread, and whether the cache was used or why it was not.

`pick_dtype` and `choose` are the rules alone, unit-tested with injected timings.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.kernels import build, cpu, kquant, qmatmul
from kvserve.kernels.evidence import SpotPair, decide, entry_noise, spot_check, time_interleaved

logger = logging.getLogger(__name__)

DECODE_ROWS, PREFILL_ROWS = 1, 256
GRID = (2, 4, 8, 16, 32, 64, 128, 256)  # batch sizes at which the dense path is tried against the kernel
NEVER = 1 << 30  # dense_from when the kernel wins at every size measured
DEFAULT_DENSE_FROM = 32  # before (or without) tuning
LOWER_PRECISION_GAIN = 1.25  # how much faster than float32 a native lower precision must be
FOREIGN_GAIN = 2.0  # ... and one this CPU has no arithmetic for (emulated: a fast reading is suspect)
SMALL_DENSE_GAIN, SMALL_BATCH = 1.5, 8  # dense over the compressed kernel at up to SMALL_BATCH rows
# The bfloat16 dense path serves prefill-sized batches only, however fast it measures below: a step
# of fewer rows is decode (a batch of streams, or a stream's verify rows), whose tokens keep the
# kernel's float32-class arithmetic, so they do not move with how many others share their step
# (bfloat16 moved the default model's logprobs by up to 0.037; with AMX it can win from 4 rows).
BF16_DENSE_MIN_ROWS = 16
# quantized activations (int8, int16) over exact float ones: they cost precision, and at 1 row on a
# busy machine the modes tie within noise (thread wake-ups dominate), where float32 should stay
ACT_GAIN = 1.1
# The /proc/cpuinfo flags of native arithmetic for each 16-bit dtype.
NATIVE = {"bfloat16": frozenset({"avx512_bf16", "amx_bf16"}), "float16": frozenset({"avx512_fp16", "amx_fp16"})}
TUNING_ENV = "KVSERVE_KERNEL_TUNING"  # "off": no measuring; float32 activations, the defaults above
# "1": int8 activations are a decode candidate on every CPU, "0": on none. Unset: where the C
# kernels have no VNNI (INT8_DEFAULT_LEVELS). There int16 codes cost twice int8's byte products
# (vpmaddubsw) plus the adds that widen them, and a one-token step is bound by those instructions
# whenever the memory keeps up: a 1.1B Q4_K_M decoded 47.4 tok/s on int16 codes and 55.2 on int8
# under the AVX2 build (Zen 4, the memory fast; BENCHMARKS.md), as llama.cpp's int8 activations do.
# With VNNI the int16 codes' extra products are one more vpdpbusd each and their decode ran within 3%
# of int8's, so int16 (relative error ~2e-5 against int8's ~5e-3; +0.35% perplexity on the default
# model) stays.
INT8_ENV = "KVSERVE_INT8_ACTIVATIONS"
# The C kernels' ISA levels (cpu.LEVELS) where int8 decode activations are a candidate by default.
INT8_DEFAULT_LEVELS = frozenset({"avx2", "avx512"})
# int8 over int16 activations: both quantize, but int8 costs ~250x the rounding error, so it must win
# by this much more than int16 must over float32 (ACT_GAIN)
INT8_GAIN = 1.1
# "0": prefill-sized batches never take int8 codes (PREFILL_INT8); by default they do where measured faster
PREFILL_INT8_ENV = "KVSERVE_PREFILL_INT8"


def _switch(name: str) -> bool | None:
    """An on/off environment variable: True for "1" / "on", False for "0" / "off", else None."""
    value = os.environ.get(name, "").strip().lower()
    return True if value in ("1", "on") else False if value in ("0", "off") else None


def int8_allowed() -> bool:
    """Whether int8 activations are a decode candidate: INT8_ENV "1" / "0", else by the C kernels'
    ISA level (INT8_DEFAULT_LEVELS)."""
    switch = _switch(INT8_ENV)
    return cpu.isa_level() in INT8_DEFAULT_LEVELS if switch is None else switch


def prefill_int8_allowed() -> bool:
    return _switch(PREFILL_INT8_ENV) is not False


def enabled() -> bool:
    return os.environ.get(TUNING_ENV, "auto").lower() != "off"


def native(name: str, flags: frozenset[str]) -> bool:
    """Whether a CPU with `flags` computes in dtype `name` natively (float32 always does)."""
    return name == "float32" or bool(NATIVE.get(name, frozenset()) & flags)


def gain(name: str, flags: frozenset[str]) -> float:
    """How many times faster than float32 dtype `name` must be to be taken on a CPU with `flags`."""
    if name == "float32":
        return 1.0
    return LOWER_PRECISION_GAIN if native(name, flags) else FOREIGN_GAIN


# ---- the dtype ------------------------------------------------------------------------------

def dtype_candidates() -> list[torch.dtype]:
    """float32 and bfloat16 everywhere; float16 only where the CPU has float16 arithmetic."""
    extra = [torch.float16] if native("float16", cpu.cpu_flags()) else []
    return [torch.float32, torch.bfloat16, *extra]


def _per_token(t: dict[str, float]) -> float:
    return t[str(DECODE_ROWS)] / DECODE_ROWS + t[str(PREFILL_ROWS)] / PREFILL_ROWS


def _dtype_ranking(times: dict[str, dict[str, float]], flags: frozenset[str]) -> list[str]:
    return sorted(times, key=lambda n: _per_token(times[n]) * gain(n, flags))


def pick_dtype(times: dict[str, dict[str, float]], flags: frozenset[str]) -> str:
    """The rule for `--dtype auto`: the dtype with the least time per token (one decode-sized plus
    one prefill-sized token, times[name][rows] seconds), where a dtype other than float32 must be
    gain(name, flags) times faster: it costs accuracy (the default model's greedy answers change in
    bfloat16), and without native arithmetic a fast reading is more likely noise than truth (on an
    AVX2 CPU bfloat16 halves the bytes a 1-row matmul reads but is 5x slower at 256 rows)."""
    return _dtype_ranking(times, flags)[0]


def choose_dtype(hidden: int, intermediate: int, float32_kernels: bool = False) -> torch.dtype:
    """The fastest activation dtype here for a model of these sizes (see the module docstring).

    float32_kernels: the model's linears run compressed in kernels that compute in float32 (GGUF
    blocks and K-quant rows, AWQ / GPTQ / int8 codes): float32, without measuring. A dense linear's
    timing says nothing about that model: its linears compute in float32 whatever the dtype, the
    C decode stack runs float32 models only, the dense prefill path takes bfloat16 per shape where
    it wins (tune_linears' dense_dtype), and the rest of a step in bfloat16 only adds conversions.
    On a Zen 4 with AVX512-BF16 (where a dense bfloat16 linear won 3x at 256 rows) a 1.1B Q4_0
    GGUF decoded at 25 tok/s in bfloat16 and 37 in float32, with equal prefill (BENCHMARKS.md)."""
    if float32_kernels:
        logger.info("dtype auto -> float32 (the linears run in the float32 CPU kernels)")
        return torch.float32
    flags = cpu.cpu_flags()
    names = [dtype_name(d) for d in dtype_candidates()]
    if not enabled():
        return torch.bfloat16 if native("bfloat16", flags) else torch.float32
    made: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def linear(name: str, rows: int) -> Callable[[], object]:
        if name not in made:  # built on first need: a cached, agreeing entry times only two dtypes
            g = torch.Generator().manual_seed(0)
            w, x = torch.randn(intermediate, hidden, generator=g) * 0.02, torch.randn(PREFILL_ROWS, hidden, generator=g)
            made[name] = (w.to(getattr(torch, name)), x.to(getattr(torch, name)))
        w, x = made[name]
        return lambda: F.linear(x[:rows], w)

    def measure() -> dict:
        times: dict[str, dict[str, float]] = {n: {} for n in names}
        noise: dict[str, dict[str, float]] = {n: {} for n in names}
        for rows in (DECODE_ROWS, PREFILL_ROWS):
            got = time_interleaved({n: linear(n, rows) for n in names}, str(rows), {n: gain(n, flags) for n in names})
            for n, s in got.items():
                times[n][str(rows)], noise[n][str(rows)] = s["median"], s["spread"]
        return {"times": times, "noise": noise}

    def spot(entry: dict) -> str | None:
        t = entry["times"]
        best, runner = _dtype_ranking(t, flags)[:2]
        return spot_check([(str(r), best, linear(best, r), runner, linear(runner, r),
                            t[best][str(r)] / t[runner][str(r)]) for r in (DECODE_ROWS, PREFILL_ROWS)])

    entry, how = decide("dtype", [hidden, intermediate, names], measure, spot)
    times = entry["times"]
    best = pick_dtype(times, flags)
    logger.info("dtype auto -> %s (%s; rounds spread %.0f%%; linear %dx%d: %s)", best, how,
                100 * entry_noise(entry), intermediate, hidden,
                ", ".join(f"{n} {times[n][str(DECODE_ROWS)] * 1e6:.0f} us at 1 row / "
                          f"{times[n][str(PREFILL_ROWS)] * 1e3:.2f} ms at {PREFILL_ROWS}" for n in names))
    return getattr(torch, best)


# ---- the quantized linears ------------------------------------------------------------------

def _path_gain(path: str, rows: int, flags: frozenset[str]) -> float:
    """The margin a path must win by at `rows` (ACT_GAIN for quantized activations): the dense paths
    at decode-sized batches read 4-8x the bytes of the compressed kernel, so a reading there that
    favours them is suspect."""
    if path == "float32":
        return 1.0
    if path == "int8":
        return ACT_GAIN * INT8_GAIN
    if not path.startswith("dense"):
        return ACT_GAIN
    g = SMALL_DENSE_GAIN if rows <= SMALL_BATCH else 1.0
    return g * gain("bfloat16", flags) if path == "dense_bf16" else g


def _dense_dtype(t: dict[str, dict[str, float]], flags: frozenset[str]) -> str | None:
    """'bfloat16' if the bfloat16 dense path (where measured) beats the float32 one with its margin
    over the batch sizes measured (a sum: prefill-sized batches weigh most); None: the model's dtype."""
    if "dense_bf16" not in t:
        return None
    rows = [r for r in t["dense_bf16"] if r in t["dense"]]
    bf16, f32 = sum(t["dense_bf16"][r] for r in rows), sum(t["dense"][r] for r in rows)
    return "bfloat16" if rows and bf16 * gain("bfloat16", flags) <= f32 else None


PREFILL_INT8 = "prefill_int8"  # the path: int8 codes (interleaved 4-bit rows, or K-quant rows), at GRID rows


def _int8_rows(t: dict[str, dict[str, float]], act: str) -> set[int]:
    """The measured batch sizes int8 codes (PREFILL_INT8) may run: BF16_DENSE_MIN_ROWS rows or more
    where they are LOWER_PRECISION_GAIN times faster than each float32-class path (the kernel in
    `act`, the dense float32 matmul; +0.35% perplexity for int8 on the default model, BENCHMARKS.md)."""
    return {int(k) for k, v in t.get(PREFILL_INT8, {}).items()
            if int(k) >= BF16_DENSE_MIN_ROWS and v * LOWER_PRECISION_GAIN <= min(t[act][k], t["dense"][k])}


def choose(times: dict, counts: dict[str, int], allow_int8: bool = True, flags: frozenset[str] = frozenset(),
           allow_prefill_int8: bool = True) -> dict:
    """The rule, from timings: times[shape][path][rows] seconds, path one of qmatmul.MODES (the
    kernel with those activations), 'dense' (the model's dtype) and, where measured, 'dense_bf16'
    and PREFILL_INT8 (the kernel with int8 codes); counts[shape]: how many linears have that shape;
    flags: the CPU's.

    Activations: the mode in which the model's linears at DECODE_ROWS take the least time, a
    quantized one only when ACT_GAIN times faster than float32, int8 (only when allowed) also
    INT8_GAIN times faster than int16.
    Per shape, three ranges of batch size: the kernel in those activations, then int8 codes from
    int8_from[shape], then one dense matmul from dense_from[shape] (NEVER where a range is empty).
    dense_dtype[shape]: `_dense_dtype`. dense_from: the smallest measured batch size from which the
    dense path (in that dtype) is at least as fast as the kernel (SMALL_DENSE_GAIN times faster up
    to SMALL_BATCH rows; in bfloat16 never below BF16_DENSE_MIN_ROWS) and as int8 codes where those
    may run (`_int8_rows`), at it and every larger size measured. int8_from: where the
    kernel runs int16 or int8 activations at decode (weights laid out for them), the smallest
    measured size below dense_from from which int8 codes may run at every size up to dense_from.
    So on a CPU whose bfloat16 matmul is fast (AMX), int8 codes take the mid-sized batches and the
    dense matmul the large ones, whose dequantizing it pays once for many rows."""
    def total(mode: str) -> float:
        return sum(counts[s] * times[s][mode][str(DECODE_ROWS)] for s in times)

    modes = sorted({p for t in times.values() for p in t if p in qmatmul.MODES and (allow_int8 or p != "int8")})
    act = min(modes, key=lambda p: total(p) * _path_gain(p, DECODE_ROWS, flags)) if modes else "float32"
    int8_ok = allow_prefill_int8 and act in ("int16", "int8")
    dense_from, dense_dtype, int8_from = {}, {}, {}
    for shape, t in times.items():
        dense_dtype[shape] = _dense_dtype(t, flags)
        path = "dense_bf16" if dense_dtype[shape] else "dense"
        i8 = _int8_rows(t, act) if int8_ok else set()
        from_ = NEVER
        for r in sorted((int(r) for r in t[path]), reverse=True):
            k = str(r)
            if t[path][k] * _path_gain("dense", r, flags) > t[act][k] or \
                    (path == "dense_bf16" and r < BF16_DENSE_MIN_ROWS) or (r in i8 and t[PREFILL_INT8][k] < t[path][k]):
                break
            from_ = r
        dense_from[shape], int8_from[shape] = from_, NEVER
        for r in sorted((int(k) for k in t.get(PREFILL_INT8, {}) if int(k) < from_), reverse=True):
            if r not in i8:
                break
            int8_from[shape] = r
    return {"activations": act, "dense_from": dense_from, "dense_dtype": dense_dtype, "int8_from": int8_from}


def _shape_key(m: nn.Module) -> str:
    return f"{m.out_features}x{m.in_features}:{m.bits}bit"


def _linear_paths(m: nn.Module, dtype: torch.dtype, bf16: bool) -> dict[str, Callable[[int], object]]:
    """path -> fn(rows) as the module runs it (quant/linear.py, the blocks branch of _matmul)."""
    w = m.blocks()
    x = torch.randn(GRID[-1], m.in_features, generator=torch.Generator().manual_seed(0))
    xd = x.to(dtype)
    # each mode on the layout it runs with (qmatmul.interleaved_for; see GroupCodesLinear.activations)
    laid = {mode: qmatmul.relayout(w, qmatmul.interleaved_for(mode, w.bits)) for mode in qmatmul.MODES}
    paths: dict[str, Callable[[int], object]] = {
        mode: (lambda r, mode=mode: qmatmul.matmul(x[:r], laid[mode], mode)) for mode in qmatmul.MODES}
    if laid["int8"].interleaved:  # int8 codes for prefill-sized batches, on the int16 kernel's layout
        paths[PREFILL_INT8] = lambda r: qmatmul.matmul(x[:r], laid["int8"], "int8")
    # the dense paths on the layout integer activations run with (4-bit: interleaved rows, which
    # amx_linear dequantizes fastest), as every CPU measured so far runs its linears
    wi = laid["int16"]
    paths["dense"] = lambda r: qmatmul.dense_matmul(xd[:r], wi, dtype)
    if bf16:
        paths["dense_bf16"] = lambda r: qmatmul.dense_matmul(xd[:r], wi, torch.bfloat16)
    return paths


def _measure_shape(paths: dict[str, Callable[[int], object]], key: str, flags: frozenset[str]) -> tuple[dict, dict]:
    """times[path][rows] and noise[path][rows] of one weight shape (paths: _linear_paths or
    _kquant_paths): the kernel at DECODE_ROWS and GRID, the dense paths at GRID, interleaved per
    batch size."""
    times: dict[str, dict[str, float]] = {p: {} for p in paths}
    noise: dict[str, dict[str, float]] = {p: {} for p in paths}
    for rows in (DECODE_ROWS, *GRID):
        names = [p for p in paths if rows in GRID or p in qmatmul.MODES]
        # at DECODE_ROWS the modes contest each other; at GRID rows the kernel (in whichever mode)
        # contests the dense paths, and more rounds where only the modes tie would be wasted
        sides = {} if rows == DECODE_ROWS else {p: "kernel" for p in qmatmul.MODES}
        got = time_interleaved({p: (lambda p=p: paths[p](rows)) for p in names}, f"{key}/{rows}",
                               {p: _path_gain(p, rows, flags) for p in names}, sides)
        for p, s in got.items():
            times[p][str(rows)], noise[p][str(rows)] = s["median"], s["spread"]
    return times, noise


def _pair(key: str, t: dict, paths: dict[str, Callable[[int], object]], rows: int, a: str, b: str) -> SpotPair:
    return (f"{key}/{rows}", a, lambda: paths[a](rows), b, lambda: paths[b](rows), t[a][str(rows)] / t[b][str(rows)])


def _spot_pairs(times: dict, chosen: dict, paths_of: Callable[[str], dict[str, Callable[[int], object]]],
                shapes: list[str]) -> list[SpotPair]:
    """Per shape, the chosen path against the one it took over from where the choice changes (at
    int8_from and at dense_from; at the largest batch, the kernel against the dense path, when the
    kernel always wins), and the two dense dtypes at PREFILL_ROWS."""
    pairs: list[SpotPair] = []
    for key in shapes:
        t, paths = times[key], paths_of(key)
        dense = "dense_bf16" if chosen["dense_dtype"][key] else "dense"
        act = chosen["activations"]
        i8, r = chosen["int8_from"][key], chosen["dense_from"][key]
        if i8 != NEVER:
            pairs.append(_pair(key, t, paths, i8, PREFILL_INT8, act))
        if r != NEVER:
            pairs.append(_pair(key, t, paths, r, dense, act if i8 == NEVER else PREFILL_INT8))
        elif i8 == NEVER:
            pairs.append(_pair(key, t, paths, GRID[-1], act, dense))
        if "dense_bf16" in t and "dense_bf16" in paths:
            pairs.append(_pair(key, t, paths, PREFILL_ROWS, dense, "dense" if dense == "dense_bf16" else "dense_bf16"))
    return pairs


def _decide_shapes(kind: str, shapes: list[str], paths_of: Callable[[str], dict[str, Callable[[int], object]]],
                   rule: Callable[[dict], dict], kernel_source: str, dtype: torch.dtype,
                   flags: frozenset[str]) -> tuple[dict, str]:
    """evidence.decide for the linears' shapes: the cached times if fresh and their spot check
    agrees with `rule`'s choice, else each shape's paths measured. The kernels' source is part of
    the key: a changed kernel is measured again."""
    def measure() -> dict:
        measured = {k: _measure_shape(paths_of(k), k, flags) for k in shapes}
        return {"times": {k: v[0] for k, v in measured.items()}, "noise": {k: v[1] for k, v in measured.items()},
                "source": source}

    def spot(entry: dict) -> str | None:
        return spot_check(_spot_pairs(entry["times"], rule(entry["times"]), paths_of, shapes))

    source = build.source_digest(kernel_source) + ("+amx" if qmatmul.amx_ready() else "")  # AMX_ENV moves the times
    try:
        return decide(kind, [shapes, str(dtype), source], measure, spot)
    finally:  # the dense paths' buffers, as large as the largest weight timed (the LM head)
        qmatmul.release_scratch()


def tune_linears(model: nn.Module, dtype: torch.dtype, allow_int8: bool | None = None) -> dict | None:
    """Measure and set each Blocks linear's `activations`, `dense_from`, `dense_dtype` and
    `int8_from`; None if there are none."""
    mods = [m for m in model.modules() if getattr(m, "path", None) == "blocks"]
    if not mods or not enabled() or qmatmul.load() is None:
        return None
    flags = cpu.cpu_flags()
    allow = int8_allowed() if allow_int8 is None else allow_int8
    allow_prefill = prefill_int8_allowed()
    # a float32 model's prefill may run on the CPU's bfloat16 units; elsewhere not even measured
    bf16 = dtype == torch.float32 and native("bfloat16", flags)
    by_shape: dict[str, nn.Module] = {}
    counts: dict[str, int] = {}
    for m in mods:
        by_shape.setdefault(_shape_key(m), m)
        counts[_shape_key(m)] = counts.get(_shape_key(m), 0) + 1

    def rule(times: dict) -> dict:
        return choose(times, counts, allow, flags, allow_prefill)

    entry, how = _decide_shapes("linears", sorted(by_shape), lambda k: _linear_paths(by_shape[k], dtype, bf16),
                                rule, "qmatmul.c", dtype, flags)
    times = entry["times"]
    chosen = rule(times)
    for m in mods:
        key = _shape_key(m)
        m.activations, m.dense_from = chosen["activations"], chosen["dense_from"][key]
        m.int8_from = chosen["int8_from"][key]
        dd = chosen["dense_dtype"][key]
        m.dense_dtype = None if dd is None else getattr(torch, dd)
    t1 = {mode: sum(counts[s] * times[s][mode][str(DECODE_ROWS)] for s in counts)
          for mode in qmatmul.MODES if all(mode in times[s] for s in counts)}
    logger.info("linears: %d quantized (%s; rounds spread %.0f%%); %s activations (all linears at 1 row: %s); "
                "dense from rows: %s", len(mods), how, 100 * entry_noise(entry), chosen["activations"],
                ", ".join(f"{mode} {t * 1e3:.2f} ms" for mode, t in t1.items()), _dense_summary(chosen, dtype))
    return chosen


def _kquant_key(m: nn.Module) -> str:
    names = {kquant.Q4_K: "Q4_K", kquant.Q5_K: "Q5_K", kquant.Q6_K: "Q6_K"}
    return f"{m.out_features}x{m.in_features}:{'+'.join(names[q] for q in m.qtypes)}"


def _kquant_paths(m: nn.Module, dtype: torch.dtype, bf16: bool) -> dict[str, Callable[[int], object]]:
    """path -> fn(rows) as a KQuantLinear runs it: its kernel (int16 codes, named as that mode, so
    `choose` reads it as the activations), the dense matmul after dequantizing, in the model's
    dtype and, where measured, in bfloat16, and int8 activations against the codes (PREFILL_INT8)
    where that kernel applies."""
    mat = m.matrix()
    x = torch.randn(GRID[-1], m.in_features, generator=torch.Generator().manual_seed(0))
    xd = x.to(dtype)
    paths: dict[str, Callable[[int], object]] = {
        "int16": lambda r: kquant.matmul(x[:r], mat),
        "dense": lambda r: F.linear(xd[:r], kquant.dequantize(mat, dtype, reuse=True))}
    if bf16:
        paths["dense_bf16"] = lambda r: F.linear(xd[:r].bfloat16(),
                                                 kquant.dequantize(mat, torch.bfloat16, reuse=True)).to(dtype)
    if kquant.int8_applies(mat):  # int8 activations against the codes for prefill-sized batches
        paths[PREFILL_INT8] = lambda r: kquant.matmul_int8(x[:r], mat)
    return paths


def tune_kquant_linears(model: nn.Module, dtype: torch.dtype) -> dict | None:
    """Measure and set each K-quant linear's (KQuantLinear, raw GGUF Q4_K / Q5_K / Q6_K rows)
    `dense_from`, `dense_dtype` and `int8_from` by `choose`'s rule: from which batch size the
    dense matmul, or int8 activations against the codes, beat the kernel, and whether the dense
    matmul runs on the CPU's bfloat16 units (a Q4_K_M file's Q6_K ffn_down: float32 dense is a
    third of bfloat16's speed on AVX512-BF16, int8 codes ~1.5x bfloat16). None if there are none."""
    mods = [m for m in model.modules() if getattr(m, "path", None) == "kquant"]
    if not mods or not enabled() or kquant.load() is None:
        return None
    flags = cpu.cpu_flags()
    bf16 = dtype == torch.float32 and native("bfloat16", flags)
    by_shape: dict[str, nn.Module] = {}
    for m in mods:
        by_shape.setdefault(_kquant_key(m), m)
    counts = {k: 1 for k in by_shape}  # one kernel: nothing to weigh across shapes
    allow_prefill = prefill_int8_allowed()

    def rule(times: dict) -> dict:
        return choose(times, counts, flags=flags, allow_prefill_int8=allow_prefill)

    entry, how = _decide_shapes("kquant", sorted(by_shape), lambda k: _kquant_paths(by_shape[k], dtype, bf16),
                                rule, "kquant.c", dtype, flags)
    chosen = rule(entry["times"])
    for m in mods:
        key = _kquant_key(m)
        m.dense_from = chosen["dense_from"][key]
        m.int8_from = chosen["int8_from"][key]
        dd = chosen["dense_dtype"][key]
        m.dense_dtype = None if dd is None else getattr(torch, dd)
    logger.info("K-quant linears: %d (%s; rounds spread %.0f%%); dense from rows: %s", len(mods), how,
                100 * entry_noise(entry), _dense_summary(chosen, dtype))
    return chosen


# ---- prefill attention ------------------------------------------------------------------------

# (query tokens, context including them): a chunk of a short prompt, and the last chunk of a long one
ATTENTION_CASES = ((PREFILL_ROWS, 2 * PREFILL_ROWS), (PREFILL_ROWS, 8 * PREFILL_ROWS))


def pick_attention(times: dict[str, dict[str, float]]) -> str:
    """The prefill attention path whose times (case -> median seconds) sum the least."""
    total = {name: sum(t.values()) for name, t in times.items()}
    return min(total, key=total.__getitem__)


def choose_prefill_attention(shape: list, kernel_source: str,
                             candidates: Callable[[int, int], dict[str, Callable[[], object]]]) -> str:
    """Which of the attention backend's prefill paths (`candidates(q, L)`: name -> fn attending a
    chunk of q tokens at the end of a context of L; 'kernel', 'sdpa', and where the backend offers
    it 'kernel_bf16') takes less time summed over ATTENTION_CASES on this model's head shapes
    (`shape`: part of the cache key, with the kernel's source). No margin: the first two are exact
    to float rounding, and the backend offers the third only where the model's prefill already
    rounds more coarsely. The C kernel is not always the faster: on an AVX2 imitation with 128-wide
    heads torch's SDPA won at long contexts (BENCHMARKS.md). Without tuning: 'kernel'."""
    if not enabled():
        return "kernel"
    cases = [f"{q}x{n}" for q, n in ATTENTION_CASES]
    made: dict[str, dict[str, Callable[[], object]]] = {}

    def fns(case: str) -> dict[str, Callable[[], object]]:
        if case not in made:
            made.clear()  # one case's tensors at a time
            made[case] = candidates(*map(int, case.split("x")))
        return made[case]

    def measure() -> dict:
        times: dict[str, dict[str, float]] = {}
        noise: dict[str, dict[str, float]] = {}
        for case in cases:
            for name, st in time_interleaved(fns(case), f"attention {case}").items():
                times.setdefault(name, {})[case], noise.setdefault(name, {})[case] = st["median"], st["spread"]
        return {"times": times, "noise": noise}

    def spot(entry: dict) -> str | None:
        t = entry["times"]
        best = pick_attention(t)
        other = next(n for n in t if n != best)
        case = cases[-1]  # the long context: where the paths differ most in time
        f = fns(case)
        return spot_check([(f"attention {case}", best, f[best], other, f[other], t[best][case] / t[other][case])])

    source = build.source_digest(kernel_source) + ("+amx" if qmatmul.amx_ready() else "")  # AMX_ENV moves the times
    entry, how = decide("attention", [shape, source], measure, spot)
    made.clear()
    chosen = pick_attention(entry["times"])
    logger.info("prefill attention -> %s (%s; rounds spread %.0f%%; %s)", chosen, how, 100 * entry_noise(entry),
                ", ".join(f"{n} " + " / ".join(f"{t[c] * 1e3:.2f} ms at {c}" for c in cases)
                          for n, t in entry["times"].items()))
    return chosen


def _dense_summary(chosen: dict, dtype: torch.dtype) -> str:
    """'SHAPE [int8 from ROWS, dense ]FROM in DTYPE, ...' of a `choose` result, for the log line."""
    i8 = chosen["int8_from"]
    return ", ".join(f"{s} " + (f"int8 from {i8[s]}, dense " if i8[s] != NEVER else "")
                     + ("never" if v == NEVER else f"{v} in {chosen['dense_dtype'][s] or dtype_name(dtype)}")
                     for s, v in chosen["dense_from"].items())


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
