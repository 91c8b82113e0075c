"""Drafts from a second model on the ranks: a smaller model with the target's tokenizer
(method draft_model), or the target's own weights quantized at load (method self_quantized).

The engine's proposer (proposer.py) decides who drafts and how many tokens; their slots arrive in
`SchedulerOutput.draft_token_ids` as placeholders. Before the target's forward the runner asks
`ModelDrafter.draft` to fill them: the draft model runs k passes, each feeding the token before
(the request's last token, then its own drafts) at the next position, and picks a token from its
logits (the argmax for a greedy request; otherwise a draw from its distribution after the
request's temperature, top-k, top-p and min-p, whose probabilities verification needs).

The draft's K/V:
- draft_model: its own paged KV tensors, indexed by the target's block tables (one block id holds
  the same tokens in both caches), so prefix caching, preemption and freed slots need nothing of
  their own. In a step where someone drafts, the draft also runs every token the target runs
  (prompts, chunks, plain decodes), so its cache keeps up; `_computed` tracks, per request, how
  far its K/V are its own, and a request's first pass feeds what it missed (after a fully
  accepted run the last draft was never fed). A step where nobody drafts (a busy batch: the
  proposer turns drafting off from disable_by_batch_size decodes on) does not run the draft at
  all; the requests catch up when they draft again. Blocks first computed in such a step and then
  found in the prefix cache by a new request hold no draft K/V: its drafts are worse there.
- self_quantized: the target's KV cache itself (same layers, heads and layout). The draft reads
  the target's K/V of everything before, writes its own at the positions it drafts, and the
  target's verify pass overwrites all of those with its K/V before any row attends.

What the draft computes never decides an output: verification keeps only what the target agrees
with (rejection.py). K/V that reached the target's cache without the draft running (a KV tier's
load, a P/D transfer, a blended prompt) leave the draft's cache stale there: its drafts get worse,
the output stays the same.
"""

from __future__ import annotations

from typing import Any

import torch

PLACEHOLDER = -1  # a draft slot the runner's drafter fills (the engine never sees its value)


class ModelDrafter:
    def __init__(self, model: Any, kv_caches: list, decode_stack: Any | None, shares_kv: bool) -> None:
        """model: the draft (its attention layers use the runner's backend); kv_caches: its own
        (draft_model) or the runner's (self_quantized, shares_kv=True)."""
        self.model = model
        self.kv_caches = kv_caches
        self.stack = decode_stack
        self.shares_kv = shares_kv
        self._computed: dict[str, int] = {}  # own KV cache: tokens whose draft K/V are written

    def draft(self, runner: Any, so: Any, order: list[str]) -> dict[str, torch.Tensor | None]:
        """Fill the step's placeholder drafts (so.draft_token_ids and the runner's token lists) and
        keep the draft's cache up with the step. Returns each drafting request's draft
        distributions [k, V] (None for greedy requests: their drafts are argmaxes)."""
        for rid in so.finished_req_ids:
            self._computed.pop(rid, None)
        for d in so.new_reqs:  # new, or resumed after preemption: its own tokens start where the target's do
            self._computed[d.req_id] = d.num_computed_tokens
        drafts = so.draft_token_ids
        if not drafts:  # nobody drafts: the draft does not run (each request catches up when it drafts)
            return {}
        sched = so.num_scheduled_tokens
        spans: dict[str, tuple[int, int]] = {}  # rid -> (first position fed, tokens fed) in the first pass
        for rid in order:
            st = runner.requests[rid]
            if st.pooler is not None:
                continue
            q, n = st.num_computed_tokens, sched[rid] - len(drafts.get(rid, ()))
            if self.shares_kv:
                if rid in drafts:
                    spans[rid] = (q, 1)
                continue
            start = min(self._computed.get(rid, q), q)
            spans[rid] = (start, q + n - start)
            self._computed[rid] = q + n
        probs: dict[str, list[torch.Tensor]] = {rid: [] for rid in drafts}
        fed, i = spans, 0
        while fed:  # pass i feeds each request's token before draft i and picks draft i
            logits_of = self._run(runner, fed)
            nxt: dict[str, tuple[int, int]] = {}
            picks = [rid for rid in fed if rid in drafts and i < len(drafts[rid])]
            if picks:
                tokens, dists = self._pick(runner, picks, [logits_of[r] for r in picks], i)
                for rid, tok, dist in zip(picks, tokens, dists):
                    st = runner.requests[rid]
                    pos = st.num_computed_tokens + 1 + i  # the slot this draft fills
                    drafts[rid][i] = tok
                    st.token_ids[pos] = tok
                    if dist is not None:
                        probs[rid].append(dist)
                    if i + 1 < len(drafts[rid]):  # feed it to draft the next one
                        nxt[rid] = (pos, 1)
                        if not self.shares_kv:
                            self._computed[rid] = pos + 1
            fed, i = nxt, i + 1
        return {rid: torch.stack(p) if p else None for rid, p in probs.items()}

    def _run(self, runner: Any, spans: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
        """Feed each request's tokens [start, start + n) through the draft; the logits of each
        request's last row."""
        order = sorted(spans, key=lambda r: spans[r][1] != 1)  # decodes first, as the backend batches them
        starts = {r: spans[r][0] for r in order}
        meta, ids, pos, req_rows = runner._prepare(order, {r: spans[r][1] for r in order}, {}, starts)
        if self.stack is not None and self.stack.runs(ids.shape[0], meta, self.kv_caches):
            hidden = self.stack.forward(ids, pos, meta)
        else:
            hidden = self.model(ids, pos, self.kv_caches, meta, None)
        last = torch.tensor([req_rows[i + 1] - 1 for i in range(len(order))], device=hidden.device)
        logits = self.model.compute_logits(hidden[last])
        return {r: logits[i] for i, r in enumerate(order)}

    @staticmethod
    def _pick(runner: Any, rids: list[str], logits: list[torch.Tensor], i: int
              ) -> tuple[list[int], list[torch.Tensor | None]]:
        """Draft i of each request: the argmax (greedy), or a draw from the draft's distribution
        with the request's sampling transforms and its generator (seeded requests repeat)."""
        states = [runner.requests[r] for r in rids]
        # Draft i fills position num_computed + 1 + i: the output tokens before it are banned's count.
        banned = [runner._banned(st, st.num_computed_tokens + 1 + i - st.num_prompt_tokens) for st in states]
        argmax, probs = runner.distributions(rids, torch.stack(logits), banned)
        greedy = argmax.tolist()
        tokens: list[int] = []
        dists: list[torch.Tensor | None] = []
        for j, st in enumerate(states):
            if st.params.greedy:
                tokens.append(greedy[j])
                dists.append(None)
            else:
                tokens.append(int(torch.multinomial(probs[j], 1, generator=st.generator)))
                dists.append(probs[j])
        return tokens, dists

