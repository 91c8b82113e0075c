"""One request through the router: describe it for the policy, pick a replica, relay the reply.

The body goes to the replica byte for byte and the reply comes back as the replica sent it:
its status, content type, body, errors and usage, a stream chunk by chunk. The router adds
only what a single replica cannot: another replica when the chosen one fails before the
first byte reaches the client (connection refused or reset, or a 5xx), and one clean SSE
error event when a stream already under way loses its replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import anyio
import httpx
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from kvserve.router.policy import Decision, Policy, RouteRequest
from kvserve.router.replicas import Lease, Replica, ReplicaSet
from kvserve.server import prompts

logger = logging.getLogger(__name__)

PREFIX = "kvserve_router:"
RETRY_AFTER_S = 1
FORWARD_HEADERS = ("authorization", "content-type", "accept")
_REPLY_HEADERS = ("content-type", "retry-after")
REPLICA_HEADER = "x-kvserve-replica"  # added to every reply: the replica that answered
# HF fast tokenizers reset their truncation state on every call and raise "Already borrowed"
# when two threads do it at once.
_TOKENIZER_LOCK = threading.Lock()


def describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__


def error_body(status: int, message: str, type_: str, param: str | None = None) -> dict[str, Any]:
    """The OpenAI error shape, exactly as a replica writes it (serving.APIError.body)."""
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


def forward_headers(headers: Mapping[str, str], upstream: Mapping[str, str]) -> dict[str, str]:
    """What a replica gets of the client's headers: FORWARD_HEADERS, with the Authorization of
    the router's --upstream-api-key in place of the client's when there is one."""
    return {**{k: v for k in FORWARD_HEADERS if (v := headers.get(k)) is not None}, **upstream}


class RouterMetrics:
    """The router's Prometheus metrics, in a registry of its own (tests run several routers)."""

    def __init__(self) -> None:
        self.registry = reg = CollectorRegistry()
        self.decisions = Counter(f"{PREFIX}decisions", "Routing decisions, by policy and reason.",
                                 ["policy", "reason"], registry=reg)
        self.retries = Counter(f"{PREFIX}retries", "Requests retried on another replica, by the failure.",
                               ["reason"], registry=reg)
        self.requests = Counter(f"{PREFIX}requests", "Replies from replicas, by replica and HTTP status "
                                "('error': no reply).", ["replica", "status"], registry=reg)
        per_replica = [("in_flight_requests", "Requests routed to the replica and not finished."),
                       ("in_flight_tokens", "Prompt tokens of requests on the replica still before their first byte."),
                       ("decode_streams", "Streams on the replica past their first byte."),
                       ("estimated_hit_rate", "The policy's estimated cached prompt tokens / prompt tokens routed."),
                       ("replica_healthy", "1 if the replica is in the rotation.")]
        self.gauges = {name: Gauge(f"{PREFIX}{name}", doc, ["replica"], registry=reg) for name, doc in per_replica}
        self._cached: dict[str, int] = {}
        self._prompt: dict[str, int] = {}

    def routed(self, url: str, decision: Decision, prompt_tokens: int) -> None:
        self._cached[url] = self._cached.get(url, 0) + decision.cached_tokens
        self._prompt[url] = self._prompt.get(url, 0) + prompt_tokens

    def render(self, replicas: ReplicaSet) -> bytes:
        for r in replicas.replicas:
            v, g = r.view, self.gauges
            g["in_flight_requests"].labels(r.url).set(v.in_flight)
            g["in_flight_tokens"].labels(r.url).set(v.pending_prefill_tokens)
            g["decode_streams"].labels(r.url).set(v.decode_streams)
            g["replica_healthy"].labels(r.url).set(int(v.healthy))
            prompt = self._prompt.get(r.url, 0)
            g["estimated_hit_rate"].labels(r.url).set(self._cached.get(r.url, 0) / prompt if prompt else 0.0)
        return generate_latest(self.registry)


