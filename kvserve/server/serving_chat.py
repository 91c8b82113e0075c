"""POST /v1/chat/completions: messages through the model's chat template, n, logprobs, streaming."""

from __future__ import annotations

from typing import Any

from fastapi.responses import StreamingResponse

from kvserve.engine.wire import CompletionDelta
from kvserve.server import protocol as P
from kvserve.server.accum import Accum
from kvserve.server.serving import APIError, Receive, Serving


class ChatServing(Serving):
    async def create(self, req: P.ChatCompletionRequest,
                     receive: Receive | None = None) -> dict[str, Any] | StreamingResponse:
        """The answer; `receive` (the request's ASGI channel) tells when a client waiting for a
        whole answer leaves, which aborts its engine request."""
        self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        if req.response_format is not None and req.response_format.type != "text":
            raise APIError(400, f"response_format type {req.response_format.type!r} is not supported yet; only "
                           '"text" (the default)', param="response_format")
        if req.modalities is not None and req.modalities != ["text"]:
            raise APIError(400, f'modalities {req.modalities!r} are not supported; only ["text"] (the default)',
                           param="modalities")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        self.check_sequences(1, req.n, "messages")
        options = dict(add_generation_prompt=req.add_generation_prompt,
                       continue_final_message=req.continue_final_message,
                       chat_template_kwargs=req.chat_template_kwargs)
        toks = await self.render_chat(req.messages, **options)
        truncated = self.truncate(req, [toks])[0]
        cut, toks = len(truncated) < len(toks), truncated
        params = self.sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None,
                                      longest_prompt=len(toks))
        self.check_prompt(toks, params, "messages")
        text = await self.chat_text(req.messages, **options) if self.info.blend is not None and not cut else None
        per_prompt = await self.blend_params(params, [toks], [text], req.blend, "messages")
        deltas = await self.start([toks], per_prompt, req.cache_salt, stream=req.stream, priority=req.priority)
        acc, rid, k = Accum(req.n), P.new_id("chatcmpl"), req.top_logprobs or 0
        if req.stream:
            started: set[int] = set()

            def chunk_for(idx: int, c: CompletionDelta) -> P.ChatCompletionChunk | None:
                if not (c.text or c.finish_reason or c.token_ids):
                    return None
                delta = P.ChatDelta(content=c.text)
                if idx not in started:
                    started.add(idx)
                    delta.role = "assistant"
                lps = self._logprobs(c.logprobs, k) if req.logprobs and c.logprobs else None
                return P.ChatCompletionChunk(id=rid, model=self.model_name, choices=[P.ChatStreamChoice(
                    index=idx, delta=delta, logprobs=lps, finish_reason=c.finish_reason)])

            def usage_chunk(u: P.Usage) -> P.ChatCompletionChunk:
                return P.ChatCompletionChunk(id=rid, model=self.model_name, choices=[], usage=u)

            final, continuous = self.usage_options(req)
            return StreamingResponse(self.stream_events(deltas, acc, chunk_for, usage_chunk if final else None,
                                                        continuous),
                                     media_type="text/event-stream")
        await self.collect(deltas, acc, receive)
        choices = [P.ChatChoice(index=i, message=P.ChatResponseMessage(content=c.text), finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason,
                                logprobs=self._logprobs(c.logprobs, k) if req.logprobs else None)
                   for i, c in sorted(acc.choices.items())]
        return P.ChatCompletionResponse(id=rid, model=self.model_name, choices=choices, usage=acc.usage(),
                                        kv_transfer_params=acc.kv_transfer_params).model_dump()

    def _logprobs(self, positions: list[dict], k: int) -> P.ChatLogprobs:
        content = []
        for pos in positions:
            tid, lp = next(iter(pos.items()))
            text = self.token_text(tid, lp)
            tops = [P.TopLogprob(token=self.token_text(t, v), logprob=v.logprob,
                                 bytes=list(self.token_text(t, v).encode())) for t, v in self.top_entries(pos, k)]
            content.append(P.ChatTokenLogprob(token=text, logprob=lp.logprob, bytes=list(text.encode()),
                                              top_logprobs=tops))
        return P.ChatLogprobs(content=content)
