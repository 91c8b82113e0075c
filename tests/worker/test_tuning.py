"""Tuning that one noisy run cannot fool (kvserve/kernels/tuning.py and evidence.py), with
injected timings only: the rules, interleaved rounds and their medians, the margins a choice against
the CPU's features needs, the re-checks of cached decisions at start, the per-phase (bfloat16 dense
prefill) choice of quantized linears, `kvserve tune --clear` and what `kvserve env` shows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from kvserve import __version__
from kvserve.quant.base import quantize_rtn
from kvserve.kernels import cpu, evidence, qmatmul, tuning

BF16 = tuning.NATIVE["bfloat16"]
FP16 = tuning.NATIVE["float16"]
LOGGER = "kvserve.kernels.tuning"
N = tuning.NEVER  # a range of batch sizes that is empty


class Clock:
    """Stands in for evidence._timed: seconds by label ('<candidate>@<where>'), and the nth call of
    a label may get its own value (an outlier round)."""

    def __init__(self, seconds: Callable[[str, int], float]) -> None:
        self.seconds, self.calls, self.count = seconds, [], defaultdict(int)

    def __call__(self, label: str, fn: Callable[[], object]) -> float:
        n = self.count[label]
        self.count[label] += 1
        self.calls.append(label)
        return self.seconds(label, n)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty tuning cache in tmp_path, and the C kernel loaded beforehand from the session's
    cache (not rebuilt in every tmp_path)."""
    assert qmatmul.load() is not None
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(evidence.TUNE_BEFORE_ENV, raising=False)
    monkeypatch.delenv(tuning.TUNING_ENV, raising=False)
    monkeypatch.setattr(evidence, "_checked", {})
    # entries written by a test count as old: the spot check is what most tests here are about
    monkeypatch.setattr(evidence, "SHARED_START_S", 0)
    return tmp_path / "tuning"


def use_clock(monkeypatch, seconds: Callable[[str, int], float]) -> Clock:
    clock = Clock(seconds)
    monkeypatch.setattr(evidence, "_timed", clock)
    return clock


def set_flags(monkeypatch, bf16: bool) -> None:
    """This CPU's flags with or without bfloat16 arithmetic and never with float16 arithmetic (the
    rest kept, so the C kernels' ISA level and build do not change). Without dropping float16 a
    CPU that has it (Sapphire Rapids: avx512_fp16, amx_fp16) would time a third dtype, which the
    tests' clocks do not know."""
    flags = cpu.cpu_flags() - FP16
    flags = (flags | BF16) if bf16 else (flags - BF16)
    monkeypatch.setattr(cpu, "cpu_flags", lambda: flags)


def dtype_clock(table: dict[str, dict[int, float]]) -> Callable[[str, int], float]:
    """Seconds for choose_dtype's labels ('bfloat16@256') from table[dtype][rows]."""
    return lambda label, n: table[label.split("@")[0]][int(label.split("@")[1])]


def write_entry(kind: str, what: object, **entry) -> None:
    path = evidence.cache_path(kind, what)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(entry))


def dtype_entry(times: dict, noise: float = 0.02, made: float | None = None) -> dict:
    return {"times": times, "noise": {n: {r: noise for r in t} for n, t in times.items()},
            "made": time.time() if made is None else made, "version": __version__, "threads": 1}


F32 = {"1": 2e-4, "256": 4e-3}
BF16_FAST = {"1": 1e-4, "256": 1e-3}  # per token 2.0x (f32 2.16e-4 vs 1.04e-4)
NAMES = ["float32", "bfloat16"]


# ---- interleaved rounds -----------------------------------------------------------------------

def test_one_outlier_round_does_not_flip_a_choice(monkeypatch):
    # float32 is truly faster; one round of each goes astray: float32 10x slow, bfloat16 100x fast
    clock = use_clock(monkeypatch, lambda label, n: {("float32", 2): 1e-2, ("bfloat16", 3): 1e-5}.get(
        (label.split("@")[0], n), 1e-3 if label.startswith("float32") else 1.5e-3))
    stats = evidence.time_interleaved({"float32": lambda: None, "bfloat16": lambda: None}, "1")
    assert stats["float32"]["median"] == 1e-3 and stats["bfloat16"]["median"] == 1.5e-3
    assert stats["float32"]["spread"] == 0.0 and stats["float32"]["rounds"] == evidence.ROUNDS
    # best-of (the old rule) would take bfloat16's 10 us; the medians keep float32 ahead
    assert min(stats, key=lambda n: stats[n]["median"]) == "float32"
    # interleaved: every round calls both, the first one alternating
    firsts = [clock.calls[i].split("@")[0] for i in range(0, 2 * evidence.ROUNDS, 2)]
    assert firsts == ["float32", "bfloat16"] * 2 + ["float32"]


def test_rounds_closer_than_their_spread_are_measured_again(monkeypatch):
    swing = (0.6, 1.4, 0.7, 1.3, 1.0)  # 50% spread around medians only 5% apart
    clock = use_clock(monkeypatch, lambda label, n: swing[n % 5] * (1.05 if label.startswith("b") else 1.0))
    stats = evidence.time_interleaved({"a": lambda: None, "b": lambda: None}, "x")
    assert stats["a"]["rounds"] == evidence.ROUNDS * (1 + evidence.EXTRA_PASSES) == len(clock.calls) // 2
    assert stats["a"]["spread"] > 0.5
    # the same noise with the candidates 3x apart decides in one pass
    clock = use_clock(monkeypatch, lambda label, n: swing[n % 5] * (3.0 if label.startswith("b") else 1.0))
    assert evidence.time_interleaved({"a": lambda: None, "b": lambda: None}, "x")["a"]["rounds"] == evidence.ROUNDS
    # a tie between two of one side (the kernel's modes) is not the contest: a against the dense path is
    clock = use_clock(monkeypatch, lambda label, n: swing[n % 5] * {"a": 1.0, "b": 1.05, "d": 3.0}[label[0]])
    fns = {"a": lambda: None, "b": lambda: None, "d": lambda: None}
    assert evidence.time_interleaved(fns, "x", sides={"a": "kernel", "b": "kernel"})["a"]["rounds"] == evidence.ROUNDS


# ---- the dtype rule and its margins ----------------------------------------------------------

