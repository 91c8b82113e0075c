"""Start a real `kvserve serve` process for tests, and raw HTTP without a client library."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

MODEL = "tiny"  # --served-model-name of the test servers
PROMPT = "The quick brown fox jumps over the lazy dog."
LONG_PROMPT = " ".join(["Paged attention stores keys and values in fixed-size blocks."] * 4)
TINY_SERVER_ARGS = ["--dtype", "float32", "--num-kv-blocks", "256", "--served-model-name", MODEL]


def http_request(method: str, url: str, body: bytes | dict | None = None, headers: dict[str, str] | None = None,
         timeout: float = 30) -> tuple[int, bytes, dict[str, str]]:
    """(status, body, headers with lower-case names); HTTP errors are returned, not raised."""
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    req = urllib.request.Request(url, data=body, method=method,
                                 headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read(), {k.lower(): v for k, v in r.headers.items()}
    except urllib.error.HTTPError as e:
        return e.code, e.read(), {k.lower(): v for k, v in e.headers.items()}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError):
                stat = (d / "stat").read_text()
                if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
    return out


def engine_pid(server_pid: int) -> int:
    """The engine process: the server's child running multiprocessing's spawn_main (not its resource tracker)."""
    for pid in child_pids(server_pid):
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        if b"spawn_main" in cmd:
            return pid
    raise AssertionError(f"no engine process among the children of {server_pid}")


def is_alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@dataclass
class Server:
    base: str
    proc: subprocess.Popen
    log: Path

    @property
    def v1(self) -> str:
        return f"{self.base}/v1"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@contextlib.contextmanager
def running_server(args: list[str], log: Path, timeout: float = 180, new_session: bool = False) -> Iterator[Server]:
    """`kvserve serve ARGS --port P` until healthy; terminated (then killed) on exit. With
    new_session the server leads a process group of its own (for `os.killpg`)."""
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log, "w" if not log.exists() else "a") as f:
        proc = subprocess.Popen([sys.executable, "-m", "kvserve.cli", "serve", *args, "--port", str(port)],
                                stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=new_session)
    srv = Server(f"http://127.0.0.1:{port}", proc, log)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{srv.log_text()}")
            with contextlib.suppress(OSError):
                if http_request("GET", f"{srv.base}/health", timeout=5)[0] == 200:
                    break
            if time.monotonic() > deadline:
                pytest.fail(f"server not healthy after {timeout} s:\n{srv.log_text()}")
            time.sleep(0.25)
        yield srv
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def open_stream(base: str, path: str, body: dict, headers: dict[str, str] | None = None,
                timeout: float = 60) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """POST and return as soon as the status line is in; read events with `sse_events`."""
    host, port = base.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    conn.request("POST", path, body=json.dumps(body), headers={"content-type": "application/json",
                                                                **(headers or {})})
    return conn, conn.getresponse()


def sse_events(resp: http.client.HTTPResponse) -> Iterator[dict | str]:
    """The decoded `data:` payloads of an SSE response; "[DONE]" as the string."""
    for raw in resp:
        line = raw.decode().strip()
        if line.startswith("data: "):
            data = line.removeprefix("data: ")
            yield data if data == "[DONE]" else json.loads(data)


def metric_values(base: str) -> dict[str, float]:
    """Every sample of /metrics as {'name{label="v"}': value}."""
    from prometheus_client.parser import text_string_to_metric_families

    status, body, _ = http_request("GET", f"{base}/metrics")
    assert status == 200, body
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def trickle_post(base: str, path: str, body: bytes, headers: dict[str, str] | None = None,
                 pause: float = 0.25) -> tuple[float, bytes, bytes]:
    """POST `body` one byte per `pause` seconds until the server answers: (seconds from the end of
    the headers to the answer, the answer's status line and headers, its body)."""
    host, port = base.removeprefix("http://").split(":")
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\n{extra}Content-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode())
        t0, got = time.monotonic(), b""
        sock.settimeout(pause)
        for byte in body:
            try:
                sock.send(bytes([byte]))
                got += sock.recv(65536)
                break
            except TimeoutError:
                continue
            except OSError:
                break
        took = time.monotonic() - t0
        sock.settimeout(10)
        try:
            while chunk := sock.recv(65536):
                got += chunk
        except ConnectionResetError:
            pass  # the server closed with bytes of ours unread: its kernel resets, after its answer
    head, _, raw = got.partition(b"\r\n\r\n")
    return took, head, raw
