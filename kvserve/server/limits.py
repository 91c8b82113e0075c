"""What the server and the router refuse before it costs anything: requests without the API key
(401, checked before the body is read), request bodies over --max-request-bytes (413, read no
further), connections that never finish sending their headers (--header-timeout: closed, so
idle sockets cannot pile up file descriptors) or their body (--body-timeout: 408, then closed).

The prompt's own bound (characters that cannot fit in max-model-len tokens) is checked where
prompts are built, in server/prompts.py (check_prompt_text; prompt_texts finds that text in a raw
request body, for the router, which checks before tokenizing).
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
from collections.abc import Collection
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_MAX_REQUEST_BYTES = 16 * 1024**2
DEFAULT_HEADER_TIMEOUT_S = 30.0
DEFAULT_BODY_TIMEOUT_S = 60.0


def add_http_limit_args(p: Any, prompts_bound_by: str) -> None:
    """The flags above, for `kvserve serve` and `kvserve router` alike (`p`: a parser or group)."""
    p.add_argument("--max-request-bytes", type=_size, default=DEFAULT_MAX_REQUEST_BYTES, metavar="SIZE",
                   help="larger request bodies get 413 before they are read (default 16MiB); prompts longer "
                        f"than {prompts_bound_by} can be are refused before they are tokenized")
    p.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S, metavar="SECONDS",
                   help="close a connection whose request headers are not complete this long after it opened "
                        f"or after its last response (default {DEFAULT_HEADER_TIMEOUT_S:g})")
    p.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S, metavar="SECONDS",
                   help="answer 408 and close a connection whose request body is not complete this long after "
                        f"its headers (default {DEFAULT_BODY_TIMEOUT_S:g})")


def _size(value: str) -> int:
    from kvserve.config import parse_size

    try:
        return parse_size(value, "--max-request-bytes")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def check_http_limit_args(args: argparse.Namespace, key_flags: Collection[str] = ("--api-key",)) -> None:
    """ValueError naming the flag: a timeout that is not positive, or a key (each of `key_flags`)
    that cannot travel in an Authorization header (an empty one would let `Bearer ` through)."""
    for flag, value in (("--header-timeout", args.header_timeout), ("--body-timeout", args.body_timeout)):
        if not value > 0:
            raise ValueError(f"{flag} must be > 0 seconds, got {value}")
    for flag in key_flags:
        key = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if key is not None and (not key or not key.isascii() or not key.isprintable() or " " in key):
            raise ValueError(f"{flag} must be a non-empty printable ASCII key without spaces (it travels in an "
                             "Authorization header)")


def error_json(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None) -> bytes:
    """An error body in the OpenAI shape the server's other errors have."""
    return json.dumps({"error": {"message": message, "type": type_, "param": param, "code": status}}).encode()


async def send_error(send: Any, status: int, body: bytes, headers: Collection[tuple[bytes, bytes]] = ()) -> None:
    """Answer with `body` (error_json) and close the connection: what is left of the request's
    body is never read."""
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


def bearer_token_ok(authorization: bytes | None, key: str) -> bool:
    """Whether an Authorization header carries `key` as a Bearer token. The scheme matches in any
    case (RFC 7235); the key is compared in constant time, so its bytes cannot be guessed from
    how long a refusal takes."""
    scheme, _, token = (authorization or b"").strip().partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key.encode())


class APIKeyCheck:
    """ASGI middleware: every HTTP request but those to `open_paths` must carry
    `Authorization: Bearer KEY`, or gets 401 in the OpenAI error shape. Put it outermost: it
    answers from the headers alone, before any body is read or any other work is done."""

    def __init__(self, app: Any, key: str, open_paths: Collection[str] = ()) -> None:
        self.app, self.key, self.open_paths = app, key, frozenset(open_paths)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            return await self.app(scope, receive, send)
        if not bearer_token_ok(dict(scope["headers"]).get(b"authorization"), self.key):
            return await send_error(send, 401, error_json(401, "invalid or missing API key (send the header "
                                                               "'Authorization: Bearer KEY')", "authentication_error"),
                                    [(b"www-authenticate", b"Bearer")])
        return await self.app(scope, receive, send)


