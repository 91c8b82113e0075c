"""What every OpenAI endpoint shares: checks, admission, engine streams, SSE, errors.

A request is checked here (model name, SamplingParams, prompt length against the
context and the KV cache) so a bad request never reaches the engine. Then it is
admitted: `--max-waiting` bounds the engine requests still waiting for their
first token, and one over it gets 503 with Retry-After. Streaming responses
close the engine stream (`aclosing`) when the client leaves, which aborts the
engine request and frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from kvserve.blend.chunks import BLENDED, RECOMPUTED, check_blend_spec, make_spec
from kvserve.config import BlendConfig
from kvserve.engine.async_engine import AsyncEngine, EngineDeadError, KVLoadError
from kvserve.engine.engine_proc import CompletionDelta, RequestDelta
from kvserve.sampling_params import SamplingParams
from kvserve.server import protocol as P
from kvserve.server.metrics import ServerMetrics
from kvserve.server.prompts import PromptError, chat_prompt_ids, completion_prompt_ids, max_prompt_chars

RETRY_AFTER_S = 1
_SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens")

_MAX_TOKENS_FIELDS = ("max_tokens", "max_completion_tokens")

Deltas = AsyncIterator[tuple[int, RequestDelta]]


def _omitted(req: Any, name: str) -> bool:
    """The client did not send the field, or sent null (vLLM treats both as "use the default")."""
    return name not in req.model_fields_set or getattr(req, name) is None


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
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
        return APIError(500, f"the engine is not running: {e}", "internal_server_error")
    return APIError(500, f"internal error: {type(e).__name__}: {e}", "internal_server_error")


def sse(obj: Any) -> str:
    return f"data: {obj.model_dump_json() if hasattr(obj, 'model_dump_json') else json.dumps(obj)}\n\n"


@dataclass
class Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class Accum:
    """What one HTTP request has produced so far, over its prompts (i) and samples (n)."""

    n: int
    choices: dict[int, Choice] = field(default_factory=dict)
    prompt_tokens: dict[int, int] = field(default_factory=dict)
    cached_tokens: dict[int, int] = field(default_factory=dict)
    cached_by_tier: dict[int, dict[str, int]] = field(default_factory=dict)
    prompt_logprobs: dict[int, list] = field(default_factory=dict)
    kv_transfer_params: dict[str, Any] | None = None

    def add(self, prompt_idx: int, d: RequestDelta) -> list[tuple[int, CompletionDelta]]:
        if d.kv_transfer_params is not None:
            self.kv_transfer_params = d.kv_transfer_params
        if d.num_prompt_tokens:  # the abort delta carries zeros
            self.prompt_tokens[prompt_idx] = d.num_prompt_tokens
            self.cached_tokens[prompt_idx] = d.num_cached_tokens
            self.cached_by_tier[prompt_idx] = d.cached_tokens_by_tier
        if d.prompt_logprobs is not None:
            self.prompt_logprobs[prompt_idx] = d.prompt_logprobs
        out = []
        for c in d.outputs:
            idx = prompt_idx * self.n + c.index
            ch = self.choices.setdefault(idx, Choice())
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
        by_tier: dict[str, int] = {}
        for split in self.cached_by_tier.values():
            for tier, n in split.items():
                by_tier[tier] = by_tier.get(tier, 0) + n
        blended, recomputed = by_tier.pop(BLENDED, 0), by_tier.pop(RECOMPUTED, 0)
        details = P.PromptTokensDetails(cached_tokens=sum(self.cached_tokens.values()), cached_tokens_by_tier=by_tier,
                                        blended_tokens=blended, recomputed_tokens=recomputed)
        return P.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                       prompt_tokens_details=details)


class Serving:
    """Engine access for the endpoints (serving_completion.py, serving_chat.py)."""

    def __init__(self, engine: AsyncEngine, tokenizer: Any, model_name: str, metrics: ServerMetrics,
                 max_waiting: int) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.info = engine.model_info

    @functools.cached_property
    def max_prompt_chars(self) -> int:
        """Prompt text longer than this cannot fit in max_model_len tokens: refused untokenized."""
        return max_prompt_chars(self.tokenizer, self.info.max_model_len)

    # ---- checks -------------------------------------------------------------

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           "not_found_error", "model")

    def sampling_params(self, req: P.CompletionRequest | P.ChatCompletionRequest, max_tokens: int | None,
                        logprobs: int | None, prompt_logprobs: int | None = None,
                        longest_prompt: int = 0) -> SamplingParams:
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
                                  prompt_logprobs=prompt_logprobs, extra_args=extra)
        except ValueError as e:
            name = str(e).split(" ", 1)[0]
            known = name in P.CompletionRequest.model_fields or name in P.ChatCompletionRequest.model_fields
            raise APIError(400, str(e), param=name if known else None) from None

    def completion_ids(self, prompt: Any) -> tuple[list[list[int]], list[str | None]]:
        """Token ids of each prompt of a completion request, and its text when given as text."""
        try:
            return completion_prompt_ids(self.tokenizer, prompt, self.max_prompt_chars)
        except PromptError as e:
            raise APIError(400, e.message, param=e.param) from None

    def chat_ids(self, messages: list[P.ChatMessage], **options: Any) -> list[int]:
        """Token ids of a chat request's messages (the chat template, with the generation prompt
        unless `options`, chat_prompt_ids' keywords, say otherwise)."""
        try:
            return chat_prompt_ids(self.tokenizer, [m.model_dump() for m in messages], self.max_prompt_chars,
                                   **options)
        except PromptError as e:
            raise APIError(400, e.message, param=e.param) from None

    def blend_params(self, params: SamplingParams, prompts: list[list[int]], texts: list[str | None],
                     options: P.BlendOptions | None, field_name: str) -> list[SamplingParams]:
        """Each prompt's SamplingParams: with blending on, its chunks (the request's `blend.chunks`,
        or the separators in its text) as the token spans the engine takes."""
        blend = self.info.blend
        if blend is None:
            if options is not None:
                raise APIError(400, "blend needs a server started with --enable-blending", param="blend")
            return [params] * len(prompts)
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

    def chat_text(self, messages: list[P.ChatMessage]) -> str:
        """The chat prompt as text (what chat_ids tokenizes), where blending finds its chunks."""
        try:
            return chat_prompt_ids(self.tokenizer, [m.model_dump() for m in messages], self.max_prompt_chars,
                                   as_text=True)
        except PromptError as e:
            raise APIError(400, e.message, param=e.param) from None

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
                    cache_salt: str | None) -> Deltas:
        """Admit the request (503 when over --max-waiting) and return its merged engine stream.

        Admission happens here, in the handler, before any response starts: the count
        goes up in the same step as the check, so a burst cannot slip past the limit.
        """
        if not self.engine.is_alive():
            raise APIError(500, "the engine is not running", "internal_server_error")
        gen = self._merged(prompts, params, cache_salt)
        await anext(gen)  # runs the admission check; raises APIError(503) if refused
        return gen

    async def _merged(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                      cache_salt: str | None) -> AsyncIterator[Any]:
        """Yields None once admitted, then (prompt index, delta) as they come; closing aborts all."""
        waiting = self.metrics.num_waiting_first_token
        if waiting + len(prompts) > self.max_waiting:
            raise APIError(503, f"server overloaded: {waiting} requests are waiting for their first token "
                           f"(--max-waiting {self.max_waiting}); retry later", "service_unavailable",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)  # one per prompt
        trackers = [self.metrics.track(p.n) for p in per_prompt]
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, toks: list[int]) -> None:
            try:
                gen = self.engine.generate(toks, per_prompt[i], cache_salt=cache_salt)
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
            yield None
            tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(prompts)]
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

    async def stream_events(self, deltas: Deltas, acc: Accum, chunk_for: Callable[[int, CompletionDelta], Any],
                            usage_chunk: Callable[[P.Usage], Any] | None) -> AsyncIterator[str]:
        """SSE lines; an engine failure after the status line is reported in-band as an error event."""
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
            yield sse(engine_error(e).body())
        yield "data: [DONE]\n\n"

    @staticmethod
    async def collect(deltas: Deltas, acc: Accum) -> None:
        try:
            async with contextlib.aclosing(deltas) as it:
                async for i, d in it:
                    acc.add(i, d)
        except Exception as e:  # noqa: BLE001
            raise engine_error(e) from None

    # ---- logprob text -----------------------------------------------------------

    def token_text(self, tid: int, lp: Any) -> str:
        return lp.decoded_token if lp.decoded_token is not None else self.tokenizer.decode([tid])

    @staticmethod
    def top_entries(pos: dict, k: int) -> list[tuple[int, Any]]:
        items = sorted(pos.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
        return items[:k]
