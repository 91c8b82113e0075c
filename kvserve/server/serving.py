"""What every OpenAI endpoint shares: checks, admission, engine streams, SSE, errors.

A request is checked here (model name, n against --max-n, SamplingParams, prompt
text against the context and the KV cache before it is tokenized, token counts
after) so a bad request never reaches the engine. Prompts are tokenized on the
tokenizer's thread (tokenizer_pool.py), never on the event loop. Then the request is admitted:
`--max-waiting` bounds the sequences (each prompt's n samples) still waiting for
their first token; a request over it alone gets 400, one that does not fit now
503 with Retry-After. A stream starts only once the engine has taken every
engine request, so an error the engine finds is a real HTTP status, never a 200
with the error inside. A client that leaves, streaming or not, closes the engine
stream (`aclosing`), which aborts the engine request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from kvserve.blend.chunks import check_blend_spec, make_spec
from kvserve.config import BlendConfig
from kvserve.engine.async_engine import AsyncEngine, EngineDeadError, KVLoadError
from kvserve.engine.wire import CompletionDelta, RequestDelta
from kvserve.sampling_params import PREDICTION, SamplingParams, StructuredOutputsParams
from kvserve.server import protocol as P
from kvserve.server.accum import Accum
from kvserve.server.metrics import ServerMetrics
from kvserve.server.prompts import (PromptError, TextLimits, chat_prompt_ids, check_prompt_text, completion_prompts,
                                    encode_prompt, text_limits)
from kvserve.server.tokenizer_pool import TokenizerPool

RETRY_AFTER_S = 1
# A dead engine does not come back in this process; a supervisor restarts the server meanwhile.
DEAD_RETRY_AFTER_S = 10
DEFAULT_MAX_N = 16
# How long a stream waits for the engine to take its request before the status line goes out
# (the engine reads new requests between steps, which take at most ~0.5 s; see README).
ACCEPT_TIMEOUT_S = 30.0
_SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids",
                    "include_stop_str_in_output", "skip_special_tokens")

_MAX_TOKENS_FIELDS = ("max_tokens", "max_completion_tokens")

Deltas = AsyncIterator[tuple[int, RequestDelta]]
Receive = Callable[[], Awaitable[dict]]  # a request's ASGI receive channel


def _omitted(req: Any, name: str) -> bool:
    """The client did not send the field, or sent null (vLLM treats both as "use the default")."""
    return name not in req.model_fields_set or getattr(req, name) is None


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        message = message.encode("utf-8", "backslashreplace").decode()  # a surrogate echoed from a request
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type_, param, headers

    def body(self) -> dict[str, Any]:
        return P.ErrorResponse(error=P.ErrorInfo(message=self.message, type=self.type, param=self.param,
                                                 code=self.status)).model_dump()


def engine_error(e: BaseException) -> APIError:
    if isinstance(e, APIError):
        return e
    if isinstance(e, ValueError):
        return APIError(400, str(e))
    if isinstance(e, KVLoadError):
        return APIError(502, str(e), "kv_transfer_error")
    if isinstance(e, EngineDeadError):
        return engine_dead(str(e))
    return APIError(500, f"internal error: {type(e).__name__}: {e}", "internal_server_error")


def constraint_error(err: APIError, field: str | None) -> APIError:
    """The engine's refusal of a request's constraint (its message starts with structured_outputs:
    a schema or regex the grammar backend cannot compile) names `field`, where the constraint came
    from (response_format, tool_choice, ...)."""
    if field and err.status == 400 and err.param is None and err.message.startswith("structured_outputs"):
        err.param = field
    return err


def engine_dead(why: str) -> APIError:
    return APIError(503, f"the engine is not running: {why}", "service_unavailable",
                    headers={"Retry-After": str(DEAD_RETRY_AFTER_S)})


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


async def until_disconnected(receive: Receive) -> None:
    """Return when the client closes the connection: once the body is read, the ASGI receive
    channel has nothing more to give until then (uvicorn answers http.disconnect)."""
    while (await receive())["type"] != "http.disconnect":
        pass


def sse(obj: Any) -> str:
    return f"data: {obj.model_dump_json() if hasattr(obj, 'model_dump_json') else json.dumps(obj)}\n\n"


@dataclasses.dataclass(frozen=True)
class ChatSettings:
    """The server's chat options (`kvserve serve` flags, launch.py): the tool-call parser of
    tool_choice "auto", the reasoning parser, and a chat template over the model's."""

    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    chat_template: str | None = None  # the template's text (--chat-template)


