"""What the server refuses before it costs anything: request bodies over --max-request-bytes
(413, read no further), and connections that never finish sending their headers
(--header-timeout: closed, so idle sockets cannot pile up file descriptors).

The prompt's own bound (characters that cannot fit in max-model-len tokens) is checked where
prompts are built, in server/prompts.py.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

DEFAULT_MAX_REQUEST_BYTES = 16 * 1024**2
DEFAULT_HEADER_TIMEOUT_S = 30.0


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
        body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                     "code": 413}}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"connection", b"close"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def h11_with_header_timeout(timeout: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request headers are not complete
    `timeout` seconds after it opened or after its previous response (uvicorn itself only
    times out a keep-alive connection that sends nothing at all)."""

    class Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _waiting_after: Any = None  # the request cycle that was current when the timer was armed

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._header_timer is not None and self.cycle is not self._waiting_after:
                self._disarm()  # a new request's headers are in

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
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

    return Protocol
