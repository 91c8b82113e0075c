"""The engine's side of structured outputs: a matcher per sequence, the step's token bitmask, and
the tokens each sequence accepted.

A constrained request is added as soon as it is validated; its grammar compiles on the cache's
pool while the request waits (the scheduler's readiness predicate, `is_ready`). Once compiled,
each sequence (each child of an n > 1 request) gets its own matcher.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured.backend import ConstraintKey, GrammarBackend, Matcher, StructuredOutputError, constraint_key
from kvserve.structured.cache import CompileCache
from kvserve.structured.registry import backend_class, resolve

_CHECKED_CAPACITY = 1024


@dataclass
class GrammarBitmask:
    """Row i of `bitmask` (int32 words, bit t % 32 of word t // 32 = token t allowed) constrains the
    sampling of req_ids[i] this step."""

    req_ids: list[str]
    bitmask: np.ndarray


class StructuredOutputManager:
    """Threads: the engine thread calls every method; the backend is built and grammars compile on
    the cache's pool (`_build` takes the lock so both sides see one backend)."""

    def __init__(self, backend: str, tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> None:
        self.backend_name = resolve(backend)
        self.backend_cls = backend_class(self.backend_name)  # imports the library once, here
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._backend: GrammarBackend | None = None
        self._lock = threading.Lock()
        self.cache = CompileCache(self._compile)
        self._checked: dict[ConstraintKey, None] = {}
        self.pending: dict[str, Future] = {}  # request id -> its compile
        self.matchers: dict[str, Matcher] = {}
        # The cost on the engine's step: seconds filling bitmasks, steps that had one, rows filled.
        self.mask_seconds = 0.0
        self.mask_steps = 0
        self.mask_rows = 0

    # ---- on the pool --------------------------------------------------------

    def backend(self) -> GrammarBackend:
        with self._lock:
            if self._backend is None:
                if self.eos_token_id is None:
                    raise StructuredOutputError("structured_outputs: the model's tokenizer has no end-of-sequence "
                                                "token, which a grammar needs to end")
                self._backend = self.backend_cls.from_tokenizer(
                    self.tokenizer, self.vocab_size, self.eos_token_id)
            return self._backend

    def _compile(self, key: ConstraintKey) -> Any:
        return self.backend().compile(key)

    # ---- requests -----------------------------------------------------------

    def check(self, params: StructuredOutputsParams) -> None:
        """Raise StructuredOutputError naming the field if the constraint cannot compile (parsed once per text)."""
        key = constraint_key(params)
        if key in self._checked:
            return
        self.backend_cls.check(key)
        self._checked[key] = None
        if len(self._checked) > _CHECKED_CAPACITY:
            del self._checked[next(iter(self._checked))]

    def add(self, request_id: str, params: StructuredOutputsParams) -> None:
        self.pending[request_id] = self.cache.get(constraint_key(params))

    def poll(self) -> dict[str, str]:
        """Give a matcher to each request whose grammar compiled; returns those whose compile failed (id -> why)."""
        failed: dict[str, str] = {}
        for rid in [r for r, fut in self.pending.items() if fut.done()]:
            fut = self.pending.pop(rid)
            err = fut.exception()
            if err is None:
                self.matchers[rid] = self.backend().matcher(fut.result())
            elif isinstance(err, StructuredOutputError):
                failed[rid] = str(err)
            else:
                failed[rid] = f"structured_outputs: the grammar failed to compile: {type(err).__name__}: {err}"
        return failed

    def is_ready(self, request_id: str) -> bool:
        """False while the request's grammar compiles (the scheduler leaves it waiting)."""
        return request_id not in self.pending

    def wait(self, timeout: float) -> None:
        """Block until a compile finishes (or timeout): for an engine with nothing else to run."""
        if self.pending:
            wait_futures(set(self.pending.values()), timeout=timeout, return_when=FIRST_COMPLETED)

    def release(self, request_id: str) -> None:
        self.pending.pop(request_id, None)
        self.matchers.pop(request_id, None)

    # ---- each step ------------------------------------------------------------

    def bitmask(self, sampling_ids: list[str]) -> GrammarBitmask | None:
        """The rows of the constrained requests among those that sample this step (None: none)."""
        rids = [r for r in sampling_ids if r in self.matchers]
        if not rids:
            return None
        start = time.perf_counter()
        mask = self.backend().allocate_bitmask(len(rids))
        for row, rid in enumerate(rids):
            self.matchers[rid].fill_bitmask(mask, row)
        self.mask_seconds += time.perf_counter() - start
        self.mask_steps += 1
        self.mask_rows += len(rids)
        return GrammarBitmask(rids, mask)

    def accept(self, tokens: dict[str, int]) -> tuple[list[str], dict[str, str]]:
        """Advance the matchers by the tokens sampled this step. Returns the requests whose grammar
        ended (they finish as stopped) and those whose token the grammar rejected (id -> why)."""
        terminated: list[str] = []
        failed: dict[str, str] = {}
        for rid, token in tokens.items():
            m = self.matchers.get(rid)
            if m is None:
                continue
            if not m.accept(token):
                failed[rid] = f"structured_outputs: token {token} does not fit the grammar"
                self.matchers.pop(rid)
            elif m.is_terminated():
                terminated.append(rid)
        return terminated, failed

    def close(self) -> None:
        self.cache.close()
