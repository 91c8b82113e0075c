"""Loads of a request's K/V that run off the engine thread, for every KV connector that has them
(the KV tiers' prefetch from disk and the remote store, a decode engine's fetch from its prefill
engine): one implementation of start, cancel, finish and failure.

A connector's `start_load` calls `begin(request_id)` and hands `run(request_id, load)` to a thread;
`load` returns what it brought (kept until the engine takes it) or raises (the request's load
error). `finished_loading`, `load_error` and `wait` read it back; `forget` calls `cancel`, after
which whatever the load still brings is dropped and the request is never reported.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any


# A step with no token scheduled while the ranks load for waiting requests: how long the worker
# role waits in the step for a load to finish (it returns as soon as one does). The engine itself
# does not sleep then, so a finished load is seen at once, not at the next poll.
IDLE_WAIT_S = 0.01


class FinishedLoads:
    """Request ids whose background load has finished, handed from loader threads to the engine
    thread: what a connector's `finished_loading` and `wait` read."""

    def __init__(self) -> None:
        self._ids: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._event = threading.Event()

    def put(self, request_id: str) -> None:
        self._ids.put(request_id)
        self._event.set()

    def drain(self) -> list[str]:
        out = []
        while True:
            try:
                out.append(self._ids.get_nowait())
            except queue.Empty:
                self._event.clear()
                return out

    def wait(self, timeout: float) -> None:
        """Until a load finishes (one not drained yet counts) or `timeout` passes."""
        self._event.wait(timeout)


class BackgroundLoads:
    """Threads: the engine thread calls everything but `run`, which runs on a loader thread (one
    per load under way) and may call `cancelled`. What they share is under `_lock`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running: set[str] = set()
        self._cancelled: set[str] = set()  # ... of those, the ones forgotten meanwhile
        self._results: dict[str, Any] = {}
        self._errors: dict[str, str] = {}
        self._done = FinishedLoads()

    def begin(self, request_id: str) -> None:
        """A load for the request is about to be handed to a thread."""
        with self._lock:
            self._running.add(request_id)

    def cancelled(self, request_id: str) -> bool:
        """Whether the engine forgot the request (a long load may stop early)."""
        with self._lock:
            return request_id in self._cancelled

    def run(self, request_id: str, load: Callable[[], Any]) -> None:
        """On the loader thread: keep what `load()` returns (None: nothing), or its exception's
        message as the request's load error; then report the request finished, unless it was
        cancelled meanwhile."""
        result, error = None, None
        try:
            result = load()
        except Exception as e:  # noqa: BLE001 - any failure is the request's load error
            error = str(e) or type(e).__name__
        with self._lock:
            self._running.discard(request_id)
            if request_id in self._cancelled:
                self._cancelled.discard(request_id)
                return
            if result is not None:
                self._results[request_id] = result
            if error is not None:
                self._errors[request_id] = error
        self._done.put(request_id)

    def peek(self, request_id: str) -> Any:
        """What the request's finished load brought (None: nothing), left in place."""
        with self._lock:
            return self._results.get(request_id)

    def take(self, request_id: str) -> Any:
        with self._lock:
            return self._results.pop(request_id, None)

    def error(self, request_id: str) -> str | None:
        with self._lock:
            return self._errors.pop(request_id, None)

    def cancel(self, request_id: str) -> None:
        """The request is gone: drop what its load brought, and what it still brings."""
        with self._lock:
            self._results.pop(request_id, None)
            self._errors.pop(request_id, None)
            if request_id in self._running:
                self._cancelled.add(request_id)

    def finished(self) -> list[str]:
        return self._done.drain()

    def wait(self, timeout: float) -> None:
        """Until a load finishes (one not reported yet counts) or `timeout` passes; at once when
        no load runs."""
        with self._lock:
            if not self._running:
                return
        self._done.wait(timeout)
