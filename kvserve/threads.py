"""Intra-op threads on a CPU shared with other work (issue 32): how waiting threads wait, and how many.

Threads meet at barriers between ops (torch's OpenMP regions, decode_stack's `omp barrier`). By
default libgomp spins ~300000 pause loops (several ms here) before it sleeps, so when another
process takes a core, the thread that lost it stalls the others at every barrier while they burn
the remaining core spinning: measured on 2 cores beside busy processes, a 32-token reply of the
default model took 17-40 s at 2 threads and 0.9 s at one. Two remedies, both here:

- `set_wait_policy`: GOMP_SPINCOUNT (spin, then futex-sleep) for every OpenMP runtime of the
  process. torch's OpenMP and the C kernels' are one libgomp (same soname), which reads the
  variable once, when it loads: kvserve/__init__ imports this module before anything imports torch. A user
  setting of GOMP_SPINCOUNT or OMP_WAIT_POLICY wins. The count is chosen by measurement
  (BENCHMARKS.md, "Shared CPU").
- `ThreadPolicy`: the engine lowers its thread count while steps are far slower than they were
  quiet, and probes to raise it again.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

# libgomp spins this many pause loops (~30 ns each on Zen 3) at a barrier before it sleeps. Measured
# (2-core EPYC, 135M decode, medians; BENCHMARKS.md "Shared CPU"): 3000 keeps quiet speed (0 cost 21%,
# a futex wake at every barrier) and contended speed within 5% of 0 (libgomp's 300000: 27% below).
DEFAULT_SPINCOUNT = "3000"
WAIT_VARS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def _libgomp_loaded() -> bool:
    try:
        with open("/proc/self/maps") as f:
            return "libgomp" in f.read()
    except OSError:
        return False


_state: dict[str, str | bool] = {}


def set_wait_policy() -> None:
    """GOMP_SPINCOUNT=DEFAULT_SPINCOUNT unless the user set a wait policy; once per process.
    Records whether libgomp had loaded already (then the setting reaches only child processes)."""
    if _state:
        return
    user = any(v in os.environ for v in WAIT_VARS)
    if not user:
        os.environ["GOMP_SPINCOUNT"] = DEFAULT_SPINCOUNT
    _state.update(set_by="user" if user else "kvserve", too_late=_libgomp_loaded())


set_wait_policy()  # on import: kvserve/__init__ imports this module before anything loads libgomp


def wait_policy() -> str:
    """The wait policy as one line for `kvserve env` and logs."""
    vals = ", ".join(f"{v}={os.environ[v]}" for v in WAIT_VARS if v in os.environ) or "libgomp's default"
    line = f"{vals} (set by {_state.get('set_by', 'nobody')})"
    if _state.get("too_late"):
        line += "; libgomp loaded before kvserve, so this process keeps the wait it started with"
    return line


def _bucket(tokens: int) -> int:
    """Steps are compared with steps of about the same size: token counts rounded up to a power of 2."""
    return 1 << max(0, tokens - 1).bit_length()


@dataclass
class ThreadPolicy:
    """How many intra-op threads the engine runs, from its own step times.

    Rule: each (thread count, token bucket) keeps an EWMA of its step time; a step more than
    `slow` x its EWMA is slow and not averaged in (contention never becomes the norm). At `full`
    threads, `patience` slow steps in a row mean the cores are taken: drop to `low` (half, at least
    one). At `low`, after `probe_every` steps, run `probe_steps` steps at `full`: if the faster of
    them is no slower than the EWMA at `low` for that bucket (cores free again, or `full` wins even
    shared), stay at `full`; otherwise go back to `low` and double `probe_every` (up to
    `max_probe_every`; reset when a probe succeeds). `observe` returns the count to switch to, or None.
    The engine applies it (torch.set_num_threads; the C kernels take torch's count); `--cpu-threads N`
    turns the policy off.
    """

    full: int
    slow: float = 2.0
    patience: int = 4
    probe_every: int = 32
    probe_steps: int = 2
    max_probe_every: int = 1024
    alpha: float = 0.1
    threads: int = field(init=False)
    low: int = field(init=False)
    _ewma: dict[tuple[int, int], float] = field(default_factory=dict, init=False)
    _streak: int = field(default=0, init=False)
    _since: int = field(default=0, init=False)  # steps at low since the last probe
    _probe: list[float] | None = field(default=None, init=False)  # a probe's step times while it runs
    _every: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        self.threads, self.low, self._every = self.full, max(1, self.full // 2), self.probe_every

    def observe(self, seconds: float, tokens: int) -> int | None:
        """Take one step's wall time (`tokens` scheduled, run at self.threads); the new count or None."""
        if self.full == self.low or tokens <= 0:
            return None
        b = _bucket(tokens)
        if self._probe is not None:  # probing: judged against the steps at low
            return self._judge_probe(seconds, b)
        slow = self._record(self.threads, b, seconds)
        if self.threads == self.full:
            self._streak = self._streak + 1 if slow else 0
            if self._streak >= self.patience:
                return self._switch(self.low)
            return None
        self._since += 1
        if self._since >= self._every:
            self._probe = []
            return self._switch(self.full)
        return None

    def _record(self, threads: int, b: int, seconds: float) -> bool:
        """Average the step in unless it is slow; whether it was."""
        key = (threads, b)
        mean = self._ewma.get(key)
        if mean is not None and seconds > self.slow * mean:
            return True
        self._ewma[key] = seconds if mean is None else mean + self.alpha * (seconds - mean)
        return False

    def _judge_probe(self, seconds: float, b: int) -> int | None:
        self._probe.append(seconds)
        if len(self._probe) < self.probe_steps:
            return None
        best, at_low = min(self._probe), self._ewma.get((self.low, b))
        self._probe = None
        if at_low is None or best <= at_low:
            self._every = self.probe_every
            return None  # stay at full
        self._every = min(2 * self._every, self.max_probe_every)
        return self._switch(self.low)

    def _switch(self, threads: int) -> int:
        self.threads, self._streak, self._since = threads, 0, 0
        return threads


ADAPTIVE_ENV = "KVSERVE_ADAPTIVE_THREADS"  # 0: keep the start-up count


def adaptive_off_reason(config) -> str | None:
    """Why an engine with `config` keeps a fixed thread count, or None when the policy runs."""
    par = config.parallel
    if os.environ.get(ADAPTIVE_ENV, "1") == "0":
        return f"{ADAPTIVE_ENV}=0"
    if par.cpu_threads is not None:
        return f"--cpu-threads {par.cpu_threads} pins the count"
    if par.world_size > 1:
        return "ranks run in their own processes"
    if str(config.device).split(":")[0] != "cpu":
        return f"device {config.device}"
    return None


def policy_for(config) -> ThreadPolicy | None:
    """The policy for an engine whose one rank runs in this process, or None (adaptive_off_reason)."""
    import torch

    return None if adaptive_off_reason(config) else ThreadPolicy(full=torch.get_num_threads())


def set_threads(n: int) -> None:
    """Run n intra-op threads from the next op on (torch's; the C kernels take torch's count)."""
    import torch

    logger.info("intra-op threads %d -> %d (step times against quiet ones; %s)", torch.get_num_threads(), n,
                ADAPTIVE_ENV + "=0 keeps the count")
    torch.set_num_threads(n)
