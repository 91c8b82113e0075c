"""A throwaway redis-server on loopback for the remote-tier tests (Debian's redis-server;
`make test` and .ci/run install it). Missing binary: skipped locally, a failure under CI."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from tests.serving import free_port


class RedisServer:
    """A redis-server that tests can kill and restart on the same port."""

    def __init__(self, binary: str, workdir: Path) -> None:
        self.binary, self.workdir, self.port = binary, workdir, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        import redis

        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru", "--dir", str(self.workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_timeout=0.5, socket_connect_timeout=0.5)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                return
            except redis.exceptions.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {self.port} did not come up") from None
                time.sleep(0.02)
            finally:
                client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture
def redis_server(tmp_path: Path):
    pytest.importorskip("redis")
    binary = shutil.which("redis-server")
    if binary is None:
        message = ("redis-server not found; install it to run the remote-tier tests "
                   "(Debian/Ubuntu: apt-get install -y redis-server, macOS: brew install redis)")
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    server = RedisServer(binary, tmp_path)
    server.start()
    yield server
    server.stop()
