"""Fake prefill/decode engines for the P/D router tests (test_router_pd.py): just what the router
calls of a `kvserve serve --kv-role ...`, following the KV-transfer contract, recording every
request they get. No model: each runs in a thread of the test process."""

from __future__ import annotations

import itertools
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_transfer_ids = itertools.count()


def error(status: int, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": status}}


class FakeEngine:
    """An engine with a --kv-role (None: a plain replica, which refuses kv_transfer_params).

    A prefill request (`kv_transfer_params.do_remote_decode`) is answered with fresh
    kv_transfer_params; any other request is answered as a decode would, with choices whose
    text says "remote" when it came with a prefill engine's params and "local" otherwise.
    `mode` breaks the replies: "500", "400", "reset" (close without a reply), "slow" (answer
    after `delay` seconds), "no_params" / "empty_params" (a prefill reply without usable params).
    """

    def __init__(self, role: str | None, cached_tokens: int = 0) -> None:
        self.role, self.cached_tokens = role, cached_tokens
        self.mode, self.delay, self.health = "ok", 0.0, 200
        self.posts: list[tuple[str, dict[str, Any]]] = []  # (path, body) of each POST
        self.raw: list[bytes] = []  # their bodies as they came
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.server.daemon_threads = True
        self.server.handle_error = lambda *_: None  # a client that gave up on a slow reply: no traceback
        self.server.fake = self  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def reset(self) -> None:
        self.mode, self.delay, self.health = "ok", 0.0, 200
        self.posts.clear()
        self.raw.clear()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def reply(self, body: dict[str, Any]) -> tuple[int, Any, bool]:
        """(status, JSON or SSE text, is a stream) for a POSTed body."""
        params = body.get("kv_transfer_params")
        if params is not None and self.role is None:
            return 400, error(400, "kv_transfer_params needs an engine started with --kv-role"), False
        if params is not None and params.get("do_remote_decode"):
            if self.role not in ("prefill", "both") or body.get("n", 1) != 1:
                return 400, error(400, f"do_remote_decode on a {self.role} engine, n={body.get('n')}"), False
            return 200, self._prefill_reply(body), False
        if params is not None and not params.get("do_remote_prefill"):
            return 400, error(400, f"kv_transfer_params without do_remote_prefill: {params}"), False
        tag = "remote" if params else "local"
        n = body.get("n", 1)
        if body.get("stream"):
            events = [{"id": "cmpl-fake", "choices": [{"index": i, "text": tag}]} for i in range(n)]
            return 200, "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n", True
        return 200, {"id": "cmpl-fake", "object": "text_completion", "served_by": self.url,
                     "choices": [{"index": i, "text": tag, "finish_reason": "length"} for i in range(n)],
                     "usage": {"prompt_tokens": _prompt_len(body), "completion_tokens": n,
                               "prompt_tokens_details": {"cached_tokens": 0}}}, False

    def _prefill_reply(self, body: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": "cmpl-prefill", "object": "text_completion", "choices": [{"index": 0, "text": "x"}],
            "usage": {"prompt_tokens": _prompt_len(body), "completion_tokens": 1,
                      "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}}
        if self.mode != "no_params":
            out["kv_transfer_params"] = {} if self.mode == "empty_params" else {
                "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.url,
                "remote_host": "127.0.0.1", "remote_port": 14579,
                "remote_request_id": f"xfer-{next(_transfer_ids)}", "remote_num_blocks": 2}
        return out


def _prompt_len(body: dict[str, Any]) -> int:
    prompt = body.get("prompt")
    return len(prompt) if isinstance(prompt, list) else 7


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, status: int, payload: Any, stream: bool = False) -> None:
        body = payload.encode() if stream else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "text/event-stream" if stream else "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        fake: FakeEngine = self.server.fake  # type: ignore[attr-defined]
        if self.path == "/health":
            self._send(fake.health, {"status": "ok"})
        elif self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": "fake", "object": "model"}]})
        else:  # no /kv_events: it publishes none
            self._send(404, error(404, "not found"))

    def do_POST(self) -> None:
        fake: FakeEngine = self.server.fake  # type: ignore[attr-defined]
        raw = self.rfile.read(int(self.headers.get("content-length", 0)))
        body = json.loads(raw)
        fake.posts.append((self.path, body))
        fake.raw.append(raw)
        if fake.mode == "reset":
            self.close_connection = True
            return
        if fake.mode in ("500", "400"):
            self._send(int(fake.mode), error(int(fake.mode), "fake failure"))
            return
        if fake.mode == "slow":
            time.sleep(fake.delay)
        self._send(*fake.reply(body))
