"""Processes and a scripted fake replica for the router tests (tests/router/test_router.py)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from kvserve.router.launch import stop_processes
from tests.serving import free_port, http_request

REPLICA_ARGS = ["--num-kv-blocks", "64", "--max-model-len", "1024"]
REPLICA = "x-kvserve-replica"
START_TIMEOUT = 240.0
ENV = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")  # three replicas share two cores


def wait_until(what: str, check: Callable[[], Any], timeout: float = 20.0, every: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(OSError):
            if out := check():
                return out
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(every)


# ---- processes --------------------------------------------------------------------------------

@dataclass
class Replica:
    """A `kvserve serve` on fixed ports, so it can be restarted where the router expects it."""

    log: Path
    port: int = field(default_factory=free_port)
    events: tuple[int, int] | None = field(default_factory=lambda: (free_port(), free_port()))  # None: off
    extra: list[str] = field(default_factory=list)  # more `kvserve serve` flags
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Replica:
        events = [] if self.events is None else [
            "--kv-events-endpoint", f"tcp://127.0.0.1:{self.events[0]}",
            "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{self.events[1]}"]
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvserve.cli", "serve", *REPLICA_ARGS, "--port", str(self.port),
                 *events, *self.extra], stdout=f, stderr=subprocess.STDOUT, env=ENV)
        return self

    def wait_healthy(self) -> None:
        def up() -> bool:
            if self.proc.poll() is not None:
                pytest.fail(f"replica exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            return http_request("GET", f"{self.url}/health", timeout=5)[0] == 200
        wait_until(f"replica {self.url} to start", up, START_TIMEOUT, 0.5)

    def stop(self) -> None:
        if self.proc is not None:
            stop_all([self.proc])


@dataclass
class Router:
    proc: subprocess.Popen
    base: str
    log: Path

    def replicas(self) -> dict[str, dict]:
        status, body, _ = http_request("GET", f"{self.base}/replicas")
        assert status == 200, body
        return {r["url"]: r for r in json.loads(body)["replicas"]}

    def stop(self) -> None:
        stop_all([self.proc])


def stop_all(procs: list[subprocess.Popen], timeout: float = 30.0) -> None:
    stop_processes(procs, timeout)


def spawn_router(args: list[str], log: Path) -> Router:
    port = free_port()
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "router", "--port", str(port), *args],
                                stdout=f, stderr=subprocess.STDOUT, env=ENV)
    return Router(proc, f"http://127.0.0.1:{port}", log)


def wait_router(r: Router, timeout: float = 120.0, headers: dict[str, str] | None = None) -> Router:
    """Until the router answers /version (`headers`: with its --api-key)."""
    def up() -> bool:
        if r.proc.poll() is not None:
            pytest.fail(f"router exited with {r.proc.returncode}:\n{r.log.read_text()}")
        return http_request("GET", f"{r.base}/version", headers=headers, timeout=5)[0] == 200
    wait_until("the router to start", up, timeout, 0.25)
    return r


def gone(pid: int) -> bool:
    """The process has exited (a zombie waiting for its reaper counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


# ---- a scripted fake replica ------------------------------------------------------------------

class FakeReplica:
    """Answers like a replica; POST replies follow `mode`: "ok", "503", "reset" (close without a
    reply) or "stream_dies" (one SSE event and half of the next, then the connection drops)."""

    def __init__(self, kv_events: dict | None = None) -> None:
        self.mode, self.health, self.kv_events = "ok", 200, kv_events
        self.posts: list[tuple[str, dict[str, str], bytes]] = []
        self.gets: list[tuple[str, dict[str, str]]] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeHandler)
        self.server.daemon_threads = True
        self.server.fake = self  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


FIRST_EVENT = {"id": "cmpl-fake", "object": "text_completion", "choices": [{"index": 0, "text": "Hi"}]}


class _FakeHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: Any) -> None:
        pass

    def _json(self, status: int, obj: Any) -> None:
        body = json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802
        fake: FakeReplica = self.server.fake  # type: ignore[attr-defined]
        fake.gets.append((self.path, {k.lower(): v for k, v in self.headers.items()}))
        if self.path == "/health":
            self._json(fake.health, {"status": "ok"})
        elif self.path == "/kv_events" and fake.kv_events is not None:
            self._json(200, fake.kv_events)
        elif self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "fake", "object": "model"}]})
        else:
            self._json(404, {"error": {"message": "not found", "type": "not_found_error", "param": None,
                                       "code": 404}})

    def do_POST(self) -> None:  # noqa: N802
        fake: FakeReplica = self.server.fake  # type: ignore[attr-defined]
        body = self.rfile.read(int(self.headers.get("content-length", 0)))
        fake.posts.append((self.path, {k.lower(): v for k, v in self.headers.items()}, body))
        if fake.mode == "ok":
            self._json(200, {"ok": True})
        elif fake.mode == "503":
            self._json(503, {"error": {"message": "fake overloaded", "type": "service_unavailable",
                                       "param": None, "code": 503}})
        elif fake.mode == "reset":
            self.close_connection = True
        elif fake.mode == "stream_dies":
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            for piece in (f"data: {json.dumps(FIRST_EVENT)}\n\n".encode(), b'data: {"half an ev'):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.flush()
            self.close_connection = True  # no last chunk: the stream breaks off
