"""POST /v1/completions: prompts as text or token ids, n, logprobs, echo, streaming, and
structured_outputs / vLLM's guided_* fields (structured_fields.py).

echo puts each prompt's text before its completion (and, with logprobs, the
prompt tokens' logprobs before the completion's, the first one null, as OpenAI
does). `max_tokens: 0` with echo scores the prompt without generating: the
engine runs one token, which is dropped from the text and the usage.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from kvserve.engine.wire import CompletionDelta
from kvserve.server import protocol as P
from kvserve.server.accum import Accum
from kvserve.server.serving import APIError, Deltas, Receive, Serving
from kvserve.server.structured_fields import structured_outputs


class CompletionServing(Serving):
    async def create(self, req: P.CompletionRequest,
                     receive: Receive | None = None) -> dict[str, Any] | StreamingResponse:
        """The answer; `receive` (the request's ASGI channel) tells when a client waiting for a
        whole answer leaves, which aborts its engine requests."""
        self.check_model(req.model)
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, f"best_of={req.best_of} other than n={req.n} is not supported (nor in vLLM's V1 "
                           "engine): send n candidates and pick among them", param="best_of")
        score_only = req.echo and req.max_tokens == 0
        max_tokens = 1 if score_only else req.max_tokens
        prompt_lps = req.logprobs if req.echo and req.logprobs is not None else None
        items = self.completion_prompts(req.prompt)
        if req.kv_transfer_params is not None and len(items) > 1:
            raise APIError(400, "kv_transfer_params takes a single prompt", param="kv_transfer_params")
        self.check_sequences(len(items), req.n, "prompt")
        prompts, texts = await self.encode(items)
        truncated = self.truncate(req, prompts)
        texts = [t if len(a) == len(b) else None for t, a, b in zip(texts, prompts, truncated)]
        prompts = truncated
        constraint, field = structured_outputs(req)
        params = self.sampling_params(req, max_tokens, req.logprobs, prompt_lps, max(map(len, prompts)),
                                      structured=constraint)
        for p in prompts:
            self.check_prompt(p, params, "prompt")
        per_prompt = await self.blend_params(params, prompts, texts, req.blend, "prompt")
        deltas = await self.start(prompts, per_prompt, req.cache_salt, stream=req.stream, priority=req.priority,
                                  constraint_field=field)
        if score_only:
            deltas = _drop_generated(deltas)
        acc, rid = Accum(req.n), P.new_id("cmpl")
        echo = _Echo(self, req, prompts, texts, acc)
        if req.stream:
            def usage_chunk(u: P.Usage) -> P.CompletionResponse:
                return P.CompletionResponse(id=rid, model=self.model_name, choices=[], usage=u)

            final, continuous = self.usage_options(req)
            chunk_for = self._chunker(req, rid, echo)
            return StreamingResponse(self.stream_events(deltas, acc, chunk_for, usage_chunk if final else None,
                                                        continuous),
                                     media_type="text/event-stream")
        await self.collect(deltas, acc, receive, field)
        choices = []
        for idx, c in sorted(acc.choices.items()):
            lps = echo.logprobs(idx, c.logprobs, 0, with_prompt=True) if req.logprobs is not None else None
            choices.append(P.CompletionChoice(index=idx, text=echo.prefix(idx) + c.text, logprobs=lps,
                                              finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        return P.CompletionResponse(id=rid, model=self.model_name, choices=choices, usage=acc.usage(),
                                    kv_transfer_params=acc.kv_transfer_params).model_dump()

    def _chunker(self, req: P.CompletionRequest, rid: str, echo: _Echo):
        offsets: dict[int, int] = {}

        def chunk_for(idx: int, c: CompletionDelta) -> P.CompletionResponse | None:
            first = idx not in offsets
            if not (c.text or c.finish_reason or c.token_ids or (first and req.echo)):
                return None
            text = (echo.prefix(idx) if first else "") + c.text
            lps = None
            if req.logprobs is not None and (c.logprobs or (first and req.echo)):
                lps = echo.logprobs(idx, c.logprobs or [], offsets.get(idx, 0), with_prompt=first)
            offsets[idx] = offsets.get(idx, 0) + len(text)
            return P.CompletionResponse(id=rid, model=self.model_name, choices=[P.CompletionChoice(
                index=idx, text=text, logprobs=lps, finish_reason=c.finish_reason, stop_reason=c.stop_reason)])

        return chunk_for


class _Echo:
    """Prompt text and prompt logprobs put before a choice when echo is on."""

    def __init__(self, serving: Serving, req: P.CompletionRequest, prompts: list[list[int]],
                 texts: list[str | None], acc: Accum) -> None:
        self.s, self.req, self.prompts, self.texts, self.acc = serving, req, prompts, texts, acc

    def prefix(self, idx: int) -> str:
        if not self.req.echo:
            return ""
        i = idx // self.req.n
        if self.texts[i] is None:  # token ids: decode once
            self.texts[i] = self.s.tokenizer.decode(self.prompts[i])
        return self.texts[i]

    def logprobs(self, idx: int, generated: list[dict], offset: int, with_prompt: bool) -> P.CompletionLogprobs:
        k, res = self.req.logprobs or 0, P.CompletionLogprobs()
        if self.req.echo and with_prompt:
            i = idx // self.req.n
            plps = self.acc.prompt_logprobs.get(i) or [None] * len(self.prompts[i])
            for tid, pos in zip(self.prompts[i], plps):
                text = self.s.tokenizer.decode([tid])
                res.tokens.append(text)
                res.token_logprobs.append(pos[tid].logprob if pos and tid in pos else None)
                res.top_logprobs.append({self.s.token_text(t, v): v.logprob
                                         for t, v in self.s.top_entries(pos, k)} if pos else None)
                res.text_offset.append(offset)
                offset += len(text)
        for pos in generated:
            tid, lp = next(iter(pos.items()))
            text = self.s.token_text(tid, lp)
            res.tokens.append(text)
            res.token_logprobs.append(lp.logprob)
            res.top_logprobs.append({self.s.token_text(t, v): v.logprob for t, v in self.s.top_entries(pos, k)})
            res.text_offset.append(offset)
            offset += len(text)
        return res


async def _drop_generated(deltas: Deltas) -> AsyncIterator[Any]:
    """echo with max_tokens=0: keep usage and prompt logprobs, drop the one generated token."""
    try:
        async for i, d in deltas:
            for c in d.outputs:
                c.text, c.token_ids, c.logprobs = "", [], None
            yield i, d
    finally:
        await deltas.aclose()
