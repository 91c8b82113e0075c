"""The engine's side of speculative decoding: which requests draft this step, their drafts, and
what verification kept (the counters behind the spec_decode metrics).

The scheduler asks `propose(request, num_decodes)` for each running request about to decode; the
drafts go into the step as `SchedulerOutput.draft_token_ids` and the request is scheduled for
1 + k query tokens. N-gram drafts are looked up here; a draft model's are placeholders that the
ranks' drafter fills before the target's forward (draft_model.py). The runner verifies them (rejection.py) and returns the tokens it emits; the
scheduler rolls `num_computed_tokens` back over the rejected drafts. Drafts never enter the
request's token list, so the prefix cache and the KV manager only ever register blocks of
accepted tokens.

A request may carry the output it expects (extra_args["prediction"], OpenAI's predicted outputs):
n-gram lookup searches it too.

A request constrained by a grammar drafts by n-gram lookup: the engine cuts its drafts where the
grammar would refuse them (StructuredOutputManager.fit_drafts) and the step carries a mask row per
draft prefix (verification samples under them). With a draft model it does not draft: the draft
model would sample without the grammar. A request does not draft either when it is an embedding
request, or within one token of its limit.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Sequence
from typing import Any

from kvserve.config import SpeculativeConfig
from kvserve.pooling_params import pooling_params
from kvserve.request import Request
from kvserve.sampling_params import PREDICTION
from kvserve.spec_decode.adaptive import AdaptiveK
from kvserve.spec_decode.draft_model import PLACEHOLDER
from kvserve.spec_decode.ngram import propose_ngram


PRICE_WINDOW = 15  # steps whose median gives the price of a query token (observe_step)


def check_prediction(value: Any, vocab_size: int) -> None:
    """ValueError naming extra_args.prediction unless it is a list of token ids in the vocabulary."""
    if value is None:
        return
    if not isinstance(value, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise ValueError(f"extra_args.{PREDICTION} must be a list of token ids")
    bad = next((t for t in value if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"extra_args.{PREDICTION} contains {bad}, outside the vocabulary [0, {vocab_size})")


def lookup_tokens(req: Request) -> Sequence[int]:
    """What n-gram lookup searches: the request's tokens, with its prediction between prompt and
    output, so a rewrite that keeps most of a given text drafts from it (verification keeps the
    output the model's own)."""
    pred = (req.sampling_params.extra_args or {}).get(PREDICTION)
    if not pred:
        return req.all_token_ids
    return [*req.prompt_token_ids, *pred, *req.all_token_ids[req.num_prompt_tokens:]]


class SpecDecodeProposer:
    def __init__(self, cfg: SpeculativeConfig, max_model_len: int) -> None:
        self.cfg = cfg
        self.max_model_len = max_model_len
        self.k_max = cfg.num_speculative_tokens
        self.adaptive = AdaptiveK(self.k_max, max_batch=cfg.disable_by_batch_size) if cfg.adaptive else None
        # vLLM's counters: verify steps with drafts, drafted tokens, accepted ones, accepted per position.
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k_max
        # the latest single-stream plain steps' seconds and verify steps' prices (observe_step)
        self._one_row_s: deque[float] = deque(maxlen=PRICE_WINDOW)
        self._prices: deque[float] = deque(maxlen=PRICE_WINDOW)

    def observe_step(self, num_rows: int, drafted: bool, seconds: float) -> None:
        """A single stream's decode step of num_rows rows (1, or a last token and its drafts) took
        `seconds`: the adaptive rule's price of one more query token (cost_per_token, as a share
        of a plain step) is measured from these: a verify step's price against the median of the
        latest plain steps, and the price the rule uses the median of the latest PRICE_WINDOW.
        Medians, because one step that lost its core to another process would otherwise set the
        price for many: a moving average taken that way once read 0.64 against a true ~0.25 and
        stopped drafting, and with no drafts no new price came to correct it. The price is the
        model's and the machine's: ~0.05 where decode is memory-bound, 0.2-0.6 on a small model
        whose kernels are compute-bound (BENCHMARKS.md)."""
        if num_rows == 1 and not drafted:
            self._one_row_s.append(seconds)
        elif drafted and num_rows > 1 and self._one_row_s and self.adaptive is not None:
            self._prices.append(max(0.0, (seconds / statistics.median(self._one_row_s) - 1.0) / (num_rows - 1)))
            self.adaptive.cost_per_token = statistics.median(self._prices)

    def propose(self, req: Request, num_decodes: int) -> list[int]:
        """Up to k drafted tokens for `req`'s next step ([]: decode one token as usual)."""
        p = req.sampling_params
        if (p.structured_outputs is not None and self.cfg.uses_draft_model) or pooling_params(p) is not None:
            return []
        # Room left: the last token's step emits at most k + 1, all within the request's limits.
        room = min(req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1
        if room <= 0:
            return []
        if self.adaptive is not None:
            k = self.adaptive.num_drafts(req.request_id, num_decodes)
        else:
            k = 0 if num_decodes >= self.cfg.disable_by_batch_size else self.k_max
        k = min(k, room)
        if k <= 0:
            return []
        if self.cfg.uses_draft_model:  # the ranks' draft model fills them (draft_model.py)
            return [PLACEHOLDER] * k
        return propose_ngram(lookup_tokens(req), k, self.cfg.prompt_lookup_min, self.cfg.prompt_lookup_max)

    def observe(self, request_id: str, drafted: int, accepted: int) -> None:
        """A verify step kept `accepted` of a request's `drafted` tokens."""
        if drafted <= 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_pos[i] += 1
        if self.adaptive is not None:
            self.adaptive.observe(request_id, drafted, accepted)

    def forget(self, request_id: str) -> None:
        if self.adaptive is not None:
            self.adaptive.forget(request_id)

    def stats(self) -> dict[str, int]:
        out = {"spec_decode_num_drafts": self.num_drafts, "spec_decode_num_draft_tokens": self.num_draft_tokens,
               "spec_decode_num_accepted_tokens": self.num_accepted_tokens}
        for i, n in enumerate(self.accepted_per_pos):
            out[f"spec_decode_num_accepted_tokens_pos_{i}"] = n
        return out