def test_lower_precision_needs_a_margin_and_a_big_one_without_native_arithmetic():
    f32 = {"1": 2.2e-4, "256": 3.4e-3}  # per token: 235 us
    # measured on an AVX2 Zen 3 (a noisy float32 decode time): bfloat16 222 us per token, a near tie
    assert tuning.pick_dtype({"float32": f32, "bfloat16": {"1": 1.17e-4, "256": 2.7e-2}}, BF16) == "float32"
    bf16_1_6x = {"1": 1.4e-4, "256": 2.1e-3}  # 148 us per token: 1.6x
    assert tuning.pick_dtype({"float32": f32, "bfloat16": bf16_1_6x}, BF16) == "bfloat16"
    assert tuning.pick_dtype({"float32": f32, "bfloat16": bf16_1_6x}, frozenset({"avx2", "fma"})) == "float32"
    assert tuning.pick_dtype({"float32": f32, "bfloat16": {"1": 1e-4, "256": 1.5e-3}}, frozenset()) == "bfloat16"
    fp16 = {"float32": f32, "float16": bf16_1_6x}
    assert tuning.pick_dtype(fp16, frozenset({"avx512_bf16"})) == "float32"
    assert tuning.pick_dtype(fp16, frozenset({"avx512_fp16"})) == "float16"


def test_bf16_on_a_cpu_without_bf16_needs_the_big_margin(cache, monkeypatch):
    times = {"float32": {1: 2.2e-4, 256: 3.4e-3}, "bfloat16": {1: 1.4e-4, 256: 2.1e-3}}  # 1.6x faster
    use_clock(monkeypatch, dtype_clock(times))
    set_flags(monkeypatch, bf16=False)
    assert tuning.choose_dtype(64, 256) == torch.float32
    set_flags(monkeypatch, bf16=True)  # another CPU: another cache entry, measured, and 1.6x is enough
    assert tuning.choose_dtype(64, 256) == torch.bfloat16
    assert len(list(cache.glob("dtype_*.json"))) == 2


def test_float32_kernels_take_float32_without_timing_a_dense_linear(cache, monkeypatch, caplog):
    # a CPU where a dense bfloat16 linear wins 4x: the compressed kernels compute in float32 anyway
    clock = use_clock(monkeypatch, dtype_clock({"float32": {1: 4e-4, 256: 4e-3}, "bfloat16": {1: 1e-4, 256: 1e-3}}))
    set_flags(monkeypatch, bf16=True)
    with caplog.at_level("INFO", logger=LOGGER):
        assert tuning.choose_dtype(64, 256, float32_kernels=True) == torch.float32
    assert "dtype auto -> float32 (the linears run in the float32 CPU kernels)" in caplog.text
    assert clock.calls == [] and not list(cache.glob("dtype_*"))
    assert tuning.choose_dtype(64, 256) == torch.bfloat16  # a dense model's linears: measured


# ---- cached decisions: stale, noisy, disagreeing ---------------------------------------------

def test_a_fresh_quiet_entry_is_used_after_a_spot_check(cache, monkeypatch, caplog):
    set_flags(monkeypatch, bf16=True)
    write_entry("dtype", [64, 256, NAMES], **dtype_entry({"float32": F32, "bfloat16": BF16_FAST}))
    clock = use_clock(monkeypatch, dtype_clock({"float32": {1: 2e-4, 256: 4e-3}, "bfloat16": {1: 1e-4, 256: 1e-3}}))
    with caplog.at_level("INFO", logger=LOGGER):
        assert tuning.choose_dtype(64, 256) == torch.bfloat16
    assert "dtype auto -> bfloat16 (cached, spot check agrees" in caplog.text
    assert len(clock.calls) == 2 * 2 * evidence.SPOT_REPS  # two dtypes at two sizes: no rounds
    tuning.choose_dtype(64, 256)  # the engine core and the worker both ask: one spot check per process
    assert len(clock.calls) == 2 * 2 * evidence.SPOT_REPS


def test_a_noisy_entry_made_minutes_ago_is_only_spot_checked(cache, monkeypatch, caplog):
    """A busy hour's starts do not each pay for a full measurement; the spot check guards them."""
    set_flags(monkeypatch, bf16=True)
    write_entry("dtype", [64, 256, NAMES], **dtype_entry({"float32": F32, "bfloat16": BF16_FAST}, noise=0.5,
                                                         made=time.time() - 60))
    clock = use_clock(monkeypatch, dtype_clock({"float32": {1: 2e-4, 256: 4e-3}, "bfloat16": {1: 1e-4, 256: 1e-3}}))
    with caplog.at_level("INFO", logger=LOGGER):
        assert tuning.choose_dtype(64, 256) == torch.bfloat16
    assert "(cached, spot check agrees; rounds spread 50%" in caplog.text
    assert len(clock.calls) == 2 * 2 * evidence.SPOT_REPS


@pytest.mark.parametrize("entry, why", [
    (dtype_entry({"float32": F32, "bfloat16": BF16_FAST}, noise=0.5, made=time.time() - evidence.NOISY_RETRY_S),
     "noisy: its rounds spread 50%"),
    (dtype_entry({"float32": F32, "bfloat16": BF16_FAST}, made=time.time() - 40 * 86400), "stale: made 40 days ago"),
    ({"times": {"float32": F32, "bfloat16": BF16_FAST}}, "cached without its evidence"),
    ({**dtype_entry({"float32": F32, "bfloat16": BF16_FAST}), "version": "0.0.1"}, "made by kvserve 0.0.1"),
    ({**dtype_entry({"float32": F32, "bfloat16": BF16_FAST}), "threads": 2}, "timed on several threads"),
])
def test_noisy_stale_or_unrecorded_entries_are_measured_again(cache, monkeypatch, caplog, entry, why):
    set_flags(monkeypatch, bf16=True)
    write_entry("dtype", [64, 256, NAMES], **entry)  # bfloat16 twice as fast
    clock = use_clock(monkeypatch, dtype_clock({"float32": {1: 1e-4, 256: 1e-3}, "bfloat16": {1: 2e-4, 256: 4e-3}}))
    with caplog.at_level("INFO", logger=LOGGER):
        assert tuning.choose_dtype(64, 256) == torch.float32  # the new rounds say float32
    assert f"(measured: {why}" in caplog.text
    assert clock.count["float32@256"] == evidence.ROUNDS
    written = json.loads(next(cache.glob("dtype_*.json")).read_text())
    assert written["times"]["float32"]["256"] == 1e-3 and written["noise"]["float32"]["256"] == 0.0
    assert written["version"] == __version__ and time.time() - written["made"] < 60 and written["threads"] == 1


