"""Compiled grammars by constraint, compiled on a thread pool so the engine's step never waits."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Hashable
from typing import Any, Callable

DEFAULT_CAPACITY = 256


class CompileCache:
    """key (a constraint, with the backend that compiles it) -> Future of its compiled grammar; a failure is cached too (the same text fails again).
    Least recently used entries go first beyond `capacity`.

    Threads: `get` is called by the engine thread; compiles run on the pool and touch only the
    compile function and their own future. The lock guards the table."""

    def __init__(self, compile_fn: Callable[[Any], Any], max_workers: int = 1,
                 capacity: int = DEFAULT_CAPACITY) -> None:
        self.compile_fn = compile_fn
        self.capacity = capacity
        self.pool = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kvserve-grammar",
                                       initializer=_yield_to_the_step)
        self._lock = threading.Lock()
        self._entries: OrderedDict[Hashable, Future] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: Hashable) -> Future:
        with self._lock:
            fut = self._entries.get(key)
            if fut is not None:
                self.hits += 1
                self._entries.move_to_end(key)
                return fut
            self.misses += 1
            fut = self.pool.submit(self.compile_fn, key)
            self._entries[key] = fut
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)  # a request holding its future keeps it alive
            return fut

    def __len__(self) -> int:
        return len(self._entries)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _yield_to_the_step() -> None:
    """A compile thread runs at the lowest priority (Linux: a thread's own nice value): on a
    machine whose cores the step's threads fill, it takes the time they leave instead of slowing
    the step (scripts/bench_structured.py measures the steps while a compile runs)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not allowed: run at the normal priority
        pass
