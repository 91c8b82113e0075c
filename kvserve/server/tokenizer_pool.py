"""Tokenizer work off the event loop: prompts, chat templates, /tokenize and /detokenize run on
one thread of their own, so /health, /metrics and open streams keep answering while a long prompt
is tokenized (a fast tokenizer releases the GIL while it encodes).

One thread: this process leaves the cores to the engine, and a fast tokenizer is not safe to share
between threads. The queue is bounded: with `max_queued` jobs waiting or running, one more is
refused at once (TokenizerBusy: the server answers 503 with Retry-After) rather than waiting behind
a backlog that holds every queued body in memory; clients retry after it (the openai client does,
honouring Retry-After), as after --max-waiting's 503.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class TokenizerBusy(RuntimeError):
    """The tokenizer's queue is full; retry later."""


class TokenizerPool:
    def __init__(self, max_queued: int) -> None:
        self.max_queued = max_queued
        self.queued = 0  # jobs waiting or running; touched on the event loop only
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-tokenizer")

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """fn(*args) on the tokenizer's thread; TokenizerBusy if `max_queued` jobs are ahead."""
        if self.queued >= self.max_queued:
            raise TokenizerBusy(f"the tokenizer is busy: {self.queued} requests are queued for it; retry later")
        self.queued += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))
        finally:
            self.queued -= 1