def test_a_spot_check_that_disagrees_measures_again(cache, monkeypatch, caplog):
    # the case: cached while the machine was busy, float32 looked 40x slower than it is
    busy = {"float32": {"1": 8e-3, "256": 4e-2}, "float16": {"1": 2e-4, "256": 4e-3}}
    fp16 = (cpu.cpu_flags() - BF16) | {"avx512_fp16"}  # a CPU with float16 arithmetic
    monkeypatch.setattr(cpu, "cpu_flags", lambda: fp16)
    names = ["float32", "bfloat16", "float16"]
    write_entry("dtype", [64, 256, names], **dtype_entry({**busy, "bfloat16": {"1": 1e-2, "256": 1e-1}}))
    clock = use_clock(monkeypatch, dtype_clock({"float32": {1: 1e-4, 256: 1e-3}, "float16": {1: 2e-4, 256: 4e-3},
                                                "bfloat16": {1: 1e-3, 256: 1e-2}}))
    with caplog.at_level("INFO", logger=LOGGER):
        assert tuning.choose_dtype(64, 256) == torch.float32
    assert "(measured: spot check disagrees: float16/float32 at 1" in caplog.text
    assert clock.count["float16@1"] == evidence.SPOT_REPS + evidence.ROUNDS


def test_an_entry_measured_or_checked_moments_ago_is_taken_as_it_is(cache, monkeypatch, caplog):
    """Engines started together on one machine choose alike: the later ones take what the first
    measured or spot-checked, without timing anything (their K/V must be exchangeable)."""
    monkeypatch.setattr(evidence, "SHARED_START_S", 60)
    set_flags(monkeypatch, bf16=True)
    write_entry("dtype", [64, 256, NAMES], **dtype_entry({"float32": F32, "bfloat16": BF16_FAST},
                                                         made=time.time() - 7200))
    # now float32 looks faster: a spot check would disagree
    slow_bf16 = dtype_clock({"float32": {1: 1e-4, 256: 1e-3}, "bfloat16": {1: 1e-3, 256: 1e-2}})
    clock = use_clock(monkeypatch, dtype_clock({"float32": {1: 2e-4, 256: 4e-3}, "bfloat16": {1: 1e-4, 256: 1e-3}}))
    assert tuning.choose_dtype(64, 256) == torch.bfloat16  # spot-checked: it agrees, and says when
    assert len(clock.calls) == 2 * 2 * evidence.SPOT_REPS
    checked = json.loads(next(cache.glob("dtype_*.json")).read_text())["checked"]
    assert time.time() - checked < 60
    monkeypatch.setattr(evidence, "_checked", {})  # another engine's process
    clock = use_clock(monkeypatch, slow_bf16)
    with caplog.at_level("INFO", logger=LOGGER):
        assert tuning.choose_dtype(64, 256) == torch.bfloat16
    assert "(cached, measured or checked 0 s ago" in caplog.text and not clock.calls
    monkeypatch.setattr(evidence, "_checked", {})  # a start a while later spot-checks again
    write_entry("dtype", [64, 256, NAMES], **{**json.loads(next(cache.glob("dtype_*.json")).read_text()),
                                              "checked": time.time() - 61})
    use_clock(monkeypatch, slow_bf16)
    assert tuning.choose_dtype(64, 256) == torch.float32


DECIDE_IN_CHILD = """
import json, os, time
from kvserve.kernels import evidence
def measure():
    time.sleep(2)  # long enough for the other process to arrive while this one measures
    return {"times": {"who": os.getpid()}, "noise": {}}
entry, how = evidence.decide("test", "x", measure, lambda e: "spot check disagrees")
print(json.dumps([entry["times"]["who"], how]))
"""


