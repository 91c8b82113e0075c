"""The engine's side of structured outputs: a matcher per sequence, the step's token bitmask, and
the tokens each sequence accepted.

A constrained request is added as soon as it is validated; its grammar compiles on the cache's
pool while the request waits (the scheduler's readiness predicate, `is_ready`). Once compiled,
each sequence (each child of an n > 1 request) gets its own matcher.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Any

import numpy as np

from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured.backend import ConstraintKey, GrammarBackend, Matcher, StructuredOutputError, constraint_key
from kvserve.structured.cache import CompileCache
from kvserve.structured.registry import backend_class, candidates

_CHECKED_CAPACITY = 1024
_PROMPT_TAIL = 16  # prompt tokens read for a reasoning end already there (the generation prompt)


class GrammarBitmask:
    """Rows of `bitmask` (int32 words, bit t % 32 of word t // 32 = token t allowed) constrain the
    sampling of req_ids[i] this step: `counts[i]` rows each, in order (1, or a request verifying k
    drafted tokens: k + 1, the rows after each prefix of its drafts). The rows are filled on the
    manager's mask thread while the step's forward runs; reading `bitmask` (the sampler, after the
    forward) waits for the fill, and so does pickling it (an executor that sends the step to other
    processes)."""

    def __init__(self, req_ids: list[str], bitmask: np.ndarray, filled: Future | None = None,
                 counts: list[int] | None = None) -> None:
        self.req_ids = req_ids
        self.counts = counts if counts is not None else [1] * len(req_ids)
        self._bitmask = bitmask
        self._filled = filled

    @property
    def bitmask(self) -> np.ndarray:
        if self._filled is not None:
            self._filled.result()  # re-raises a fill that failed
            self._filled = None
        return self._bitmask

    def first_rows(self) -> dict[str, int]:
        """Each request's first row."""
        out, row = {}, 0
        for rid, n in zip(self.req_ids, self.counts):
            out[rid] = row
            row += n
        return out

    def __getstate__(self) -> dict[str, Any]:
        return {"req_ids": self.req_ids, "counts": self.counts, "_bitmask": self.bitmask, "_filled": None}


class _ReasoningGate:
    """A sequence constrained only after its reasoning ends (StructuredOutputsParams.reasoning_end):
    its tokens are decoded one by one into a short tail until the tail holds the end text. The end
    text is ASCII ("</think>"), so single-token decodes put it together exactly."""

    def __init__(self, end: str) -> None:
        self.end = end
        self.tail = ""

    def feed(self, text: str) -> bool:
        """True once the end text has come."""
        self.tail = (self.tail + text)[-4 * len(self.end) - 64:]
        return self.end in self.tail

    def opens_at(self, tokens: list[int], decode: Any) -> int | None:
        """The index of the token among `tokens` after which the end text has come (None: not
        within them); the gate itself does not move."""
        probe = _ReasoningGate(self.end)
        probe.tail = self.tail
        for i, t in enumerate(tokens):
            if probe.feed(decode([t])):
                return i
        return None


class StructuredOutputManager:
    """`backend` is a name or `auto`; under `auto` each constraint goes to the first backend that
    takes it (registry.candidates). Threads: the engine thread calls every method; backends are
    built and grammars compile on the cache's pool (`backend` takes the lock, so both sides see one
    instance of each)."""

    def __init__(self, backend: str, tokenizer: Any, vocab_size: int, eos_token_id: int | None) -> None:
        self.names = candidates(backend)
        self.classes = {n: backend_class(n) for n in self.names}  # imports the libraries once, here
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._backends: dict[str, GrammarBackend] = {}
        self._lock = threading.Lock()
        self.cache = CompileCache(self._compile)
        # Fills the step's bitmask while the forward runs (normal priority: the step waits for it).
        self._masks = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-grammar-mask")
        self._last_fill: Future | None = None  # keyed by (backend name, constraint)
        self._checked: dict[ConstraintKey, str] = {}  # constraint -> the backend that takes it
        self.pending: dict[str, tuple[str, Future]] = {}  # request id -> (backend, its compile)
        self.matchers: dict[str, Matcher] = {}
        # Sequences still reasoning: their grammar starts when the reasoning ends.
        self.gates: dict[str, _ReasoningGate] = {}
        # The cost on the engine's step: seconds filling bitmasks, steps that had one, rows filled.
        self.mask_seconds = 0.0
        self.mask_steps = 0
        self.mask_rows = 0

    # ---- on the pool --------------------------------------------------------

    def backend(self, name: str | None = None) -> GrammarBackend:
        """The backend `name` (default: the first candidate) for this vocabulary, built on first use."""
        name = name or self.names[0]
        with self._lock:
            if name not in self._backends:
                if self.eos_token_id is None:
                    raise StructuredOutputError("structured_outputs: the model's tokenizer has no end-of-sequence "
                                                "token, which a grammar needs to end")
                self._backends[name] = self.classes[name].from_tokenizer(
                    self.tokenizer, self.vocab_size, self.eos_token_id)
            return self._backends[name]

    def _compile(self, job: tuple[str, ConstraintKey]) -> Any:
        return self.backend(job[0]).compile(job[1])

    # ---- requests -----------------------------------------------------------

    def check(self, params: StructuredOutputsParams) -> str:
        """The backend that takes the constraint; raises StructuredOutputError naming the field (the
        first candidate's refusal) if none does. Parses, once per text; compiles nothing."""
        key = constraint_key(params)
        if key in self._checked:
            return self._checked[key]
        first: StructuredOutputError | None = None
        for name in self.names:
            try:
                self.classes[name].check(key)
            except StructuredOutputError as e:
                first = first or e
                continue
            self._checked[key] = name
            if len(self._checked) > _CHECKED_CAPACITY:
                del self._checked[next(iter(self._checked))]
            return name
        raise first

    def add(self, request_id: str, params: StructuredOutputsParams, prompt_token_ids: list[int] = ()) -> None:
        """Start (or share) the compile of a checked request's constraint. With a reasoning_end the
        grammar waits for it, unless the prompt's end already holds it (a chat template that closes
        the reasoning itself, as Qwen3's does with enable_thinking=false)."""
        name = self.check(params)
        self.pending[request_id] = (name, self.cache.get((name, constraint_key(params))))
        if params.reasoning_end is not None:
            gate = _ReasoningGate(params.reasoning_end)
            if not gate.feed(self.tokenizer.decode(list(prompt_token_ids)[-_PROMPT_TAIL:])):
                gate.tail = ""
                self.gates[request_id] = gate

    def poll(self) -> dict[str, str]:
        """Give a matcher to each request whose grammar compiled; returns those whose compile failed (id -> why)."""
        failed: dict[str, str] = {}
        for rid in [r for r, (_, fut) in self.pending.items() if fut.done()]:
            name, fut = self.pending.pop(rid)
            err = fut.exception()
            if err is None:
                self.matchers[rid] = self.backend(name).matcher(fut.result())
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
            wait_futures({fut for _, fut in self.pending.values()}, timeout=timeout, return_when=FIRST_COMPLETED)

    def release(self, request_id: str) -> None:
        self.pending.pop(request_id, None)
        self.matchers.pop(request_id, None)
        self.gates.pop(request_id, None)

    # ---- each step ------------------------------------------------------------

    def fit_drafts(self, request_id: str, drafts: list[int]) -> list[int]:
        """The longest prefix of a sequence's drafted tokens (speculative decoding) that its grammar
        allows: a draft the grammar refuses would be rejected by verification anyway, so it is not
        computed. Drafts while the sequence still reasons are free until the reasoning's end text;
        the grammar checks those after it. The matcher does not move."""
        m = self.matchers.get(request_id)
        if m is None or m.is_terminated():
            return []
        self._wait_fill()  # the last step's fill may still read the matcher
        if self.eos_token_id in drafts:  # a drafted end would end the grammar inside the step: it is sampled instead
            drafts = drafts[:drafts.index(self.eos_token_id)]
        start = 0
        gate = self.gates.get(request_id)
        if gate is not None:
            opened = gate.opens_at(drafts, self.tokenizer.decode)
            if opened is None:
                return drafts
            start = opened + 1
        return drafts[:start + m.validate(drafts[start:])]

    def bitmask(self, sampling_ids: list[str], drafts: dict[str, list[int]] | None = None) -> GrammarBitmask | None:
        """The rows of the constrained requests among those that sample this step (None: none),
        filled on the mask thread: the matchers are not advanced again before the step's tokens
        come back, and the sampler waits for the fill. A request verifying drafts (fit_drafts cut
        them) gets one row per prefix of its drafts: the matcher walks the drafts on the mask thread
        and comes back; rows while it still reasons allow every token."""
        drafts = drafts or {}
        jobs: list[tuple[Matcher, list[int], int]] = []  # (matcher, drafts, last draft index still reasoning)
        rids: list[str] = []
        for rid in sampling_ids:
            m, d = self.matchers.get(rid), drafts.get(rid, [])
            if m is None:
                continue
            gate = self.gates.get(rid)
            if gate is None:
                free = -1
            elif not d:
                continue
            else:
                opened = gate.opens_at(d, self.tokenizer.decode)
                free = len(d) if opened is None else opened
            rids.append(rid)
            jobs.append((m, d, free))
        if not rids:
            return None
        counts = [len(d) + 1 for _, d, _ in jobs]
        mask = np.zeros((sum(counts), (self.vocab_size + 31) // 32), dtype=np.int32)  # every backend's layout
        self._last_fill = self._masks.submit(self._fill, jobs, mask)
        return GrammarBitmask(rids, mask, self._last_fill, counts)

    def _fill(self, jobs: list[tuple[Matcher, list[int], int]], mask: np.ndarray) -> None:
        start = time.perf_counter()
        row = 0
        for m, drafts, free in jobs:
            walked, fits = 0, True
            for i in range(len(drafts) + 1):  # row i: the token after drafts[:i]
                if i - 1 > free and fits:  # drafts[i - 1] came after the reasoning: the grammar takes it
                    fits = m.accept(drafts[i - 1])
                    walked += fits
                if i > free and fits and not m.is_terminated():
                    m.fill_bitmask(mask, row + i)
                else:  # still reasoning; or past a draft the grammar refused or ended on (verification stops there)
                    mask[row + i] = -1
            m.rollback(walked)
            row += len(drafts) + 1
        with self._lock:
            self.mask_seconds += time.perf_counter() - start
            self.mask_steps += 1
            self.mask_rows += row

    def _wait_fill(self) -> None:
        if self._last_fill is not None:  # no matcher moves while a fill still reads it
            self._last_fill.result()
            self._last_fill = None

    def accept(self, tokens: dict[str, list[int]]) -> tuple[list[str], dict[str, str]]:
        """Advance the matchers by the tokens each sequence got this step (one, or accepted drafts
        and the token after them). Returns the requests whose grammar ended (they finish as stopped)
        and those whose token the grammar rejected (id -> why)."""
        self._wait_fill()
        terminated: list[str] = []
        failed: dict[str, str] = {}
        for rid, toks in tokens.items():
            m = self.matchers.get(rid)
            for token in toks if m is not None else ():
                gate = self.gates.get(rid)
                if gate is not None:  # still reasoning: the grammar starts after the end text
                    if gate.feed(self.tokenizer.decode([token])):
                        del self.gates[rid]
                    continue
                if not m.accept(token):
                    failed[rid] = f"structured_outputs: token {token} does not fit the grammar"
                    self.matchers.pop(rid)
                    break
                if m.is_terminated():
                    terminated.append(rid)
                    break
        return terminated, failed

    def stats(self) -> dict[str, float | int]:
        """Counters for EngineCore.stats (and so /metrics)."""
        return {"structured_outputs_compiles": self.cache.misses, "structured_outputs_cache_hits": self.cache.hits,
                "structured_outputs_compiling": len(self.pending),
                "structured_outputs_mask_seconds": self.mask_seconds, "structured_outputs_mask_steps": self.mask_steps}

    def close(self) -> None:
        self.cache.close()
        self._masks.shutdown(wait=False, cancel_futures=True)
