"""The engine process's side of the deltas (wire.py): what was already sent for each request, so each
`outputs` message carries only what changed since the last one."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvserve.engine.wire import CompletionDeltaWire, RequestDeltaWire, logprobs_to_wire
from kvserve.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams


@dataclass
class _Sent:
    text: int = 0  # characters
    tokens: int = 0
    logprobs: int = 0
    finished: bool = False


@dataclass
class _Tracked:
    n: int
    hold: int  # characters held back: they could still become part of a stop string
    completions: dict[int, _Sent]
    prompt_logprobs_sent: bool = False


class DeltaTracker:
    """Remembers what was already sent for each request.

    Text that could be the start of a stop string is held back until decided:
    a stop string that matches later truncates the text, and text already sent
    cannot be taken back. Since a match can only start within the last
    len(stop) - 1 characters of the text before the token that completes it,
    holding back max(len(stop)) - 1 characters is enough.
    """

    def __init__(self) -> None:
        self.requests: dict[str, _Tracked] = {}

    def add(self, request_id: str, params: SamplingParams) -> None:
        hold = params.stop_holdback
        self.requests[request_id] = _Tracked(params.n, hold, {i: _Sent() for i in range(params.n)})

    def delta(self, out: RequestOutput) -> RequestDeltaWire | None:
        tr = self.requests.get(out.request_id)
        if tr is None:
            return None
        comps = [c for c in (self._completion(tr, co) for co in out.outputs) if c is not None]
        plp = None
        if out.prompt_logprobs is not None and not tr.prompt_logprobs_sent and (
                out.finished or any(co.token_ids for co in out.outputs)):
            plp = [None if p is None else logprobs_to_wire(p) for p in out.prompt_logprobs]
            tr.prompt_logprobs_sent = True
        if out.finished:
            del self.requests[out.request_id]
        elif not comps and plp is None:
            return None
        m = out.metrics
        return RequestDeltaWire(request_id=out.request_id, completions=comps, finished=out.finished,
                                num_prompt_tokens=len(out.prompt_token_ids),
                                num_cached_tokens=out.num_cached_tokens,
                                cached_tokens_by_tier=out.num_cached_tokens_by_tier, prompt_logprobs=plp,
                                metrics=dataclasses.asdict(m) if m is not None else None,
                                kv_transfer_params=out.kv_transfer_params, embedding=out.embedding,
                                draft_tokens=None if out.num_draft_tokens is None else
                                [out.num_draft_tokens, out.num_accepted_draft_tokens])

    def _completion(self, tr: _Tracked, co) -> CompletionDeltaWire | None:
        sent = tr.completions[co.index]
        if sent.finished:
            return None
        finished = co.finish_reason is not None
        ready = len(co.text) if finished else len(co.text) - tr.hold
        text = co.text[sent.text:ready] if ready > sent.text else ""
        tokens = co.token_ids[sent.tokens:]
        lps = None
        if co.logprobs is not None:
            lps = [logprobs_to_wire(p) for p in co.logprobs[sent.logprobs:]]
            sent.logprobs = len(co.logprobs)
        if not (text or tokens or finished):
            return None
        sent.text, sent.tokens, sent.finished = max(sent.text, ready), len(co.token_ids), finished
        return CompletionDeltaWire(index=co.index, text=text, token_ids=list(tokens), logprobs=lps,
                                   cumulative_logprob=co.cumulative_logprob,
                                   finish_reason=co.finish_reason, stop_reason=co.stop_reason)

    def abort(self, request_id: str) -> RequestDeltaWire | None:
        """The final delta of an aborted request: its unfinished completions end with 'abort'."""
        tr = self.requests.pop(request_id, None)
        if tr is None:
            return None
        comps = [CompletionDeltaWire(index=i, text="", token_ids=[], logprobs=None, cumulative_logprob=None,
                                     finish_reason="abort", stop_reason=None)
                 for i, s in tr.completions.items() if not s.finished]
        return RequestDeltaWire(request_id=request_id, completions=comps, finished=True, num_prompt_tokens=0,
                                num_cached_tokens=0, cached_tokens_by_tier={}, prompt_logprobs=None,
                                metrics=None, kv_transfer_params=None, embedding=None, draft_tokens=None)
