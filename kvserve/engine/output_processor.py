"""Turns sampled tokens into RequestOutputs: detokenization, stop strings, logprobs,
and the grouping of n > 1 samples under their parent request."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics, RequestOutput
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.worker.model_runner import ModelRunnerOutput, TokenLogprobs


@dataclass
class _Child:
    index: int
    detok: IncrementalDetokenizer | None
    completion: CompletionOutput


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    children: dict[str, _Child]
    metrics: RequestMetrics
    prompt_logprobs: list[PositionLogprobs | None] | None
    num_cached_tokens: int = 0
    num_cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    finished_children: set[str] = field(default_factory=set)
    embedding: list[float] | None = None  # an embedding request's pooled vector
    drafted: int = 0  # speculative decoding: tokens drafted for its sequences, and those kept
    accepted: int = 0


class OutputProcessor:
    def __init__(self, tokenizer, speculative: bool = False) -> None:
        self.tokenizer = tokenizer
        self.speculative = speculative  # outputs count drafted and accepted tokens
        self.parents: dict[str, _Parent] = {}
        self.child_to_parent: dict[str, str] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            params: SamplingParams, children: list[Request]) -> None:
        plp = [None] if params.prompt_logprobs is not None else None
        parent = _Parent(request_id, prompt, prompt_token_ids, params, {},
                         RequestMetrics(arrival_time=children[0].arrival_time), plp)
        for i, child in enumerate(children):
            detok = None
            if params.detokenize and self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.skip_special_tokens,
                                               params.stop_strings, params.include_stop_str_in_output)
            cum = 0.0 if params.logprobs is not None else None
            lps = [] if params.logprobs is not None else None
            parent.children[child.request_id] = _Child(i, detok, CompletionOutput(i, "", [], cum, lps))
            self.child_to_parent[child.request_id] = request_id
        self.parents[request_id] = parent

    def child_ids(self, request_id: str) -> list[str]:
        parent = self.parents.get(request_id)
        return list(parent.children) if parent else []

    def process(self, updated: list[Request], ro: ModelRunnerOutput, drafts: dict[str, tuple[int, int]] | None = None
                ) -> tuple[list[RequestOutput], list[str]]:
        """Returns the outputs of parents that changed, and the child ids that hit a stop
        string (the engine finishes those in the scheduler). drafts: child id -> (tokens drafted,
        tokens kept) this step (speculative decoding)."""
        touched: dict[str, _Parent] = {}
        stopped: list[str] = []
        for rid, (first, entries) in ro.prompt_logprobs.items():
            parent = self.parents.get(self.child_to_parent.get(rid, ""))
            if parent is not None and parent.prompt_logprobs is not None:
                self._add_prompt_logprobs(parent, first, entries)
        now = time.time()
        for req in updated:
            parent = self.parents[self.child_to_parent[req.request_id]]
            touched[parent.request_id] = parent
            child = parent.children[req.request_id]
            if drafts and req.request_id in drafts:
                parent.drafted += drafts[req.request_id][0]
                parent.accepted += drafts[req.request_id][1]
            if req.request_id in ro.pooled:  # an embedding request: no token, its vector
                parent.embedding = ro.pooled[req.request_id]
                child.completion.finish_reason = req.status.finish_reason
            elif self._append(child, req, ro.logprobs.get(req.request_id)):
                stopped.append(req.request_id)
            elif req.is_finished:
                child.completion.finish_reason = req.status.finish_reason
                child.completion.stop_reason = req.stop_reason
            if child.completion.finish_reason is not None:
                parent.finished_children.add(req.request_id)
            m = parent.metrics
            m.first_scheduled_time = m.first_scheduled_time or req.first_scheduled_time
            m.first_token_time = m.first_token_time or req.first_token_time
            m.last_token_time = now
            if child.index == 0:
                parent.num_cached_tokens = max(req.num_cached_tokens, 0)
                parent.num_cached_tokens_by_tier = req.num_cached_tokens_by_tier
        return [self._output(p) for p in touched.values()], stopped

    def abort(self, request_id: str) -> None:
        parent = self.parents.pop(request_id, None)
        for cid in parent.children if parent else ():
            self.child_to_parent.pop(cid, None)

    def _append(self, child: _Child, req: Request, lps: list[TokenLogprobs] | None) -> bool:
        """Append the request's new tokens (those its completion does not hold yet: one, or more
        with speculative decoding) to its completion; True if a stop string hit."""
        c = child.completion
        if c.finish_reason is not None:
            return False
        new = req.output_token_ids[len(c.token_ids):]
        for i, tok in enumerate(new):
            c.token_ids.append(tok)
            if lps is not None and i < len(lps) and c.logprobs is not None:
                c.logprobs.append(self._position_logprobs(lps[i]))
                c.cumulative_logprob = (c.cumulative_logprob or 0.0) + lps[i][1][0]
            if child.detok is None:
                continue
            # The EOS / stop token itself is not part of the text.
            if i == len(new) - 1 and req.is_finished and req.status.finish_reason == "stop":
                return False
            _, matched = child.detok.add_token(tok)
            c.text = child.detok.text
            if matched is not None:
                c.finish_reason, c.stop_reason = "stop", matched
                return True
        return False

    def _position_logprobs(self, lp: TokenLogprobs) -> PositionLogprobs:
        ids, vals, rank = lp
        out: PositionLogprobs = {ids[0]: Logprob(vals[0], rank, self._token_text(ids[0]))}
        for r, (tid, val) in enumerate(zip(ids[1:], vals[1:]), start=1):
            if tid not in out:
                out[tid] = Logprob(val, r, self._token_text(tid))
        return out

    def _token_text(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id])

    def _add_prompt_logprobs(self, parent: _Parent, first: int, entries: list[TokenLogprobs]) -> None:
        plp = parent.prompt_logprobs
        for j, entry in enumerate(entries):
            pos = first + j
            if pos == len(plp):  # positions recomputed after a preemption are skipped
                plp.append(self._position_logprobs(entry))

    def _output(self, parent: _Parent) -> RequestOutput:
        finished = len(parent.finished_children) == len(parent.children)
        if finished:
            parent.metrics.finished_time = time.time()
            self.parents.pop(parent.request_id, None)
            for cid in parent.children:
                self.child_to_parent.pop(cid, None)
        outs = sorted((c.completion for c in parent.children.values()), key=lambda c: c.index)
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids,
                             parent.prompt_logprobs, outs, finished, parent.num_cached_tokens,
                             parent.metrics, parent.num_cached_tokens_by_tier, embedding=parent.embedding,
                             num_draft_tokens=parent.drafted if self.speculative else None,
                             num_accepted_draft_tokens=parent.accepted if self.speculative else None)