class Serving:
    """Engine access for the endpoints (serving_completion.py, serving_chat.py)."""

    chat: ChatSettings = ChatSettings()  # the server's chat options; none unless given

    def __init__(self, engine: AsyncEngine, tokenizer: Any, model_name: str, metrics: ServerMetrics,
                 max_waiting: int, max_n: int = DEFAULT_MAX_N, pool: TokenizerPool | None = None,
                 chat: ChatSettings | None = None) -> None:
        self.chat = chat if chat is not None else ChatSettings()
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.max_n = max_n
        self.pool = pool if pool is not None else TokenizerPool(max_waiting)
        self.info = engine.model_info

    @functools.cached_property
    def limits(self) -> TextLimits:
        """Prompt text beyond these cannot fit in max_model_len tokens, or a request's in the KV
        cache: refused untokenized."""
        return text_limits(self.tokenizer, self.info.max_model_len, self.info.num_kv_blocks * self.info.block_size)

    @functools.cached_property
    def chat_limits(self) -> TextLimits:
        """A chat is one prompt: the context bounds it (the KV cache's bound is never lower)."""
        return text_limits(self.tokenizer, self.info.max_model_len, 0)

    # ---- checks -------------------------------------------------------------

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           "not_found_error", "model")

    def sampling_params(self, req: P.CompletionRequest | P.ChatCompletionRequest, max_tokens: int | None,
                        logprobs: int | None, prompt_logprobs: int | None = None,
                        longest_prompt: int = 0,
                        structured: StructuredOutputsParams | None = None) -> SamplingParams:
        """The request's SamplingParams. A field it omits (or sends as null) takes the model's
        default (--generation-config, ModelInfo.generation_defaults) when there is one; a max_tokens
        taken so is cut to the room the longest prompt leaves, as vLLM does."""
        kwargs = {k: getattr(req, k) for k in _SAMPLING_FIELDS if getattr(req, k) is not None}
        defaults = self.info.generation_defaults
        kwargs.update({k: v for k, v in defaults.items() if k in _SAMPLING_FIELDS and _omitted(req, k)})
        given = [k for k in _MAX_TOKENS_FIELDS if k in type(req).model_fields and not _omitted(req, k)]
        if "max_tokens" in defaults and not given:
            room = self.info.max_model_len - longest_prompt
            max_tokens = min(defaults["max_tokens"], room) if room >= 1 else defaults["max_tokens"]
        extra = {"kv_transfer_params": req.kv_transfer_params} if req.kv_transfer_params is not None else None
        chat = isinstance(req, P.ChatCompletionRequest)
        for name, k in (("top_logprobs" if chat else "logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if k is not None and k > self.info.max_logprobs:
                raise APIError(400, f"{name} must be at most {self.info.max_logprobs} (the server's --max-logprobs), "
                               f"got {k}", param=name)
        try:
            return SamplingParams(**kwargs, max_tokens=max_tokens, logprobs=logprobs,
                                  prompt_logprobs=prompt_logprobs, extra_args=extra, structured_outputs=structured)
        except ValueError as e:
            name = str(e).split(" ", 1)[0]
            known = name in P.CompletionRequest.model_fields or name in P.ChatCompletionRequest.model_fields
            raise APIError(400, str(e), param=name if known else None) from None

    async def with_prediction(self, params: SamplingParams, prediction: dict[str, Any] | None) -> SamplingParams:
        """OpenAI's predicted output ({"type": "content", "content": text or text parts}), checked;
        where the engine drafts by n-gram lookup it is tokenized into extra_args[PREDICTION] and
        drafts come from it (usage counts them as accepted / rejected prediction tokens); elsewhere
        it changes no answer and is dropped."""
        if prediction is None:
            return params
        if set(prediction) - {"type", "content"} or prediction.get("type") != "content":
            raise APIError(400, 'prediction must be {"type": "content", "content": ...}', param="prediction")
        content = prediction.get("content")
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" and set(p) == {"type", "text"}
                                             and isinstance(p["text"], str) for p in content):
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise APIError(400, "prediction.content must be a string or a list of text parts", param="prediction")
        try:
            check_prompt_text([content], ["prediction.content"], self.chat_limits, "prediction")
        except PromptError as e:
            raise APIError(400, str(e), param="prediction") from None
        if self.info.speculative_method != "ngram" or not content:
            return params
        ids = await self.pool.run(functools.partial(self.tokenizer.encode, add_special_tokens=False), content)
        return dataclasses.replace(params, extra_args={**(params.extra_args or {}), PREDICTION: ids})

    def check_sequences(self, num_prompts: int, n: int, field_name: str) -> None:
        """n within --max-n, and the request's sequences (prompts x n) within --max-waiting: 400 if
        it could never be admitted, 503 if it cannot be now (checked again when it is sent)."""
        if n > self.max_n:
            raise APIError(400, f"n must be at most {self.max_n} (the server's --max-n), got {n}", param="n")
        seqs = num_prompts * n
        if seqs > self.max_waiting:
            raise APIError(400, f"the request has {seqs} sequences ({num_prompts} prompts x n={n}) but the server "
                           f"admits at most {self.max_waiting} waiting for their first token (--max-waiting "
                           f"{self.max_waiting}); send fewer per request", param=field_name if num_prompts > 1 else "n")
        self._check_room(seqs)

    def _check_room(self, seqs: int) -> None:
        waiting = self.metrics.num_waiting_first_token
        if waiting + seqs > self.max_waiting:
            raise APIError(503, f"server overloaded: {waiting} sequences are waiting for their first token "
                           f"(--max-waiting {self.max_waiting}); retry later", "service_unavailable",
                           headers={"Retry-After": str(RETRY_AFTER_S)})

    def completion_prompts(self, prompt: Any) -> list[str | list[int]]:
        """A completion request's prompts, texts checked (prompts.check_prompt_text), not tokenized."""
        try:
            return completion_prompts(prompt, self.limits)
        except PromptError as e:
            raise APIError(400, e.message, param=e.param) from None

    async def encode(self, prompts: list[str | list[int]],
                     add_special_tokens: bool = True) -> tuple[list[list[int]], list[str | None]]:
        """Token ids of each prompt and its text when given as text. One tokenizer job per prompt,
        so a request of many prompts does not hold the tokenizer from the others for long."""
        ids = [await self.pool.run(encode_prompt, self.tokenizer, p, add_special_tokens) if isinstance(p, str)
               else p for p in prompts]
        return ids, [p if isinstance(p, str) else None for p in prompts]

    def chat_ids(self, messages: list[P.ChatMessage], **options: Any) -> Any:
        """Token ids of a chat request's messages (the chat template, with the generation prompt
        unless `options`, chat_prompt_ids' keywords, say otherwise). Blocks: the routes call
        render_chat, which runs it on the tokenizer's thread."""
        try:
            return chat_prompt_ids(self.tokenizer, [m.model_dump() for m in messages], self.chat_limits,
                                   chat_template=self.chat.chat_template, **options)
        except PromptError as e:
            raise APIError(400, e.message, param=e.param) from None

    async def render_chat(self, messages: list[P.ChatMessage], **options: Any) -> Any:
        return await self.pool.run(functools.partial(self.chat_ids, messages, **options))

    async def blend_params(self, params: SamplingParams, prompts: list[list[int]], texts: list[str | None],
                           options: P.BlendOptions | None, field_name: str) -> list[SamplingParams]:
        """Each prompt's SamplingParams: with blending on, its chunks (the request's `blend.chunks`,
        or the separators in its text) as the token spans the engine takes (tokenized on the
        tokenizer's thread)."""
        if self.info.blend is None:
            if options is not None:
                raise APIError(400, "blend needs a server started with --enable-blending", param="blend")
            return [params] * len(prompts)
        return await self.pool.run(self._blend_params, params, prompts, texts, options, field_name)

    def _blend_params(self, params: SamplingParams, prompts: list[list[int]], texts: list[str | None],
                      options: P.BlendOptions | None, field_name: str) -> list[SamplingParams]:
        blend = self.info.blend
        assert blend is not None
        opts = options.model_dump(exclude_none=True) if options is not None else None
        cfg = BlendConfig(**{k: v for k, v in blend.items() if k != "num_layers"})
        out = []
        for toks, text in zip(prompts, texts):
            try:
                spec = make_spec(self.tokenizer, text, toks, cfg.separator, opts, field_name)
                check_blend_spec(spec, cfg, len(toks), blend["num_layers"])
            except ValueError as e:
                raise APIError(400, str(e), param="blend" if str(e).startswith("blend") else field_name) from None
            out.append(params if spec is None else
                       dataclasses.replace(params, extra_args={**(params.extra_args or {}), "blend": spec}))
        return out

    async def chat_text(self, messages: list[P.ChatMessage], **options: Any) -> str:
        """The chat prompt as text (what chat_ids tokenizes), where blending finds its chunks."""
        return await self.render_chat(messages, as_text=True, **options)

    def truncate(self, req: P.CompletionRequest | P.ChatCompletionRequest,
                 prompts: list[list[int]]) -> list[list[int]]:
        """truncate_prompt_tokens (vLLM's): each prompt's last N tokens."""
        k = req.truncate_prompt_tokens
        if k is None:
            return prompts
        if not 1 <= k <= self.info.max_model_len:
            raise APIError(400, f"truncate_prompt_tokens must be in [1, max_model_len={self.info.max_model_len}], "
                           f"got {k}", param="truncate_prompt_tokens")
        return [p[-k:] for p in prompts]

    @staticmethod
    def usage_options(req: P.CompletionRequest | P.ChatCompletionRequest) -> tuple[bool, bool]:
        """(a last chunk with the usage, usage on every chunk): stream_options.include_usage, and
        vLLM's continuous_usage_stats, which as in vLLM needs include_usage too."""
        opts = req.stream_options
        final = opts is not None and opts.include_usage
        return final, final and opts is not None and opts.continuous_usage_stats

    def check_prompt(self, toks: list[int], params: SamplingParams, field_name: str) -> None:
        """The engine's own checks (EngineCore.validate), made before anything is sent to it."""
        info = self.info
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

    # ---- engine streams -------------------------------------------------------

    async def start(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                    cache_salt: str | None, stream: bool = False, priority: int = 0,
                    constraint_field: str | None = None) -> Deltas:
        """Admit the request (503 when its sequences do not fit under --max-waiting) and return its
        merged engine stream. With `stream`, only once the engine has taken every engine request:
        one it refuses raises here, before the status line, as its HTTP error.

        Admission happens here, in the handler, before any response starts: the count
        goes up in the same step as the check, so a burst cannot slip past the limit. The engine's
        refusal of a request's constraint (its message names structured_outputs: a schema or regex
        the grammar backend cannot compile) names `constraint_field`, the field it came from.
        """
        if not self.engine.is_alive():
            raise engine_dead("the engine process is gone")
        gen = self._merged(prompts, params, cache_salt, stream, priority)
        try:
            await anext(gen)  # admission (and acceptance); raises APIError if refused
        except Exception as e:  # noqa: BLE001 - the engine's refusal, as an HTTP status
            raise constraint_error(engine_error(e), constraint_field) from None
        return gen

    async def _merged(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                      cache_salt: str | None, confirm: bool, priority: int = 0) -> AsyncIterator[Any]:
        """Yields None once admitted (with `confirm`, once the engine has taken every request), then
        (prompt index, delta) as they come; closing aborts all."""
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)  # one per prompt
        self._check_room(sum(p.n for p in per_prompt))
        trackers = [self.metrics.track(p.n) for p in per_prompt]
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, toks: list[int]) -> None:
            try:
                gen = self.engine.generate(toks, per_prompt[i], priority=priority, cache_salt=cache_salt)
                async with contextlib.aclosing(gen) as it:
                    async for d in it:
                        trackers[i].on_delta(d)
                        queue.put_nowait((i, d))
            except Exception as e:  # noqa: BLE001 - handed to the consumer
                queue.put_nowait((i, e))
            finally:
                trackers[i].close()
                queue.put_nowait((i, None))

        tasks: list[asyncio.Task] = []
        try:
            # A pump sends its request in its first step, and tasks start in the order they are
            # made: the barrier's query, from a task made after them, reaches the engine after
            # every request, and its answer comes back after any refusal of one.
            tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(prompts)]
            if confirm:
                await self._accepted(asyncio.create_task(self.engine.barrier(ACCEPT_TIMEOUT_S)), queue)
            yield None
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
            for t in trackers:
                t.close()

    @staticmethod
    async def _accepted(barrier: asyncio.Task, queue: asyncio.Queue) -> None:
        """Wait for the engine to have read the requests; raise the first refusal among them."""
        try:
            await barrier
        except asyncio.TimeoutError:
            raise APIError(503, f"the engine did not take the request within {ACCEPT_TIMEOUT_S:g} s; retry later",
                           "service_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        early = []
        while not queue.empty():
            early.append(queue.get_nowait())
        error = next((item for _, item in early if isinstance(item, BaseException)), None)
        if error is not None:
            raise error
        for item in early:
            queue.put_nowait(item)

    async def stream_events(self, deltas: Deltas, acc: Accum, chunk_for: Callable[[int, CompletionDelta], Any],
                            usage_chunk: Callable[[P.Usage], Any] | None,
                            continuous_usage: bool = False) -> AsyncIterator[str]:
        """SSE lines; an engine failure after the status line is reported in-band as an error event.
        `chunk_for` gives a delta's chunk, a list of chunks, or None. With `continuous_usage` every
        chunk carries the request's usage so far (all its choices)."""
        try:
            async with contextlib.aclosing(deltas) as it:
                async for i, d in it:
                    for idx, c in acc.add(i, d):
                        out = chunk_for(idx, c)
                        for chunk in out if isinstance(out, list) else [] if out is None else [out]:
                            if continuous_usage:
                                chunk.usage = acc.usage()
                            yield sse(chunk)
            if usage_chunk is not None:
                yield sse(usage_chunk(acc.usage()))
        except Exception as e:  # noqa: BLE001 - the status line is sent; report in-band
            yield sse(engine_error(e).body())
        yield "data: [DONE]\n\n"

    @staticmethod
    async def collect(deltas: Deltas, acc: Accum, receive: Receive | None = None,
                      constraint_field: str | None = None) -> None:
        """Gather the whole answer. If the client leaves first (`receive`: the request's ASGI receive
        channel), the engine requests are aborted at once and ClientGone is raised. A constraint the
        engine could not compile is a 400 naming `constraint_field` (constraint_error)."""

        async def gather() -> None:
            async with contextlib.aclosing(deltas) as it:
                async for i, d in it:
                    acc.add(i, d)

        tasks = [asyncio.ensure_future(gather())]
        if receive is not None:
            tasks.append(asyncio.ensure_future(until_disconnected(receive)))
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if tasks[0].cancelled():
            raise ClientGone()
        if (e := tasks[0].exception()) is not None:
            raise constraint_error(engine_error(e), constraint_field) from None

    # ---- logprob text -----------------------------------------------------------

    def token_text(self, tid: int, lp: Any) -> str:
        return lp.decoded_token if lp.decoded_token is not None else self.tokenizer.decode([tid])

    @staticmethod
    def top_entries(pos: dict, k: int) -> list[tuple[int, Any]]:
        items = sorted(pos.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
        return items[:k]
