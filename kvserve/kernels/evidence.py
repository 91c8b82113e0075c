"""The evidence behind kvserve's tuning decisions (tuning.py): timing that one noisy run cannot
fool, and the cache of decisions with when and how noisily they were measured.

A measurement taken while the machine was busy once cached float16 as fastest and cost 2.6x on
every later start, until the file was deleted by hand. So:

- `time_interleaved`: ROUNDS rounds, each calling every candidate once in a rotated order; each
  candidate's median, and the spread of its rounds (IQR / median). When the two best are closer
  than their spread, up to EXTRA_PASSES more passes.
- `decide`: a cached entry (JSON under `<cache_dir>/tuning/`, keyed by the CPU, ISA level, torch
  version, threads and what was measured) is used only if `staleness` finds nothing (older than
  STALE_DAYS; typical spread above NOISY, once NOISY_RETRY_S old; another kvserve version; made
  before `kvserve tune` asked) and a `spot_check` of the chosen candidate against the runner-up
  agrees with the cached ranking; otherwise it is measured again and rewritten, with `made` (unix
  time) and `version`. An entry measured or spot-checked less than SHARED_START_S ago (`checked`)
  is used without a spot check of its own, and one process at a time decides each entry (a lock
  file beside it): engines started together on one machine (a router's replicas, P/D's prefill
  and decode engines) must make the same choices, or their K/V cannot be exchanged, and two spot
  checks (or measurements) run while the other engine loads can come out differently.

Candidates are timed on one thread (`one_thread`). A parallel region waits for its slowest
thread, so while a neighbour holds a core every multi-threaded call costs a scheduler quantum
(~8 ms on a 2-core VM) and the candidates tie: one busy start cached float32 activations for a
1.1B model whose int16 kernel is 1.5x faster. On one thread a neighbour slows every candidate
alike, which the interleaved rounds cancel; and the ranking carries over to the engine's threads,
each of which runs the same kernel on an even share of the rows.

`_timed` is the only clock: tests replace it to inject timings.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from kvserve import __version__
from kvserve.kernels import build, cpu

logger = logging.getLogger(__name__)

ROUNDS, EXTRA_PASSES = 5, 2
NOISE_FLOOR = 0.05  # spreads below this are a quiet machine: more rounds would not move a choice
NOISY = 0.20  # a cached entry whose typical spread is above this was measured on a busy machine
# ... and is measured again once this old: the machine may be quiet by then, and a busy hour's
# starts do not each pay for a full measurement (50 s for the default model at load 7; the spot
# check still guards them)
NOISY_RETRY_S = 3600
STALE_DAYS = 30  # drivers, BIOS and neighbours change; a month-old choice is measured in full
SHARED_START_S = 60  # an entry measured or spot-checked this recently is taken as it is
SPOT_REPS = 2
SPOT_TOLERANCE = 1.3  # how much slower than the runner-up a spot check may find the chosen candidate
# Unix time set by `kvserve tune`: entries made before it are measured again (in every process).
TUNE_BEFORE_ENV = "KVSERVE_TUNE_BEFORE"
# Entries already spot-checked or measured in this process, by path: (file mtime, entry). The
# engine resolves the dtype twice per start (engine core, then worker); one spot check is enough.
_checked: dict[Path, tuple[int, dict]] = {}


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """torch (and so the C kernels, which take torch.get_num_threads()) on one thread inside."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _timed(label: str, fn: Callable[[], object]) -> float:
    """Seconds one call of fn takes. Tests replace this to inject timings by label
    ('<candidate>@<where>', as time_interleaved and spot_check name them)."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _spread(samples: list[float]) -> float:
    """IQR / median: one outlier among five rounds moves neither quartile."""
    if len(samples) < 2:
        return 0.0
    q1, med, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    return (q3 - q1) / med if med > 0 else 0.0


def _undecided(stats: dict[str, dict[str, float]], gains: dict[str, float], sides: dict[str, str]) -> bool:
    """Whether the two best sides (each side's best candidate, its time scaled by the margin it
    needs) are closer than the spread of their rounds, so more rounds could change which wins."""
    best: dict[str, tuple[str, float]] = {}
    for name, s in stats.items():
        side, t = sides.get(name, name), s["median"] * gains.get(name, 1.0)
        if side not in best or t < best[side][1]:
            best[side] = (name, t)
    if len(best) < 2:
        return False
    (a, ta), (b, tb) = sorted(best.values(), key=lambda p: p[1])[:2]
    gap = tb / ta - 1 if ta > 0 else float("inf")
    return max(stats[a]["spread"], stats[b]["spread"]) > max(gap, NOISE_FLOOR)


def time_interleaved(fns: dict[str, Callable[[], object]], where: str, gains: dict[str, float] | None = None,
                     sides: dict[str, str] | None = None, rounds: int = ROUNDS) -> dict[str, dict[str, float]]:
    """name -> {"median", "spread", "rounds"} of candidates timed against each other.

    One warm-up call each, then `rounds` rounds that call every candidate once, the order rotated
    per round: a burst from a neighbour then slows one round of every candidate rather than all
    of one. If the rounds cannot separate the two best (`_undecided`; `sides` groups candidates
    whose order among themselves is decided elsewhere, e.g. the kernel's modes against the dense
    path), up to EXTRA_PASSES more passes, medians over all of them."""
    names = list(fns)
    for name in names:
        fns[name]()
    samples: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(1 + EXTRA_PASSES):
        for _ in range(rounds):
            k = len(samples[names[0]]) % len(names)
            for name in names[k:] + names[:k]:
                samples[name].append(_timed(f"{name}@{where}", fns[name]))
        stats = {n: {"median": statistics.median(s), "spread": _spread(s), "rounds": len(s)}
                 for n, s in samples.items()}
        if not _undecided(stats, gains or {}, sides or {}):
            break
    return stats


# (where, chosen name, its fn, runner-up name, its fn, cached time ratio chosen / runner-up)
SpotPair = tuple[str, str, Callable[[], object], str, Callable[[], object], float]


def spot_check(pairs: list[SpotPair]) -> str | None:
    """Time each pair's chosen candidate and runner-up SPOT_REPS times, interleaved; the first pair
    whose ratio chosen / runner-up (the least time of each: a busy moment only adds time) turns the
    cached ranking around by more than SPOT_TOLERANCE, described; None when all agree. A ratio that
    merely shrinks (the chosen 20x faster in the cache, 3x now) does not change the choice."""
    for where, a, fa, b, fb, cached in pairs:
        ta, tb = [], []
        for _ in range(SPOT_REPS):
            ta.append(_timed(f"{a}@{where}", fa))
            tb.append(_timed(f"{b}@{where}", fb))
        ratio = min(ta) / max(min(tb), 1e-12)
        # cached above 1: chosen for a margin it did not need to win on speed (float32 over a
        # slightly faster bfloat16); the spot check asks only that it is not much slower still
        if ratio > max(cached, 1.0) * SPOT_TOLERANCE:
            return f"spot check disagrees: {a}/{b} at {where} {ratio:.2f}x, cached {cached:.2f}x"
    return None


def tuning_dir() -> Path:
    return build.cache_dir() / "tuning"


def cache_path(kind: str, what: object) -> Path:
    key = json.dumps([kind, cpu.cpu_model(), sorted(cpu.cpu_flags()), cpu.isa_level(), torch.__version__,
                      torch.get_num_threads(), what], default=str)
    return tuning_dir() / f"{kind}_{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def clear_cache() -> int:
    """Delete every cached tuning decision; how many there were."""
    paths = list(tuning_dir().glob("*.json"))
    for path in paths:
        path.unlink(missing_ok=True)
    _checked.clear()
    return len(paths)


def _leaves(tree: object) -> Iterator[float]:
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    elif isinstance(tree, (int, float)):
        yield float(tree)


def entry_noise(entry: dict) -> float:
    """An entry's typical spread (the median over its candidates' rounds): high when the machine
    was busy throughout, not when one tiny timing jittered."""
    spreads = list(_leaves(entry.get("noise", {})))
    return statistics.median(spreads) if spreads else 0.0


def staleness(entry: dict | None, now: float | None = None) -> str | None:
    """Why a cached entry must be measured again before it is used; None if it may be (after its
    spot check)."""
    if entry is None:
        return "nothing cached"
    made = entry.get("made")
    if not isinstance(made, (int, float)):
        return "cached without its evidence (before rounds were recorded)"
    now = time.time() if now is None else now
    asked = os.environ.get(TUNE_BEFORE_ENV)
    if asked and made < float(asked):
        return "re-measure asked (kvserve tune)"
    if abs(now - made) > STALE_DAYS * 86400:
        return f"stale: made {(now - made) / 86400:.0f} days ago"
    if entry.get("version") != __version__:
        return f"made by kvserve {entry.get('version')}"
    if entry.get("threads") != 1:
        return "timed on several threads (candidates tie while a neighbour holds a core)"
    if (noise := entry_noise(entry)) > NOISY and now - made >= NOISY_RETRY_S:
        return f"noisy: its rounds spread {noise:.0%}"
    return None


def _mtime(path: Path) -> int | None:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


def _read(path: Path) -> dict | None:
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return entry if isinstance(entry, dict) else None


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One process at a time decides the entry at path (an flock, released if the process dies);
    without a writable cache directory, no lock."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _write(path: Path, entry: dict) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entry, indent=1))
        os.replace(tmp, path)
        _checked[path] = (_mtime(path), entry)
    except OSError as e:
        logger.debug("tuning cache %s not written: %s", path, e)


def decide(kind: str, what: object, measure: Callable[[], dict],
           spot: Callable[[dict], str | None]) -> tuple[dict, str]:
    """The cached entry if it is fresh and its spot check agrees (or it was measured or checked
    less than SHARED_START_S ago), else measure() (written back); and how, for the log line."""
    path = cache_path(kind, what)
    with _locked(path):
        return _decide(path, measure, spot)


def _decide(path: Path, measure: Callable[[], dict], spot: Callable[[dict], str | None]) -> tuple[dict, str]:
    entry = _read(path)
    try:
        why = staleness(entry)
    except ValueError as e:  # a TUNE_BEFORE_ENV that is no number
        why = f"re-measure asked ({e})"
    if why is None:
        mtime = _mtime(path)
        if mtime is not None and _checked.get(path, (None,))[0] == mtime:
            return entry, "cached, checked earlier in this process"
        now = time.time()
        age = now - max(entry["made"], entry.get("checked", 0.0))
        if 0 <= age < SHARED_START_S:
            _checked[path] = (mtime, entry)
            return entry, f"cached, measured or checked {age:.0f} s ago"
        try:
            with one_thread():
                why = spot(entry)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
            why = f"unreadable entry ({type(e).__name__}: {e})"
        if why is None:
            entry = {**entry, "checked": now}
            _write(path, entry)
            return entry, "cached, spot check agrees"
    with one_thread():
        measured = measure()
    entry = {**measured, "made": time.time(), "version": __version__, "threads": 1}
    _write(path, entry)
    return entry, f"measured: {why}"
