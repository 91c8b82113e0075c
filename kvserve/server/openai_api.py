"""OpenAI-compatible HTTP server: FastAPI over AsyncEngine (engine core in its own process).

    python -m kvserve.server.openai_api --model DIR_OR_GGUF --port 8000 [--api-key KEY]

Requests are validated here (schema, SamplingParams, prompt length against the
context and the KV cache) so a bad request never reaches the engine. Streaming
responses wrap the engine iterator in `aclosing`: a client that disconnects
cancels the response task, which closes the iterator, which aborts the request.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

import kvserve
from kvserve.engine.async_engine import AsyncEngine, EngineDeadError
from kvserve.engine.engine_proc import CompletionDelta, RequestDelta
from kvserve.models.loader import load_tokenizer
from kvserve.sampling_params import SamplingParams
from kvserve.server import protocol as P

logger = logging.getLogger(__name__)


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


def _error(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    body = P.ErrorResponse(error=P.ErrorInfo(message=message, type=type_, param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status)


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        name = ".".join(loc) or None
        param = param or name
        if err.get("type") == "extra_forbidden":
            parts.append(f"unknown field {name!r}: not supported by this server")
        elif err.get("type") == "json_invalid":
            parts.append(f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}")
        else:
            parts.append(f"{name or 'body'}: {err.get('msg')}")
    return "; ".join(parts) or "invalid request", param


# ---- request -> engine inputs ------------------------------------------------

_SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty",
                    "frequency_penalty", "repetition_penalty")


def _sampling_params(req: P.CompletionRequest | P.ChatCompletionRequest, max_tokens: int | None,
                     logprobs: int | None) -> SamplingParams:
    kwargs = {k: getattr(req, k) for k in _SAMPLING_FIELDS if getattr(req, k) is not None}
    try:
        return SamplingParams(**kwargs, max_tokens=max_tokens, logprobs=logprobs)
    except ValueError as e:
        name = str(e).split(" ", 1)[0]
        raise APIError(400, str(e), param=name if name in P.CompletionRequest.model_fields or
                       name in P.ChatCompletionRequest.model_fields else None) from None


@dataclass
class _Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _Accum:
    """What one HTTP request has produced so far, over its prompts and samples."""

    n: int
    choices: dict[int, _Choice] = field(default_factory=dict)
    prompt_tokens: dict[int, int] = field(default_factory=dict)
    cached_tokens: dict[int, int] = field(default_factory=dict)

    def add(self, prompt_idx: int, d: RequestDelta) -> list[tuple[int, CompletionDelta]]:
        if d.num_prompt_tokens:  # the abort delta carries zeros
            self.prompt_tokens[prompt_idx] = d.num_prompt_tokens
            self.cached_tokens[prompt_idx] = d.num_cached_tokens
        out = []
        for c in d.outputs:
            idx = prompt_idx * self.n + c.index
            ch = self.choices.setdefault(idx, _Choice())
            ch.text += c.text
            ch.token_ids += c.token_ids
            ch.logprobs += c.logprobs or []
            ch.finish_reason = c.finish_reason or ch.finish_reason
            ch.stop_reason = c.stop_reason if c.stop_reason is not None else ch.stop_reason
            out.append((idx, c))
        return out

    def usage(self) -> P.Usage:
        prompt = sum(self.prompt_tokens.values())
        completion = sum(len(c.token_ids) for c in self.choices.values())
        return P.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                       prompt_tokens_details=P.PromptTokensDetails(cached_tokens=sum(self.cached_tokens.values())))


async def _merged(engine: AsyncEngine, prompts: list[list[int]], params: SamplingParams,
                  cache_salt: str | None) -> AsyncIterator[tuple[int, RequestDelta]]:
    """Deltas of several prompts' requests as they come; closing this aborts them all."""
    if len(prompts) == 1:
        async with contextlib.aclosing(engine.generate(prompts[0], params, cache_salt=cache_salt)) as gen:
            async for d in gen:
                yield 0, d
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, toks: list[int]) -> None:
        try:
            async with contextlib.aclosing(engine.generate(toks, params, cache_salt=cache_salt)) as gen:
                async for d in gen:
                    queue.put_nowait((i, d))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, e))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(prompts)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# ---- the app -------------------------------------------------------------------