def test_processes_deciding_at_once_take_one_measurement(tmp_path):
    """Two processes with nothing cached: one measures, the other waits for it and takes its entry
    (without the lock both measured, each while the other ran, and could choose differently)."""
    env = {**os.environ, "KVSERVE_CACHE_DIR": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", DECIDE_IN_CHILD], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    got = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert got[0][0] == got[1][0], got
    assert sorted(how.split(",")[0].split(":")[0] for _, how in got) == ["cached", "measured"], got


def test_a_spot_check_asks_that_the_ranking_holds_not_the_ratio(monkeypatch):
    def pair(cached: float) -> evidence.SpotPair:
        return ("256", "a", lambda: None, "b", lambda: None, cached)

    use_clock(monkeypatch, lambda label, n: {"a": 3e-3, "b": 1e-2}[label[0]])  # a 0.3x of b now
    assert evidence.spot_check([pair(0.05)]) is None  # 20x faster in the cache, 3x now: a stays
    use_clock(monkeypatch, lambda label, n: {"a": 2e-2, "b": 1e-2}[label[0]])  # a 2x slower now
    assert evidence.spot_check([pair(0.05)]) == "spot check disagrees: a/b at 256 2.00x, cached 0.05x"
    assert evidence.spot_check([pair(1.6)]) is None  # a was chosen 1.6x slower (a margin): 2x is close
    use_clock(monkeypatch, lambda label, n: {"a": 2e-2 if n else 1.0, "b": 1e-2}[label[0]])
    assert evidence.spot_check([pair(1.6)]) is None  # the least of two: one busy moment is ignored


def test_kvserve_tune_asks_for_new_measurements(cache, monkeypatch, capsys):
    from kvserve import cli

    set_flags(monkeypatch, bf16=True)
    write_entry("dtype", [64, 256, NAMES], **dtype_entry({"float32": F32, "bfloat16": BF16_FAST}))
    clock = use_clock(monkeypatch, dtype_clock({"float32": {1: 2e-4, 256: 4e-3}, "bfloat16": {1: 1e-4, 256: 1e-3}}))
    monkeypatch.setenv(evidence.TUNE_BEFORE_ENV, "0")  # restored after the test; cmd_tune sets it
    started = []
    # building the engine resolves the dtype twice (engine core, worker): the first measures, the second reuses
    monkeypatch.setattr(cli, "engine_from_args", lambda args: started.append(
        [tuning.choose_dtype(64, 256), tuning.choose_dtype(64, 256)]))
    assert cli.main(["tune", "--model", "some.gguf"]) == 0
    assert started == [[torch.bfloat16, torch.bfloat16]]
    assert clock.count["bfloat16@256"] == evidence.ROUNDS
    out = capsys.readouterr().out
    assert "dtype auto -> bfloat16 (measured: re-measure asked (kvserve tune)" in out
    assert "checked earlier in this process" in out


def test_kvserve_tune_clear_empties_the_cache(cache, capsys):
    from kvserve.cli import main

    cache.mkdir(parents=True)
    for name in ("dtype_a.json", "linears_b.json"):
        (cache / name).write_text("{}")
    kernels = cache.parent / "kernels"
    kernels.mkdir()
    (kernels / "qmatmul_x.so").write_bytes(b"")
    assert main(["tune", "--clear"]) == 0
    assert list(cache.iterdir()) == [] and (kernels / "qmatmul_x.so").exists()
    assert f"removed 2 cached tuning decisions from {cache}" in capsys.readouterr().out


# ---- quantized linears: the kernel, the dense path and its dtype per phase -------------------

def _times(dense: dict[int, float], kernel: dict[int, float], int8_1: float, f32_1: float) -> dict:
    return {"int8": {"1": int8_1, **{str(r): v for r, v in kernel.items()}},
            "float32": {"1": f32_1, **{str(r): v * 1.5 for r, v in kernel.items()}},
            "dense": {str(r): v for r, v in dense.items()}}


def test_choose_takes_the_faster_path_per_shape():
    times = {
        # dense wins from 32 rows on (and stays ahead)
        "a": _times({8: 5.0, 32: 3.0, 128: 4.0}, {8: 1.0, 32: 3.5, 128: 9.0}, 1.0, 2.0),
        # dense ahead at 8 but behind at 32: not "from 8", from 128
        "b": _times({8: 1.0, 32: 9.0, 128: 1.0}, {8: 2.0, 32: 3.0, 128: 5.0}, 1.0, 2.0),
        # the kernel wins everywhere measured
        "c": _times({8: 9.0, 32: 9.0, 128: 9.0}, {8: 1.0, 32: 1.0, 128: 1.0}, 1.0, 2.0),
    }
    chosen = tuning.choose(times, {"a": 1, "b": 1, "c": 1})
    assert chosen == {"activations": "int8", "dense_from": {"a": 32, "b": 128, "c": tuning.NEVER},
                      "dense_dtype": {"a": None, "b": None, "c": None}, "int8_from": dict.fromkeys("abc", tuning.NEVER)}
    assert tuning.choose(times, {"a": 1, "b": 1, "c": 1}, allow_int8=False)["activations"] == "float32"
    slow_int8 = {k: {**v, "int8": {**v["int8"], "1": 5.0}} for k, v in times.items()}
    assert tuning.choose(slow_int8, {"a": 1, "b": 1, "c": 1})["activations"] == "float32"
    # quantized activations cost precision: 3% faster is a tie, 20% is not
    near = {k: {**v, "int16": {**v["int8"], "1": 1.94}} for k, v in slow_int8.items()}
    assert tuning.choose(near, {"a": 1, "b": 1, "c": 1})["activations"] == "float32"
    near = {k: {**v, "int16": {**v["int8"], "1": 1.6}} for k, v in slow_int8.items()}
    assert tuning.choose(near, {"a": 1, "b": 1, "c": 1})["activations"] == "int16"


def test_int8_over_int16_needs_its_own_margin():
    """int8 and int16 both quantize, but int8 rounds ~250x coarser: it must beat int16 by INT8_GAIN."""
    times = {"s": _times({8: 9.0}, {8: 1.0}, 1.0, 2.0)}
    times["s"]["int16"] = {"1": 1.0 * tuning.INT8_GAIN * 0.98, "8": 1.0}  # int8 a bit faster: a tie
    assert tuning.choose(times, {"s": 1})["activations"] == "int16"
    times["s"]["int16"]["1"] = 1.0 * tuning.INT8_GAIN * 1.05
    assert tuning.choose(times, {"s": 1})["activations"] == "int8"
    assert tuning.choose(times, {"s": 1}, allow_int8=False)["activations"] == "int16"


@pytest.mark.parametrize("level,allowed", [("avx2", True), ("avx512", True), ("avx512_vnni", False),
                                           ("avx_vnni", False), ("generic", False)])
def test_int8_decode_activations_by_default_where_the_kernels_lack_vnni(level, allowed, monkeypatch):
    """Without VNNI int16 codes cost twice int8's byte products (a one-token step is bound by them when
    the memory keeps up): int8 is a candidate there by default; KVSERVE_INT8_ACTIVATIONS decides
    everywhere when set."""
    monkeypatch.setattr(cpu, "isa_level", lambda: level)
    monkeypatch.delenv(tuning.INT8_ENV, raising=False)
    assert tuning.int8_allowed() is allowed
    for value, want in (("1", True), ("on", True), ("0", False), ("off", False), ("", allowed)):
        monkeypatch.setenv(tuning.INT8_ENV, value)
        assert tuning.int8_allowed() is want


def test_dense_over_the_kernel_at_small_batches_and_bf16_dense_need_margins():
    # dense 1.25x faster than the kernel from 4 rows on: enough at 16, not at 4 or 8 (decode-sized)
    t = _times({4: 0.8, 8: 0.8, 16: 0.8}, {4: 1.0, 8: 1.0, 16: 1.0}, 1.0, 2.0)
    assert tuning.choose({"s": t}, {"s": 1})["dense_from"]["s"] == 16
    t["dense"] = {r: v / 2 for r, v in t["dense"].items()}  # 2.5x: from 4
    assert tuning.choose({"s": t}, {"s": 1})["dense_from"]["s"] == 4
    # bfloat16 dense 1.6x faster than float32 dense: taken with bf16 arithmetic, not without
    t = {**_times({32: 2.0, 256: 8.0}, {32: 3.0, 256: 20.0}, 1.0, 2.0), "dense_bf16": {"32": 1.25, "256": 5.0}}
    with_bf16 = tuning.choose({"s": t}, {"s": 1}, flags=BF16)
    assert with_bf16["dense_dtype"] == {"s": "bfloat16"} and with_bf16["dense_from"]["s"] == 32
    assert tuning.choose({"s": t}, {"s": 1}, flags=frozenset({"avx2"}))["dense_dtype"] == {"s": None}


def test_bf16_dense_never_takes_decode_sized_batches():
    """However fast (AMX: 5x), bfloat16 starts at BF16_DENSE_MIN_ROWS: fewer rows are decode rows,
    whose tokens keep the kernel's arithmetic; float32 dense may still start lower."""
    kernel = {2: 1.0, 4: 2.0, 8: 4.0, 16: 8.0, 32: 16.0}
    t = {**_times({r: v / 4 for r, v in kernel.items()}, kernel, 1.0, 2.0),
         "dense_bf16": {str(r): v / 20 for r, v in kernel.items()}}
    bf16 = tuning.choose({"s": t}, {"s": 1}, flags=BF16)
    assert bf16["dense_dtype"] == {"s": "bfloat16"} and bf16["dense_from"]["s"] == tuning.BF16_DENSE_MIN_ROWS == 16
    del t["dense_bf16"]  # a CPU without bf16 units: not measured
    f32 = tuning.choose({"s": t}, {"s": 1}, flags=frozenset({"avx2"}))
    assert f32["dense_dtype"] == {"s": None} and f32["dense_from"]["s"] == 2


def linear_clock(bf16_speedup: float = 2.0, int16: float = 3e-5, prefill_int8: float = 1e-6
                 ) -> Callable[[str, int], float]:
    """'<path>@<shape>/<rows>': the kernel linear in the rows, the dense path a fixed cost (the
    dequantized weight) plus a smaller slope, bfloat16 dense `bf16_speedup` times faster; dense
    float32 from 32 rows, dense bfloat16 from 16 (8 is decode-sized: not by SMALL_DENSE_GAIN).
    int16 codes `int16` seconds per row (the float32 kernel 1e-5: it wins decode by default), int8
    codes for prefill `prefill_int8` per row."""
    def seconds(label: str, n: int) -> float:
        path, where = label.split("@")
        rows = int(where.rsplit("/", 1)[1])
        dense = 1e-4 + 5e-6 * rows
        return {"float32": 1e-5 * rows, "int8": 2e-5 * rows, "int16": int16 * rows, "dense": dense,
                "dense_bf16": dense / bf16_speedup, tuning.PREFILL_INT8: prefill_int8 * rows}[path]
    return seconds


def two_linears(out: int = 64, k: int = 128):
    from kvserve.quant.linear import quantized_linear

    qw = quantize_rtn(torch.randn(out, k, generator=torch.Generator().manual_seed(0)) * 0.05, 4, 32, symmetric=False)
    return torch.nn.Sequential(quantized_linear(qw, None, torch.float32), quantized_linear(qw, None, torch.float32))


def test_tune_linears_on_a_cpu_without_bf16_never_measures_bf16(cache, monkeypatch, caplog):
    set_flags(monkeypatch, bf16=False)
    clock = use_clock(monkeypatch, linear_clock())
    model = two_linears()
    with caplog.at_level("INFO", logger=LOGGER):
        chosen = tuning.tune_linears(model, torch.float32)
    assert chosen == {"activations": "float32", "dense_from": {"64x128:4bit": 32}, "dense_dtype": {"64x128:4bit": None},
                      "int8_from": {"64x128:4bit": tuning.NEVER}}
    assert not any(label.startswith("dense_bf16") for label in clock.calls)
    assert clock.count["dense@64x128:4bit/256"] == evidence.ROUNDS and "dense@64x128:4bit/1" not in clock.count
    assert "linears: 2 quantized (measured: nothing cached" in caplog.text
    for m in model:
        assert (m.activations, m.dense_from, m.dense_dtype) == ("float32", 32, None)
    x = torch.randn(40, 128)
    assert torch.equal(model[0](x), F.linear(x, qmatmul.dequantize(model[0].blocks())))
    monkeypatch.setenv(tuning.INT8_ENV, "1")  # allowed, int8 still loses at 1 row here
    assert tuning.tune_linears(model, torch.float32)["activations"] == "float32"
    monkeypatch.setenv(tuning.TUNING_ENV, "off")
    assert tuning.tune_linears(model, torch.float32) is None


def test_bf16_dense_prefill_is_chosen_where_the_cpu_has_bf16_and_stays_close(cache, monkeypatch, caplog):
    """Issue 30 item 4: decode keeps the quantized kernel, prefill-sized batches run the dense matmul
    in bfloat16 where the CPU has bf16 units (AMX here by flags; bf16 matmul runs on any CPU)."""
    set_flags(monkeypatch, bf16=True)
    clock = use_clock(monkeypatch, linear_clock())
    model = two_linears()
    with caplog.at_level("INFO", logger=LOGGER):
        chosen = tuning.tune_linears(model, torch.float32)
    assert chosen["dense_dtype"] == {"64x128:4bit": "bfloat16"} and chosen["dense_from"] == {"64x128:4bit": 16}
    assert clock.count["dense_bf16@64x128:4bit/256"] == evidence.ROUNDS
    assert "64x128:4bit 16 in bfloat16" in caplog.text
    m = model[0]
    assert m.dense_dtype == torch.bfloat16 and m.dense_from == 16
    w = qmatmul.dequantize(m.blocks())
    x = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    y, ref = m(x), F.linear(x, w)
    assert y.dtype == torch.float32
    rel = float((y - ref).norm() / ref.norm())
    assert 0 < rel < 1e-2  # bfloat16 rounding: close to float32, and not float32 itself
    one = x[:1]  # decode-sized: the kernel, in float32
    assert torch.allclose(m(one), F.linear(one, w), rtol=1e-5, atol=1e-6)
    # a bfloat16 model's dense path is bfloat16 already: nothing more to measure
    set_flags(monkeypatch, bf16=True)
    clock = use_clock(monkeypatch, linear_clock())
    assert tuning.tune_linears(model, torch.bfloat16)["dense_dtype"] == {"64x128:4bit": None}
    assert not any(label.startswith("dense_bf16") for label in clock.calls)


def test_a_slower_bf16_dense_keeps_float32_and_a_cached_entry_is_spot_checked(cache, monkeypatch, caplog):
    set_flags(monkeypatch, bf16=True)
    use_clock(monkeypatch, linear_clock(bf16_speedup=1.1))  # under LOWER_PRECISION_GAIN
    assert tuning.tune_linears(two_linears(), torch.float32)["dense_dtype"] == {"64x128:4bit": None}
    monkeypatch.setattr(evidence, "_checked", {})  # a new process: the entry is read from disk
    clock = use_clock(monkeypatch, linear_clock(bf16_speedup=1.1))
    with caplog.at_level("INFO", logger=LOGGER):
        tuning.tune_linears(two_linears(), torch.float32)
    assert "(cached, spot check agrees" in caplog.text
    # dense (chosen) against the kernel at dense_from, and the two dense dtypes at 256 rows
    assert sorted(clock.count) == ["dense@64x128:4bit/256", "dense@64x128:4bit/32", "dense_bf16@64x128:4bit/256",
                                   "float32@64x128:4bit/32"]


def test_int8_codes_take_prefill_where_they_win_with_a_margin():
    """Issue 30 item 4: prefill-sized batches of a weight whose decode runs int16 codes may run int8
    codes instead: from BF16_DENSE_MIN_ROWS on, where LOWER_PRECISION_GAIN faster than the
    float32-class paths (the kernel, the float32 dense matmul), up to the sizes from which the
    bfloat16 dense matmul is faster still."""
    def t(i8: float, bf16: float | None = None) -> dict:
        kernel = {8: 4.0, 16: 8.0, 32: 16.0, 256: 128.0}
        out = {"int16": {"1": 1.0, **{str(r): v for r, v in kernel.items()}},
               "float32": {"1": 2.0, **{str(r): 2 * v for r, v in kernel.items()}},
               "dense": {str(r): 20.0 + v / 2 for r, v in kernel.items()},
               tuning.PREFILL_INT8: {str(r): v * i8 for r, v in kernel.items()}}
        if bf16 is not None:
            out["dense_bf16"] = {str(r): (20.0 + v / 2) * bf16 for r, v in kernel.items()}
        return out
    got = tuning.choose({"s": t(0.5)}, {"s": 1}, flags=BF16)
    assert got["activations"] == "int16" and got["int8_from"] == {"s": 16} and got["dense_from"] == {"s": N}
    # 1.1x the int16 kernel: within the precision margin, so no int8 (dense float32 from 256 as before)
    got = tuning.choose({"s": t(0.9)}, {"s": 1}, flags=BF16)
    assert got["int8_from"] == {"s": N} and got["dense_dtype"] == {"s": None} and got["dense_from"] == {"s": 256}
    # slower than bfloat16 dense at 256 rows only (bf16 = 42 against int8's 64 there; 14 against 4 at
    # 16): int8 codes from 16 rows, the bfloat16 matmul from 256, as on a CPU with AMX
    got = tuning.choose({"s": t(0.5, bf16=0.5)}, {"s": 1}, flags=BF16)
    assert got["dense_dtype"] == {"s": "bfloat16"} and got["dense_from"] == {"s": 256} and got["int8_from"] == {"s": 16}
    # bfloat16 dense faster than int8 at every size from 16: no int8 range
    got = tuning.choose({"s": t(0.5, bf16=0.1)}, {"s": 1}, flags=BF16)
    assert got["dense_from"] == {"s": 16} and got["int8_from"] == {"s": N}
    # ... and where it wins only at 16 and 256, not at 32, the dense matmul takes 256 alone
    mixed = t(0.5, bf16=0.5)
    mixed["dense_bf16"]["16"] = 3.0
    got = tuning.choose({"s": mixed}, {"s": 1}, flags=BF16)
    assert got["dense_from"] == {"s": 256} and got["int8_from"] == {"s": 16}
    got = tuning.choose({"s": t(0.5)}, {"s": 1}, flags=BF16, allow_prefill_int8=False)
    assert got["int8_from"] == {"s": N} and got["dense_dtype"] == {"s": None}
    # float32 activations at decode (row-major weights): int8 prefill is not a candidate
    f32 = t(0.5)
    f32["float32"]["1"] = 0.5
    assert tuning.choose({"s": f32}, {"s": 1})["int8_from"] == {"s": N}


def test_tune_linears_sets_int8_prefill_and_the_module_runs_it(cache, monkeypatch, caplog):
    set_flags(monkeypatch, bf16=False)
    use_clock(monkeypatch, linear_clock(int16=5e-6, prefill_int8=1e-6))
    model = two_linears()
    with caplog.at_level("INFO", logger=LOGGER):
        chosen = tuning.tune_linears(model, torch.float32)
    assert chosen["activations"] == "int16" and chosen["int8_from"] == {"64x128:4bit": 16}
    assert chosen["dense_from"] == {"64x128:4bit": N} and "64x128:4bit int8 from 16, dense never" in caplog.text
    m = model[0]
    assert m.prefill_int8 and m.int8_from == 16 and m.dense_dtype is None and m.blocks().interleaved
    x = torch.randn(20, 128, generator=torch.Generator().manual_seed(2))
    assert torch.equal(m(x), qmatmul.matmul(x, m.blocks(), "int8"))  # 20 rows: int8 codes
    assert torch.equal(m(x[:15]), qmatmul.matmul(x[:15], m.blocks(), "int16"))  # decode-sized: int16
    ref = F.linear(x, qmatmul.dequantize(m.blocks()))
    assert float((m(x) - ref).norm() / ref.norm()) < 2e-2
    monkeypatch.setenv(tuning.PREFILL_INT8_ENV, "0")
    assert tuning.tune_linears(model, torch.float32)["int8_from"] == {"64x128:4bit": N}
    assert not model[0].prefill_int8


def kquant_linear(rows: int = 64, k: int = 256):
    """A KQuantLinear over random Q6_K rows (a Q4_K_M file's ffn_down and attn_v kind)."""
    import gguf

    from kvserve.quant import gguf as qgguf
    from kvserve.quant.kquant_linear import KQuantLinear
    from tests.quant.test_kquant import kquant_rows

    raw = kquant_rows(gguf.GGMLQuantizationType.Q6_K, rows, k, seed=5)
    return KQuantLinear(qgguf.kquant_weight(torch.from_numpy(raw), int(gguf.GGMLQuantizationType.Q6_K), "w"),
                        None, torch.float32)


def test_kquant_linears_take_bf16_dense_prefill_by_the_same_rule(cache, monkeypatch, caplog):
    """A Q4_K_M file's Q6_K linears (read in place by kquant.c) get dense_from and dense_dtype by
    `choose`'s rule, their kernel timed as the mode 'int16': bfloat16 dense where the CPU has bf16
    units and it wins, the model's dtype elsewhere; the module then runs what was chosen."""
    from kvserve.kernels import kquant

    set_flags(monkeypatch, bf16=True)
    # dense float32 from 32 rows, bfloat16 from 16; int8 codes (where they apply) slower than all
    clock = use_clock(monkeypatch, linear_clock(int16=1e-5, prefill_int8=1.0))
    model = torch.nn.Sequential(kquant_linear(), kquant_linear())
    qmatmul.scratch(1 << 20, torch.float32)  # as a dense path timed on a large weight (an LM head) leaves it
    with caplog.at_level("INFO", logger=LOGGER):
        chosen = tuning.tune_kquant_linears(model, torch.float32)
    assert "bufs" not in qmatmul._scratch_of.__dict__  # released: not kept at the LM head's size
    assert chosen["dense_dtype"] == {"64x256:Q6_K": "bfloat16"} and chosen["dense_from"] == {"64x256:Q6_K": 16}
    assert clock.count["dense_bf16@64x256:Q6_K/256"] == evidence.ROUNDS and "int16@64x256:Q6_K/1" in clock.count
    assert "K-quant linears: 2 (measured: nothing cached" in caplog.text and "64x256:Q6_K 16 in bfloat16" in caplog.text
    m = model[0]
    assert (m.dense_from, m.dense_dtype) == (16, torch.bfloat16)
    w = kquant.dequantize(m.matrix())
    x = torch.randn(20, 256, generator=torch.Generator().manual_seed(3))
    y = m(x)
    assert y.dtype == torch.float32
    assert torch.equal(y, F.linear(x.bfloat16(), w.bfloat16()).float())  # the weight rounded once, as .bfloat16()
    assert torch.equal(m(x[:15]), kquant.matmul(x[:15], m.matrix()))  # decode-sized: the kernel
    # no bf16 units: bfloat16 is not even measured, the float32 dense path from 32 rows
    set_flags(monkeypatch, bf16=False)
    clock = use_clock(monkeypatch, linear_clock(int16=1e-5, prefill_int8=1.0))
    chosen = tuning.tune_kquant_linears(model, torch.float32)
    assert chosen["dense_dtype"] == {"64x256:Q6_K": None} and chosen["dense_from"] == {"64x256:Q6_K": 32}
    assert not any(label.startswith("dense_bf16") for label in clock.calls) and model[1].dense_dtype is None
    assert tuning.tune_kquant_linears(two_linears(), torch.float32) is None  # no K-quant linears


def test_kquant_linears_take_int8_prefill_where_it_wins(cache, monkeypatch, caplog):
    """The K-quant rows' int8 path (kquant.matmul_int8) is the PREFILL_INT8 candidate of
    `choose`'s rule: measured where it applies (groups of 8 rows, an AVX2 build), chosen from
    BF16_DENSE_MIN_ROWS when it wins with the margin, and then the module runs it for
    prefill-sized batches (decode-sized ones keep the kernel); KVSERVE_PREFILL_INT8=0 keeps it off."""
    from kvserve.kernels import kquant

    model = torch.nn.Sequential(kquant_linear(), kquant_linear())
    m = model[0]
    if not kquant.int8_applies(m.matrix()):
        pytest.skip("the K-quant int8 path needs an AVX2 build (KVSERVE_CPU_ISA=generic here)")
    set_flags(monkeypatch, bf16=True)
    clock = use_clock(monkeypatch, linear_clock(int16=1e-5, prefill_int8=1e-7))
    with caplog.at_level("INFO", logger=LOGGER):
        chosen = tuning.tune_kquant_linears(model, torch.float32)
    assert chosen["int8_from"] == {"64x256:Q6_K": 16} and chosen["dense_from"] == {"64x256:Q6_K": N}
    assert clock.count[f"{tuning.PREFILL_INT8}@64x256:Q6_K/256"] == evidence.ROUNDS
    assert "64x256:Q6_K int8 from 16, dense never" in caplog.text
    assert m.prefill_int8 and m.int8_from == 16 and m.dense_from == N
    x = torch.randn(20, 256, generator=torch.Generator().manual_seed(4))
    assert torch.equal(m(x), kquant.matmul_int8(x, m.matrix()))
    assert torch.equal(m(x[:15]), kquant.matmul(x[:15], m.matrix()))  # decode-sized: the kernel
    ref = F.linear(x, kquant.dequantize(m.matrix()))
    assert float((m(x) - ref).norm() / ref.norm()) < 2e-2  # int8 activations' rounding
    monkeypatch.setenv(tuning.PREFILL_INT8_ENV, "0")
    assert tuning.tune_kquant_linears(model, torch.float32)["dense_dtype"] == {"64x256:Q6_K": "bfloat16"}
    assert not m.prefill_int8 and m.dense_dtype == torch.bfloat16 and m.dense_from == 16


# ---- what `kvserve env` shows ------------------------------------------------------------------

def test_env_shows_each_decision_with_its_evidence(cache, monkeypatch):
    from kvserve import env

    set_flags(monkeypatch, bf16=True)
    made = time.time() - 3600
    write_entry("dtype", "x", **dtype_entry({"float32": F32, "bfloat16": BF16_FAST}, noise=0.03, made=made))
    t = {**_times({32: 2.0, 256: 8.0}, {32: 3.0, 256: 20.0}, 1.0, 2.0), "dense_bf16": {"32": 1.0, "256": 4.0}}
    write_entry("linears", "y", times={"64x128:4bit": t}, noise={"64x128:4bit": {"dense": {"32": 0.5}}},
                made=made, version=__version__, threads=1)
    entries = {e["kind"]: e for e in env._cache()["tuning"]}
    dtype, linears = entries["dtype"], entries["linears"]
    assert dtype["chosen"] == "bfloat16" and dtype["noise"] == pytest.approx(0.03) and dtype["made"] == made
    assert dtype["recheck"] is None and dtype["seconds"]["float32"] == F32
    assert linears["dense_from"] == {"64x128:4bit": 32} and linears["dense_dtype"] == {"64x128:4bit": "bfloat16"}
    assert linears["recheck"] == "noisy: its rounds spread 50%"
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(made))
    assert env._tuning_line(dtype) == ("bfloat16 chosen; float32 200 us at 1 row, 4.00 ms at 256; bfloat16 100 us at "
                                       f"1 row, 1.00 ms at 256 (medians; rounds spread 3%, made {when})")
    assert env._tuning_line(linears).endswith("dense from rows: 64x128:4bit 32 in bfloat16 (medians; rounds spread "
                                              f"50%, made {when}); the next start measures it again: noisy: its "
                                              "rounds spread 50%")