class BodyLimit:
    """ASGI middleware: a request body over `max_bytes` gets 413 in the OpenAI error shape.

    A declared Content-Length over the limit is refused before any of the body is read; a
    chunked body is read up to the limit and refused at the first byte past it."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                declared = 0  # h11 has already refused a malformed length
            if declared > self.max_bytes:
                return await self._refuse(send, f"is {declared} bytes")
            return await self.app(scope, receive, send)
        if dict(scope["headers"]).get(b"transfer-encoding", b"").lower() != b"chunked":
            return await self.app(scope, receive, send)
        messages, size = [], 0
        while True:
            msg = await receive()
            messages.append(msg)
            if msg["type"] != "http.request":
                break
            size += len(msg.get("body", b""))
            if size > self.max_bytes:
                return await self._refuse(send, "is larger")
            if not msg.get("more_body", False):
                break
        replay = iter(messages)

        async def receive_again() -> dict:
            return next(replay, None) or await receive()

        return await self.app(scope, receive_again, send)

    async def _refuse(self, send: Any, what: str) -> None:
        message = f"the request body {what} than the server accepts: {self.max_bytes} bytes (--max-request-bytes)"
        await send_error(send, 413, error_json(413, message))


def h11_with_header_timeout(timeout: float, body_timeout: float | None = DEFAULT_BODY_TIMEOUT_S) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request headers are not complete
    `timeout` seconds after it opened or after its previous response (uvicorn itself only
    times out a keep-alive connection that sends nothing at all), and answering 408 and closing
    one whose request body is not complete `body_timeout` seconds after its headers (None: no
    limit), so a body trickled a byte at a time cannot hold a request open forever."""

    class Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _waiting_after: Any = None  # the request cycle that was current when the timer was armed
        _body_timer: asyncio.TimerHandle | None = None
        _body_of: Any = None  # the request cycle whose body the body timer waits for

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._header_timer is not None and self.cycle is not self._waiting_after:
                self._disarm()  # a new request's headers are in
            self._watch_body()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()
            self._watch_body()  # a pipelined request may have started

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            self._stop_body_timer()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            if not self.transport.is_closing():
                self._waiting_after = self.cycle
                self._header_timer = self.loop.call_later(timeout, self._expire)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _expire(self) -> None:
            self._header_timer = None
            if self.cycle is self._waiting_after and not self.transport.is_closing():
                self.transport.close()

        def _watch_body(self) -> None:
            """Time the current request's body from its headers until its end."""
            cycle = self.cycle
            if cycle is None or not cycle.more_body or body_timeout is None:
                self._stop_body_timer()
            elif cycle is not self._body_of:
                self._stop_body_timer()
                self._body_of = cycle
                self._body_timer = self.loop.call_later(body_timeout, self._body_expired)

        def _stop_body_timer(self) -> None:
            if self._body_timer is not None:
                self._body_timer.cancel()
            self._body_timer = self._body_of = None

        def _body_expired(self) -> None:
            cycle, self._body_timer = self._body_of, None
            if cycle is not self.cycle or not cycle.more_body or self.transport.is_closing():
                return
            # The application sees a client that left (its receive() says http.disconnect, its
            # sends are dropped); the client gets 408 unless a response had already begun.
            cycle.disconnected = True
            cycle.message_event.set()
            if not cycle.response_started and self.conn.our_state is h11.SEND_RESPONSE:
                body = error_json(408, f"the request body was not complete {body_timeout:g} s after its headers "
                                       "(--body-timeout)")
                headers = [(b"content-type", b"application/json"), (b"connection", b"close"),
                           (b"content-length", str(len(body)).encode())]
                for event in (h11.Response(status_code=408, headers=headers, reason=b"Request Timeout"),
                              h11.Data(data=body), h11.EndOfMessage()):
                    self.transport.write(self.conn.send(event))
            self.transport.close()

    return Protocol