def build_app(engine: AsyncEngine, tokenizer: Any, served_model_name: str, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="kvserve", version=kvserve.__version__)
    info = engine.model_info

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.type, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return _error(400, message, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail), "invalid_request_error")

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", "internal_server_error")

    async def check_key(request: Request) -> None:
        if api_key is None:
            return
        auth = request.headers.get("authorization", "")
        if auth != f"Bearer {api_key}":
            raise APIError(401, "invalid or missing API key", "authentication_error")

    def check_model(name: str | None) -> None:
        if name is not None and name != served_model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {served_model_name!r}",
                           "not_found_error", "model")

    def check_prompt(toks: list[int], params: SamplingParams, field_name: str) -> None:
        """The engine's own checks, made here so a bad request never reaches it."""
        if not toks:
            raise APIError(400, "prompt must not be empty", param=field_name)
        bad = next((t for t in toks if not 0 <= t < info.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {info.vocab_size})", param=field_name)
        n = len(toks)
        max_tokens = params.max_tokens if params.max_tokens is not None else info.max_model_len - n
        if n >= info.max_model_len or n + max_tokens > info.max_model_len:
            raise APIError(400, f"prompt ({n} tokens) + max_tokens ({max_tokens}) exceeds the model's context "
                           f"length max_model_len={info.max_model_len}", param="max_tokens")
        need = -(-(n + max_tokens) // info.block_size)
        if need > info.num_kv_blocks:
            raise APIError(400, f"prompt + max_tokens need {need} KV blocks but the KV cache has only "
                           f"{info.num_kv_blocks}; lower max_tokens", param="max_tokens")

    def encode_prompts(prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        if not prompt:
            raise APIError(400, "prompt must not be empty", param="prompt")
        return [list(tokenizer(p)["input_ids"]) if isinstance(p, str) else list(p) for p in prompt]

    def chat_tokens(req: P.ChatCompletionRequest) -> list[int]:
        msgs = []
        for m in req.messages:
            content = m.content
            if isinstance(content, list):
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise APIError(400, "only text content parts are supported", param="messages")
                content = "".join(p["text"] for p in content)
            msgs.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
        if not getattr(tokenizer, "chat_template", None):
            raise APIError(400, "the model has no chat template; use /v1/completions", param="messages")
        out = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    def token_text(tid: int, lp: Any) -> str:
        return lp.decoded_token if lp.decoded_token is not None else tokenizer.decode([tid])

    def top_entries(pos: dict, k: int) -> list[tuple[int, Any]]:
        items = sorted(pos.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
        return items[:k]

    def completion_logprobs(positions: list[dict], k: int, offset: int) -> P.CompletionLogprobs:
        res = P.CompletionLogprobs()
        for pos in positions:
            tid, lp = next(iter(pos.items()))
            text = token_text(tid, lp)
            res.tokens.append(text)
            res.token_logprobs.append(lp.logprob)
            res.top_logprobs.append({token_text(t, v): v.logprob for t, v in top_entries(pos, k)})
            res.text_offset.append(offset)
            offset += len(text)
        return res

    def chat_logprobs(positions: list[dict], k: int) -> P.ChatLogprobs:
        content = []
        for pos in positions:
            tid, lp = next(iter(pos.items()))
            text = token_text(tid, lp)
            tops = [P.TopLogprob(token=token_text(t, v), logprob=v.logprob,
                                 bytes=list(token_text(t, v).encode())) for t, v in top_entries(pos, k)]
            content.append(P.ChatTokenLogprob(token=text, logprob=lp.logprob, bytes=list(text.encode()),
                                              top_logprobs=tops))
        return P.ChatLogprobs(content=content)

    def sse(obj: Any) -> str:
        return f"data: {obj.model_dump_json() if hasattr(obj, 'model_dump_json') else json.dumps(obj)}\n\n"

    def engine_error(e: BaseException) -> APIError:
        if isinstance(e, ValueError):
            return APIError(400, str(e))
        if isinstance(e, EngineDeadError):
            return APIError(500, f"the engine is not running: {e}", "internal_server_error")
        return APIError(500, f"internal error: {type(e).__name__}: {e}", "internal_server_error")

    async def stream_events(deltas: AsyncIterator, acc: _Accum, chunk_for, usage_chunk) -> AsyncIterator[str]:
        try:
            async with contextlib.aclosing(deltas) as it:
                async for i, d in it:
                    for idx, c in acc.add(i, d):
                        chunk = chunk_for(idx, c)
                        if chunk is not None:
                            yield sse(chunk)
            if usage_chunk is not None:
                yield sse(usage_chunk(acc.usage()))
        except Exception as e:  # noqa: BLE001 - the status line is sent; report in-band
            err = engine_error(e)
            yield sse({"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.status}})
        yield "data: [DONE]\n\n"

    async def collect(deltas: AsyncIterator, acc: _Accum) -> None:
        try:
            async with contextlib.aclosing(deltas) as it:
                async for i, d in it:
                    acc.add(i, d)
        except Exception as e:  # noqa: BLE001
            raise engine_error(e) from None

    v1 = [Depends(check_key)]

    @app.get("/health")
    async def health() -> JSONResponse:
        if not engine.is_alive():
            return _error(503, "the engine process is not running", "service_unavailable")
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict:
        return {"version": kvserve.__version__}

    @app.get("/v1/models", dependencies=v1)
    async def models() -> dict:
        card = P.ModelCard(id=served_model_name, root=info.model_path, max_model_len=info.max_model_len)
        return P.ModelList(data=[card]).model_dump()

    @app.post("/v1/completions", dependencies=v1)
    async def completions(req: P.CompletionRequest):
        check_model(req.model)
        if req.echo:
            raise APIError(400, "echo is not supported yet", param="echo")
        if req.suffix is not None:
            raise APIError(400, "suffix is not supported", param="suffix")
        params = _sampling_params(req, req.max_tokens, req.logprobs)
        prompts = encode_prompts(req.prompt)
        for p in prompts:
            check_prompt(p, params, "prompt")
        acc, rid, k = _Accum(req.n), P.new_id("cmpl"), req.logprobs or 0
        deltas = _merged(engine, prompts, params, req.cache_salt)
        if req.stream:
            offsets: dict[int, int] = {}

            def chunk_for(idx: int, c: CompletionDelta) -> P.CompletionResponse | None:
                if not (c.text or c.finish_reason or c.token_ids):
                    return None
                lps = None
                if req.logprobs is not None and c.logprobs:
                    lps = completion_logprobs(c.logprobs, k, offsets.get(idx, 0))
                offsets[idx] = offsets.get(idx, 0) + len(c.text)
                return P.CompletionResponse(id=rid, model=served_model_name, choices=[P.CompletionChoice(
                    index=idx, text=c.text, logprobs=lps, finish_reason=c.finish_reason, stop_reason=c.stop_reason)])

            usage = None
            if req.stream_options is not None and req.stream_options.include_usage:
                usage = lambda u: P.CompletionResponse(id=rid, model=served_model_name, choices=[], usage=u)  # noqa: E731
            return StreamingResponse(stream_events(deltas, acc, chunk_for, usage), media_type="text/event-stream")
        await collect(deltas, acc)
        choices = [P.CompletionChoice(index=i, text=c.text, finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                      logprobs=completion_logprobs(c.logprobs, k, 0) if req.logprobs is not None
                                      else None) for i, c in sorted(acc.choices.items())]
        return P.CompletionResponse(id=rid, model=served_model_name, choices=choices, usage=acc.usage()).model_dump()

    @app.post("/v1/chat/completions", dependencies=v1)
    async def chat_completions(req: P.ChatCompletionRequest):
        check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = _sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
        toks = chat_tokens(req)
        check_prompt(toks, params, "messages")
        acc, rid, k = _Accum(req.n), P.new_id("chatcmpl"), req.top_logprobs or 0
        deltas = _merged(engine, [toks], params, req.cache_salt)
        if req.stream:
            started: set[int] = set()

            def chunk_for(idx: int, c: CompletionDelta) -> P.ChatCompletionChunk | None:
                if not (c.text or c.finish_reason or c.token_ids):
                    return None
                delta = P.ChatDelta(content=c.text)
                if idx not in started:
                    started.add(idx)
                    delta.role = "assistant"
                lps = chat_logprobs(c.logprobs, k) if req.logprobs and c.logprobs else None
                return P.ChatCompletionChunk(id=rid, model=served_model_name, choices=[P.ChatStreamChoice(
                    index=idx, delta=delta, logprobs=lps, finish_reason=c.finish_reason)])

            usage = None
            if req.stream_options is not None and req.stream_options.include_usage:
                usage = lambda u: P.ChatCompletionChunk(id=rid, model=served_model_name, choices=[], usage=u)  # noqa: E731
            return StreamingResponse(stream_events(deltas, acc, chunk_for, usage), media_type="text/event-stream")
        await collect(deltas, acc)
        choices = [P.ChatChoice(index=i, message=P.ChatResponseMessage(content=c.text), finish_reason=c.finish_reason,
                                stop_reason=c.stop_reason, logprobs=chat_logprobs(c.logprobs, k) if req.logprobs
                                else None) for i, c in sorted(acc.choices.items())]
        return P.ChatCompletionResponse(id=rid, model=served_model_name, choices=choices,
                                        usage=acc.usage()).model_dump()

    return app


# ---- entry point ---------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from kvserve.cli import add_engine_args

    p = argparse.ArgumentParser(prog="kvserve-server", description="OpenAI-compatible server")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None)
    p.add_argument("--served-model-name", default=None)
    return p


def _engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return dict(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                kv_cache_memory=args.kv_cache_memory, num_kv_blocks=args.num_kv_blocks, block_size=args.block_size,
                enable_prefix_caching=args.enable_prefix_caching, prefix_cache=args.prefix_cache,
                max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                seed=args.seed, device=args.device)


async def serve(args: argparse.Namespace) -> None:
    import uvicorn

    tokenizer = load_tokenizer(args.model)
    engine = await AsyncEngine.start(**_engine_kwargs(args))
    try:
        name = args.served_model_name or (args.model.rstrip("/").split("/")[-1] if args.model
                                          else Path(engine.model_info.model_path).stem)
        app = build_app(engine, tokenizer, name, args.api_key)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)
        print(f"kvserve: serving {name!r} ({engine.model_info.model_path}) at http://{args.host}:{args.port}/v1",
              flush=True)
        await uvicorn.Server(config).serve()
    finally:
        await engine.shutdown()


def _raise_exit(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # uvicorn re-raises a captured SIGTERM after its graceful stop; make that an
    # exception so the engine process is shut down in `serve`'s finally.
    signal.signal(signal.SIGTERM, _raise_exit)
    try:
        asyncio.run(serve(args))
    except ValueError as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, SystemExit):
        return 0
    except RuntimeError as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
