"""POST /tokenize and POST /detokenize, as vLLM serves them (same paths, bodies and answers).

/tokenize takes a prompt ({"prompt": text}) or a chat ({"messages": [...]}) and answers
{"count", "max_model_len", "tokens", "token_strs"}: the very ids /v1/completions and
/v1/chat/completions compute (kvserve/server/prompts.py), so a client can count or cache-key
a prompt before sending it. A chat also takes vLLM's add_generation_prompt (default true),
continue_final_message (default false; not both true), add_special_tokens (default false) and
chat_template_kwargs, which change the ids as transformers' apply_chat_template does; a
chat_template of the request's own is refused. /detokenize turns {"tokens": [...]} back into
{"prompt": text}.
Both need the API key when one is set, like the /v1 routes. A prompt goes through the same text
check as the completion endpoints (prompts.check_prompt_text) whatever add_special_tokens says, and
both routes tokenize on the tokenizer's thread (serving.TokenizerPool), never on the event loop.
"""

from __future__ import annotations

from typing import Any

from fastapi import Body, FastAPI
from fastapi.responses import Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from kvserve.server import protocol as P
from kvserve.server.serving import APIError, Serving


class TokenizeServing(Serving):
    async def tokenize(self, body: dict[str, Any]) -> Response:
        req = _parse(P.TokenizeChatRequest if "messages" in body else P.TokenizeCompletionRequest, body)
        self.check_model(req.model)
        if isinstance(req, P.TokenizeChatRequest):
            toks = await self._chat_ids(req)
        else:  # add_special_tokens true: what /v1/completions does with a text prompt
            toks = (await self.encode(self.completion_prompts(req.prompt), req.add_special_tokens))[0][0]
        # Millions of ids are seconds of JSON: written on the tokenizer's thread too.
        return Response(await self.pool.run(self._answer, toks, bool(req.return_token_strs)),
                        media_type="application/json")

    async def detokenize(self, req: P.DetokenizeRequest) -> dict[str, Any]:
        self.check_model(req.model)
        vocab = self.info.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})", param="tokens")
        return P.DetokenizeResponse(prompt=await self.pool.run(self.tokenizer.decode, req.tokens)).model_dump()

    def _answer(self, toks: list[int], with_strs: bool) -> bytes:
        strs = list(self.tokenizer.convert_ids_to_tokens(toks)) if with_strs else None
        return P.TokenizeResponse(count=len(toks), max_model_len=self.info.max_model_len, tokens=toks,
                                  token_strs=strs).model_dump_json().encode()

    async def _chat_ids(self, req: P.TokenizeChatRequest) -> list[int]:
        if req.chat_template is not None:
            # A template is code run by the server; vLLM too refuses one from a request unless
            # started with --trust-request-chat-template.
            raise APIError(400, "chat_template is not supported: /tokenize renders the model's own chat "
                           "template (chat_template_kwargs can pass it variables)", param="chat_template")
        return await self.render_chat(req.messages, add_generation_prompt=req.add_generation_prompt,
                             continue_final_message=req.continue_final_message,
                             add_special_tokens=req.add_special_tokens, chat_template_kwargs=req.chat_template_kwargs,
                             tools=[t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None)


def _parse(model: type[BaseModel], body: dict[str, Any]) -> Any:
    """The body as `model`; a bad one answers 400 naming the field, like FastAPI's own checks."""
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise RequestValidationError(e.errors(include_url=False)) from None


def add_tokenize_routes(app: FastAPI, serving: TokenizeServing,
                        errors: dict[int | str, dict[str, Any]] | None = None) -> None:
    """POST /tokenize and /detokenize (behind the app's API key check); `errors` documents the
    error answers (openai_api.ERRORS)."""

    def documented(model: type) -> dict[int | str, dict[str, Any]]:
        return {**(errors or {}), 200: {"model": model}}

    @app.post("/tokenize", responses=documented(P.TokenizeResponse))
    async def tokenize(body: dict[str, Any] = Body(...)) -> Response:
        # Chat or prompt is decided by the "messages" key, so a bad body's 400 names the fields
        # of the one the client meant, not those of both.
        return await serving.tokenize(body)

    @app.post("/detokenize", responses=documented(P.DetokenizeResponse))
    async def detokenize(req: P.DetokenizeRequest) -> dict[str, Any]:
        return await serving.detokenize(req)
