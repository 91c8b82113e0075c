"""POST /v1/chat/completions: messages through the model's chat template, n, logprobs, streaming,
structured outputs (structured_fields.py), tool calls and reasoning output (tools.py)."""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi.responses import StreamingResponse

from kvserve.engine.wire import CompletionDelta
from kvserve.server import protocol as P
from kvserve.server.accum import Accum
from kvserve.server.reasoning_parsers import REASONING_PARSERS
from kvserve.server.serving import APIError, Receive, Serving
from kvserve.server.structured_fields import structured_outputs
from kvserve.server.tools import ChoiceOutput, ToolPlan, plan_tools, thinking_on


# Prompt tokens read for a reasoning end already there (the generation prompt); the engine reads
# as many (structured/manager.py).
REASONING_TAIL = 16


class ChatServing(Serving):
    async def create(self, req: P.ChatCompletionRequest,
                     receive: Receive | None = None) -> dict[str, Any] | StreamingResponse:
        """The answer; `receive` (the request's ASGI channel) tells when a client waiting for a
        whole answer leaves, which aborts its engine request."""
        self.check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        if req.modalities is not None and req.modalities != ["text"]:
            raise APIError(400, f'modalities {req.modalities!r} are not supported; only ["text"] (the default)',
                           param="modalities")
        plan = plan_tools(req, self.chat)
        constraint, field = structured_outputs(req)
        if plan.constraint is not None:
            if constraint is not None:
                raise APIError(400, f"tool_choice {plan.mode!r} constrains the output to the tool call; it cannot "
                               f"be combined with {field}", param=field)
            constraint, field = plan.constraint, "tools"  # the engine judges the tools' parameters schemas
        thinking = thinking_on(req.chat_template_kwargs) and self.chat.reasoning_parser is not None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        self.check_sequences(1, req.n, "messages")
        options = dict(add_generation_prompt=req.add_generation_prompt,
                       continue_final_message=req.continue_final_message,
                       chat_template_kwargs=req.chat_template_kwargs, tools=plan.tools)
        toks = await self.render_chat(req.messages, **options)
        truncated = self.truncate(req, [toks])[0]
        cut, toks = len(truncated) < len(toks), truncated
        if thinking:
            end = REASONING_PARSERS[self.chat.reasoning_parser].END
            # A prompt that ends past the reasoning (a template that closes it, an assistant turn
            # continued after it) leaves none in the output; otherwise a grammar applies after it.
            if end in self.tokenizer.decode(toks[-REASONING_TAIL:]):
                thinking = False
            elif constraint is not None:
                constraint = dataclasses.replace(constraint, reasoning_end=end)
        params = self.sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None,
                                      longest_prompt=len(toks), structured=constraint)
        params = await self.with_prediction(params, req.prediction)
        self.check_prompt(toks, params, "messages")
        text = await self.chat_text(req.messages, **options) if self.info.blend is not None and not cut else None
        per_prompt = await self.blend_params(params, [toks], [text], req.blend, "messages")
        deltas = await self.start([toks], per_prompt, req.cache_salt, stream=req.stream, priority=req.priority,
                                  constraint_field=field)
        acc, rid = Accum(req.n), P.new_id("chatcmpl")
        if req.stream:
            final, continuous = self.usage_options(req)
            return StreamingResponse(self.stream_events(deltas, acc, self._chunker(req, rid, plan, thinking),
                                                        self._usage_chunk(rid) if final else None, continuous),
                                     media_type="text/event-stream")
        await self.collect(deltas, acc, receive, field)
        choices = []
        for i, c in sorted(acc.choices.items()):
            out = ChoiceOutput(plan, self.chat, thinking)
            choices.append(P.ChatChoice(index=i, message=out.whole(c.text), finish_reason=out.finish_reason(
                c.finish_reason), stop_reason=c.stop_reason, logprobs=self._logprobs(
                c.logprobs, req.top_logprobs or 0) if req.logprobs else None))
        return P.ChatCompletionResponse(id=rid, model=self.model_name, choices=choices, usage=acc.usage(),
                                        kv_transfer_params=acc.kv_transfer_params).model_dump()

    def _usage_chunk(self, rid: str):
        def usage_chunk(u: P.Usage) -> P.ChatCompletionChunk:
            return P.ChatCompletionChunk(id=rid, model=self.model_name, choices=[], usage=u)

        return usage_chunk

    def _chunker(self, req: P.ChatCompletionRequest, rid: str, plan: ToolPlan, thinking: bool):
        """chunk_for of stream_events: each choice's deltas through its ChoiceOutput. Text held back
        (a tool call not whole yet) keeps its tokens' logprobs for the chunk that sends it."""
        outputs: dict[int, ChoiceOutput] = {}
        held_logprobs: dict[int, list[dict]] = {}
        k = req.top_logprobs or 0

        def chunk_for(idx: int, c: CompletionDelta) -> list[P.ChatCompletionChunk]:
            first = idx not in outputs
            out = outputs.setdefault(idx, ChoiceOutput(plan, self.chat, thinking))
            parts = out.feed(c.text, final=c.finish_reason is not None)
            lps = held_logprobs.setdefault(idx, [])
            lps += c.logprobs or []
            deltas = []
            if parts.reasoning or parts.content or (first and not parts.calls) or (out.plain and c.token_ids):
                deltas.append(P.ChatDelta(reasoning_content=parts.reasoning or None,
                                          content=parts.content if parts.content or not parts.reasoning else None))
            deltas += [P.ChatDelta(tool_calls=[call]) for call in parts.calls]
            if not deltas and not c.finish_reason:
                return []
            if first or not deltas:
                deltas = deltas or [P.ChatDelta()]
                deltas[0].role = "assistant" if first else None
            chunks = [P.ChatCompletionChunk(id=rid, model=self.model_name, choices=[P.ChatStreamChoice(
                index=idx, delta=d)]) for d in deltas]
            if req.logprobs and lps:
                chunks[0].choices[0].logprobs = self._logprobs(lps, k)
                held_logprobs[idx] = []
            chunks[-1].choices[0].finish_reason = out.finish_reason(c.finish_reason)
            return chunks

        return chunk_for

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