class _Retry(Exception):
    """The replica failed before anything reached the client: try another one."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class _RelayResponse(StreamingResponse):
    """A StreamingResponse that always runs its clean-up (close the upstream stream, so the replica
    aborts the request, and give back the load) when it ends, even if the client left before the
    body iterator started, when a generator's own `finally` would never run."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
                await self._on_close()


# ---- describing a request ------------------------------------------------------------

def _content_text(content: Any) -> str:
    if isinstance(content, list):  # text parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return content if isinstance(content, str) else ""


_MAX_CODE_POINT = 0x10FFFF


def _is_ids(p: Any) -> bool:
    return isinstance(p, list) and bool(p) and all(
        isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= _MAX_CODE_POINT for t in p)


def token_id_prompts(kind: str, body: dict[str, Any]) -> list[list[int]] | None:
    """A completion's prompts when they are given as token ids (one list or a list of lists):
    counted and hashed as they are, no tokenizer needed; None otherwise."""
    prompt = body.get("prompt") if kind == "completion" else None
    if _is_ids(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(_is_ids(p) for p in prompt):
        return prompt
    return None


def request_text(kind: str, body: dict[str, Any]) -> str:
    """The prompt as text, for text-based policies and the token estimate: the prompt strings
    joined, the messages' contents each after a role marker, or a token-id prompt's ids (one
    code point each)."""
    if kind == "chat":
        msgs = body.get("messages")
        return "".join(f"<|{m.get('role')}|>\n{_content_text(m.get('content'))}\n"
                       for m in (msgs if isinstance(msgs, list) else []) if isinstance(m, dict))
    if ids := token_id_prompts(kind, body):
        # one code point per token, so text policies (approx's radix tree) match token-id prompts
        # by their leading tokens too; a batch goes where its first prompt goes
        return "".join(map(chr, ids[0]))
    prompt = body.get("prompt")
    prompts = [prompt] if isinstance(prompt, str) else prompt if isinstance(prompt, list) else []
    return "\n".join(p for p in prompts if isinstance(p, str))


def check_prompt_text(kind: str, body: dict[str, Any], limits: prompts.TextLimits) -> None:
    """The server's check of prompt text (PromptError, a 400 naming the field: longer than any
    context, or not Unicode), on the raw body before anything is tokenized."""
    if texts := prompts.prompt_texts(kind, body):
        prompts.check_prompt_text([t for t, _ in texts], [name for _, name in texts], limits,
                                  "messages" if kind == "chat" else "prompt")


def prompt_token_ids(kind: str, body: dict[str, Any], tokenizer: Any) -> list[list[int]] | None:
    """Each prompt's token ids, exactly as the replica computes them; None when the request is
    malformed (the replica answers it with its own error)."""
    try:
        if kind == "chat":
            msgs, tools = body.get("messages"), body.get("tools")
            tools = tools if isinstance(tools, list) and tools else None  # rendered into the prompt, as the replica does
            return [prompts.chat_prompt_ids(tokenizer, msgs, tools=tools)] if isinstance(msgs, list) else None
        return prompts.completion_prompt_ids(tokenizer, body.get("prompt"))[0]
    except ValueError:
        return None


def build_route_request(kind: str, body: dict[str, Any], headers: Mapping[str, str], tokenizer: Any,
                        needs_tokens: bool) -> RouteRequest:
    user = body.get("user")
    salt = body.get("cache_salt")
    req = RouteRequest(kind=kind, body=body, session_key=headers.get("x-session-id") or
                       (user if isinstance(user, str) and user else None),
                       cache_salt=salt if isinstance(salt, str) else None, text=request_text(kind, body))
    ids = token_id_prompts(kind, body)
    if ids is None and tokenizer is not None:
        try:
            with _TOKENIZER_LOCK:
                ids = prompt_token_ids(kind, body, tokenizer)
        except Exception:  # noqa: BLE001 - a routing hint must not fail the request; the replica decides
            logger.exception("router: could not tokenize a %s request; routing it without token ids", kind)
    if ids:
        req.num_prompt_tokens = sum(len(p) for p in ids)
        # A batch of prompts goes to one replica: the first one's prefix stands for the batch.
        req.token_ids = ids[0] if needs_tokens else None
    else:
        req.num_prompt_tokens = len(req.text) // 4  # ~4 characters per token in English BPE vocabularies
    return req


# ---- relaying -------------------------------------------------------------------------

class Proxy:
    def __init__(self, replicas: ReplicaSet, policy: Policy, client: httpx.AsyncClient,
                 metrics: RouterMetrics, tokenizer: Any = None) -> None:
        self.replicas, self.policy, self.client, self.metrics = replicas, policy, client, metrics
        self.tokenizer = tokenizer
        self._limits: tuple[int, prompts.TextLimits] | None = None  # (max_model_len, its limits)

    def text_limits(self) -> prompts.TextLimits | None:
        """Prompt text over these fits in no replica's context (prompts.text_limits at the largest
        max-model-len a replica reports); None without the tokenizer or that length. The replicas'
        KV capacity, the bound on a request's prompts together, is theirs to check."""
        n = self.replicas.max_model_len()
        if self.tokenizer is None or n is None:
            return None
        if self._limits is None or self._limits[0] != n:
            self._limits = (n, dataclasses.replace(prompts.text_limits(self.tokenizer, n, n), per_request=sys.maxsize))
        return self._limits[1]

    async def handle(self, kind: str, path: str, raw: bytes, headers: Mapping[str, str]) -> Response:
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        body = body if isinstance(body, dict) else {}  # still forwarded: the replica says what is wrong
        if (limits := self.text_limits()) is not None:
            try:
                check_prompt_text(kind, body, limits)
            except prompts.PromptError as e:  # as the replica would answer, without tokenizing it here
                return JSONResponse(error_body(400, e.message, "invalid_request_error", e.param), status_code=400)
        if self.tokenizer is not None:  # tokenizing a long prompt would stall every other stream
            req = await asyncio.to_thread(build_route_request, kind, body, headers, self.tokenizer,
                                          self.needs_tokens)
        else:
            req = build_route_request(kind, body, headers, None, self.needs_tokens)
        fwd = forward_headers(headers, self.replicas.headers)
        stream = body.get("stream") is True
        tried: set[str] = set()
        failures: list[str] = []
        while candidates := [r for r in self.candidates() if r.url not in tried]:
            decision = self.policy.choose(req, [r.view for r in candidates])
            replica = self.replicas.by_url(decision.replica.url)
            tried.add(replica.url)
            self.metrics.decisions.labels(self.policy.name, decision.reason).inc()
            content, lease = await self.plan(req, decision, replica, raw, path, fwd)
            try:
                send = self._stream if stream else self._once
                return await send(replica, f"{replica.url}{path}", content, fwd, lease, req, decision)
            except _Retry as e:
                lease.release()
                failures.append(f"{replica.url}: {e}")
                self.metrics.retries.labels(e.reason).inc()
                self.replicas.check_soon(replica)
                logger.warning("router: %s failed before replying (%s); trying another replica", replica.url, e)
            except BaseException:
                lease.release()
                raise
        why = "; ".join(failures) if failures else "no replica is healthy"
        return JSONResponse(error_body(503, f"no replica could serve the request: {why}", "service_unavailable"),
                            status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})

    @property
    def needs_tokens(self) -> bool:
        """Whether RouteRequest.token_ids is filled in (when the prompt can be tokenized)."""
        return self.policy.needs_tokens

    def candidates(self) -> list[Replica]:
        """The replicas the policy chooses from."""
        return self.replicas.healthy()

    async def plan(self, req: RouteRequest, decision: Decision, replica: Replica, raw: bytes, path: str,
                   fwd: dict[str, str]) -> tuple[bytes, Lease]:
        """The body to send the chosen replica, and the request's lease on it (released by the
        caller). Here the client's body as it came, and what the replica has left to prefill:
        the prompt less what the policy expects it holds."""
        return raw, Lease(replica, max(0, req.num_prompt_tokens - decision.cached_tokens))

    def _started(self, replica: Replica, lease: Lease, streaming: bool, status: int, req: RouteRequest,
                 decision: Decision) -> None:
        lease.first_byte(streaming)
        if 200 <= status < 300:
            replica.routed += 1
            self.metrics.routed(replica.url, decision, req.num_prompt_tokens)
            self.policy.on_routed(req, decision)

    def _count(self, replica: Replica, status: int | str) -> None:
        self.metrics.requests.labels(replica.url, str(status)).inc()

    async def _once(self, replica: Replica, url: str, raw: bytes, fwd: dict[str, str], lease: Lease,
                    req: RouteRequest, decision: Decision) -> Response:
        try:
            resp = await self.client.post(url, content=raw, headers=fwd)
        except httpx.TransportError as e:
            self._count(replica, "error")
            raise _Retry("connection", describe(e)) from None
        self._count(replica, resp.status_code)
        if resp.status_code >= 500:
            raise _Retry(f"status_{resp.status_code}", f"answered {resp.status_code}: {resp.text[:300]}")
        self._started(replica, lease, False, resp.status_code, req, decision)
        lease.release()
        return Response(resp.content, status_code=resp.status_code, headers=_reply_headers(resp, replica.url))

    async def _stream(self, replica: Replica, url: str, raw: bytes, fwd: dict[str, str], lease: Lease,
                      req: RouteRequest, decision: Decision) -> Response:
        try:
            resp = await self.client.send(self.client.build_request("POST", url, content=raw, headers=fwd),
                                          stream=True)
        except httpx.TransportError as e:
            self._count(replica, "error")
            raise _Retry("connection", describe(e)) from None
        self._count(replica, resp.status_code)
        chunks = resp.aiter_raw()
        try:
            # A 200 waits for its first chunk before answering: until then the request can still move.
            content = await resp.aread() if resp.status_code != 200 else await anext(chunks, b"")
        except httpx.TransportError as e:
            await resp.aclose()
            raise _Retry("connection", describe(e)) from None
        except BaseException:
            await resp.aclose()
            raise
        if resp.status_code != 200:  # an error before any stream: a plain JSON reply
            await resp.aclose()
            if resp.status_code >= 500:
                raise _Retry(f"status_{resp.status_code}", f"answered {resp.status_code}: {content[:300]!r}")
            self._started(replica, lease, False, resp.status_code, req, decision)
            lease.release()
            return Response(content, status_code=resp.status_code, headers=_reply_headers(resp, replica.url))
        self._started(replica, lease, True, resp.status_code, req, decision)

        async def close() -> None:
            lease.release()
            await resp.aclose()

        return _RelayResponse(_relay(replica.url, chunks, content), close, status_code=200,
                              headers=_reply_headers(resp, replica.url))


def _reply_headers(resp: httpx.Response, url: str) -> dict[str, str]:
    """The replica's headers that matter, and which replica answered (for clients and tests)."""
    return {**{k: v for k in _REPLY_HEADERS if (v := resp.headers.get(k)) is not None}, REPLICA_HEADER: url}


async def _relay(url: str, chunks: AsyncIterator[bytes], first: bytes) -> AsyncIterator[bytes]:
    """The replica's SSE bytes, passed on as events complete. Holding back a partial event
    means a replica that dies mid-event leaves no half line before the router's error event."""
    buf = first
    try:
        while True:
            cut = buf.rfind(b"\n\n")
            if cut >= 0:
                yield buf[:cut + 2]
                buf = buf[cut + 2:]
            chunk = await anext(chunks, None)
            if chunk is None:
                break
            buf += chunk
        if buf:
            yield buf
    except httpx.TransportError as e:
        logger.warning("router: stream from %s broke off: %s", url, e)
        err = error_body(500, f"the replica {url} failed during the stream: {describe(e)}",
                         "internal_server_error")
        yield f"data: {json.dumps(err)}\n\ndata: [DONE]\n\n".encode()