def test_candidates_are_timed_on_one_thread(cache):
    """Several threads tie every candidate while a neighbour holds a core; one thread does not."""
    torch.set_num_threads(2)
    seen = []
    entry, how = evidence.decide("probe", "z", lambda: seen.append(torch.get_num_threads()) or {"times": {}},
                                 lambda e: seen.append(torch.get_num_threads()))
    assert seen == [1] and entry["threads"] == 1 and how == "measured: nothing cached"
    assert torch.get_num_threads() == 2  # the engine's threads restored
    evidence._checked.clear()
    evidence.decide("probe", "z", lambda: {"times": {}}, lambda e: seen.append(torch.get_num_threads()))
    assert seen == [1, 1]  # the spot check too


# ---- prefill attention: the C kernel or torch's SDPA ------------------------------------------

def attention_clock(table: dict[str, dict[str, float]]) -> Callable[[str, int], float]:
    """Seconds for choose_prefill_attention's labels ('kernel@attention 256x2048') from table[path][case]."""
    return lambda label, n: table[label.split("@")[0]][label.split(" ")[-1]]


def prefill_kernel_calls(backend, monkeypatch, n: int = 5) -> list[tuple]:
    """The C prefill kernel's calls (argument tuples; the kernel itself not run) while `backend`
    runs one request's n-token prefill chunk after 4 cached tokens (8 query heads, 2 kv heads, 64 wide)."""
    from kvserve.attention import AttentionMetadata
    from kvserve.kernels import paged_attention

    calls = []
    monkeypatch.setattr(paged_attention, "paged_prefill", lambda *a: calls.append(a))
    blocks = -(-(4 + n) // 4)
    q, kc = torch.randn(n, 8, 64), torch.randn(blocks, 4, 2, 64)
    meta = AttentionMetadata(num_decodes=0, query_start_loc=[0, n], seq_lens=[4 + n],
                             slot_mapping=torch.arange(4, 4 + n), block_tables=torch.arange(blocks)[None],
                             seq_lens_tensor=torch.tensor([4 + n]), block_size=4)
    k_new = torch.randn(n, 2, 64)
    backend.forward(q, k_new, k_new, kc, kc.clone(), meta, 0.125)
    return calls


def test_prefill_attention_takes_the_path_that_sums_less(cache, monkeypatch, caplog):
    """Summed over a short and a long context: a kernel that wins short but loses more at long
    contexts (as on an AVX2 imitation with 128-wide heads) gives way to SDPA, and the backend then
    runs its prefills through the torch path; the cached decision is spot-checked at the next start
    and `kvserve env` shows it."""
    from kvserve import env
    from kvserve.attention import get_backend
    from kvserve.kernels import paged_attention

    backend = get_backend("cpu")
    probe = torch.empty(1, 8, 64)
    if not paged_attention.supports_prefill(probe, probe):
        pytest.skip("no prefill kernel at this ISA level: nothing to choose")
    short, long = (f"{q}x{n}" for q, n in tuning.ATTENTION_CASES)
    clock = use_clock(monkeypatch, attention_clock({"kernel": {short: 0.010, long: 0.080},
                                                    "sdpa": {short: 0.020, long: 0.060}}))
    with caplog.at_level("INFO", logger=LOGGER):
        backend.tune(8, 2, 64, torch.float32)
    assert not backend.prefill_kernel and "prefill attention -> sdpa (measured" in caplog.text
    assert clock.count[f"kernel@attention {long}"] == evidence.ROUNDS
    assert prefill_kernel_calls(backend, monkeypatch) == []  # SDPA served the prefill
    (line,) = [env._tuning_line(e) for e in env._cache()["tuning"] if e["kind"] == "attention"]
    assert line.startswith("prefill attention: sdpa chosen; kernel 10.00 ms at 256x512, 80.00 ms at 256x2048;")
    use_clock(monkeypatch, attention_clock({"kernel": {short: 0.010, long: 0.030},
                                            "sdpa": {short: 0.020, long: 0.060}}))
    caplog.clear()
    monkeypatch.setattr(evidence, "_checked", {})  # the next start
    with caplog.at_level("INFO", logger=LOGGER):
        get_backend("cpu").tune(8, 2, 64, torch.float32)  # the spot check disagrees: measured again
    assert "prefill attention -> kernel (measured: " in caplog.text


def test_prefill_attention_offers_bf16_products_only_where_allowed(cache, monkeypatch):
    """The kernel with bfloat16 products is a candidate only when the caller allows it (the model's
    prefill linears take int8 codes) and this build and CPU have them; chosen, the backend's
    prefills of 16 rows or more run it, shorter ones the float32 kernel."""
    from kvserve.attention import get_backend
    from kvserve.kernels import paged_attention

    probe = torch.empty(1, 8, 64)
    if not paged_attention.supports_prefill(probe, probe):
        pytest.skip("no prefill kernel at this ISA level: nothing to choose")
    short, long = (f"{q}x{n}" for q, n in tuning.ATTENTION_CASES)
    times = {"kernel": {short: 0.010, long: 0.040}, "sdpa": {short: 0.020, long: 0.060},
             "kernel_bf16": {short: 0.008, long: 0.030}}
    clock = use_clock(monkeypatch, attention_clock(times))
    backend = get_backend("cpu")
    backend.tune(8, 2, 64, torch.float32)  # not allowed: never measured
    assert backend.prefill_kernel and not backend.prefill_bf16
    assert not any(label.startswith("kernel_bf16@") for label in clock.count)
    backend.tune(8, 2, 64, torch.float32, bf16_products=True)
    if not paged_attention.bf16_products():  # no AVX512-BF16 here, or a build without it
        assert not backend.prefill_bf16 and not any(label.startswith("kernel_bf16@") for label in clock.count)
        return
    assert backend.prefill_kernel and backend.prefill_bf16
    assert clock.count[f"kernel_bf16@attention {long}"] == evidence.ROUNDS
    calls = prefill_kernel_calls(backend, monkeypatch, tuning.BF16_DENSE_MIN_ROWS)
    assert len(calls) == 1 and calls[0][-1] is True  # bf16=True
    # a chunk of fewer rows than the linears' bfloat16 and int8 paths take keeps float32 products
    calls = prefill_kernel_calls(backend, monkeypatch, tuning.BF16_DENSE_MIN_ROWS - 1)
    assert len(calls) == 1 and calls[0][-1] is False


def test_prefill_attention_is_measured_over_the_cache_dtype(cache, monkeypatch):
    """A float32 model with a bfloat16 cache (a GGUF's default K/V) times its candidates over
    bfloat16 caches, as its own decision: a float32 cache's is not taken for it."""
    from kvserve.attention import get_backend
    from kvserve.kernels import paged_attention

    probe = torch.empty(1, 8, 64)
    if not paged_attention.supports_prefill(probe, probe.bfloat16()):
        pytest.skip("no prefill kernel at this ISA level: nothing to choose")
    short, long = (f"{q}x{n}" for q, n in tuning.ATTENTION_CASES)
    clock = use_clock(monkeypatch, attention_clock({"kernel": {short: 0.010, long: 0.040},
                                                    "sdpa": {short: 0.020, long: 0.060}}))
    backend = get_backend("cpu")
    seen = []
    candidates = backend._prefill_candidates

    def spy(hq, hkv, d, dtype, kv_dtype, bf16, q_len, length):
        made = candidates(hq, hkv, d, dtype, kv_dtype, bf16, q_len, length)
        seen.append((dtype, kv_dtype))
        return made

    monkeypatch.setattr(backend, "_prefill_candidates", spy)
    backend.tune(8, 2, 64, torch.float32)
    measured = clock.count[f"kernel@attention {long}"]
    assert measured == evidence.ROUNDS and set(seen) == {(torch.float32, torch.float32)}
    seen.clear()
    backend.tune(8, 2, 64, torch.float32, kv_dtype=torch.bfloat16)
    assert clock.count[f"kernel@attention {long}"] == 2 * measured  # measured again, not the float32 cache's
    assert set(seen) == {(torch.float32, torch.bfloat16)} and backend.prefill_kernel
