"""N-gram prompt lookup: drafts from the request's own tokens, no second model.

The last n tokens of the sequence (prompt and output alike), for n from `max_n` down to `min_n`,
are looked up earlier in the sequence; the tokens that followed their latest earlier occurrence
are the draft (up to k). RAG answers, summaries and code edits copy long spans of their prompt,
so the continuation of a matching n-gram is often what the model writes next.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def propose_ngram(tokens: Sequence[int] | np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k draft tokens for the sequence `tokens`; [] when no n-gram of the suffix recurs."""
    arr = np.asarray(tokens, dtype=np.int64)
    length = len(arr)
    if k < 1 or length < min_n + 1:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = arr[length - n:]
        # Windows that start before the suffix itself and have a token after them.
        windows = np.lib.stride_tricks.sliding_window_view(arr[:length - 1], n)
        hits = np.flatnonzero((windows == pattern).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n  # the latest occurrence: nearest context, likeliest to repeat
            return arr[start:start + k].tolist()
    return []
