"""Moving a finished prompt's K/V from a prefill engine to a decode engine.

The decode side pulls. The prefill engine runs a `KVSender`: a ZeroMQ ROUTER socket on its
kv_ip:kv_port, served by one thread, holding each finished prompt's blocks (copied out of the
KV cache, so the cache's blocks are free again at once) under a transfer id, for at most
`lease_s`: a decode engine that never comes (it died, the router gave up) costs memory for
that long, never blocks. A decode engine calls `fetch` with the id the prefill engine's
response named; the answer is all of the transfer's blocks or an error, never a part.

Two ways for the bytes, one protocol:
- zmq: the blocks travel in the reply, over TCP;
- shm: the sender copies them into a file in /dev/shm (shared memory on Linux) and replies with
  its name; the fetcher copies them out and says so (`release`), and the file is removed. For
  engines on one host; `auto` picks it when the prefill engine's address is this host (and
  /dev/shm exists).

Every fetch carries a handshake: model fingerprint, block size, KV dtype and block layout of
the decode engine. A sender whose own differ refuses, naming what differs.

    fetch  -> {"op": "fetch", "id", "handshake", "shm": bool}
    reply  <- {"ok": true, "hashes", "shape", "dtype", "shm": name | None} [+ data frame]
              {"ok": false, "error": message}
    release -> {"op": "release", "shm": name}   (after an shm reply; no answer)
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import torch
import zmq

logger = logging.getLogger(__name__)

POLL_MS = 5  # how often the sender thread looks for new blocks and expired leases
PROBE_S = 0.5  # how often a waiting fetch checks that the prefill engine still listens
SHM_DIR = Path("/dev/shm")


class KVTransferError(RuntimeError):
    """K/V could not be fetched: refused, unknown transfer, timeout, or the peer is gone."""


def _pack(obj: dict[str, Any]) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _unpack(buf: bytes) -> dict[str, Any]:
    return msgpack.unpackb(buf, raw=False)


def handshake_mismatch(mine: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    """What differs between two engines' handshakes, in words, or None if they may exchange K/V."""
    diffs = [f"{k} {theirs.get(k)!r} there, {mine.get(k)!r} here"
             for k in ("model", "block_size", "kv_dtype", "block_shape") if theirs.get(k) != mine.get(k)]
    if not diffs and theirs.get("fingerprint") != mine.get("fingerprint"):
        diffs = ["model fingerprint (weights, their dtype or quantization, or fp8 KV scales) differs"]
    return "; ".join(diffs) or None


@dataclass
class _Entry:
    hashes: list[bytes]
    data: torch.Tensor | None  # [n, *block_shape] on the CPU; None until the blocks are copied out
    deadline: float


class KVSender:
    """The prefill side: serves each transfer's blocks to the one decode engine that fetches them."""

    def __init__(self, host: str, port: int, handshake: dict[str, Any], lease_s: float) -> None:
        self.handshake = handshake
        self.lease_s = lease_s
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.host, self.port = host, port
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._waiters: dict[str, list[tuple[bytes, bool]]] = {}  # fetches that came before the blocks
        self._segments: dict[str, float] = {}  # shm file -> when it is removed unless released first
        self.bytes_sent = 0
        self.transfers_sent = 0
        self.transfers_expired = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvserve-kv-sender", daemon=True)
        self._thread.start()

    # ---- the engine thread ------------------------------------------------------

    def expect(self, hashes: list[bytes]) -> str:
        """A new transfer whose blocks come soon (`put`); returns its id. A fetch that arrives
        before them waits for them."""
        tid = uuid.uuid4().hex
        with self._lock:
            self._entries[tid] = _Entry(hashes, None, time.monotonic() + self.lease_s)
        return tid

    def put(self, tid: str, data: torch.Tensor) -> None:
        """The transfer's blocks, [n, *block_shape] (copied to the CPU here when elsewhere)."""
        data = data.cpu().contiguous()
        with self._lock:
            entry = self._entries.get(tid)
            if entry is not None:
                entry.data = data
                entry.deadline = time.monotonic() + self.lease_s

    def drop(self, tid: str) -> None:
        with self._lock:
            self._entries.pop(tid, None)

    @property
    def num_pending(self) -> int:
        with self._lock:
            return len(self._entries)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close()
        self._ctx.term()
        for name in self._segments:
            _remove(name)
        self._segments.clear()

    # ---- the sender thread --------------------------------------------------------

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                if poller.poll(POLL_MS):
                    self._handle(self._sock.recv_multipart())
                self._answer_waiters()
                self._expire()
            except Exception:  # a bad message must not stop the sender
                logger.exception("KV sender: request failed")

    def _handle(self, frames: list[bytes]) -> None:
        ident, msg = frames[0], _unpack(frames[-1])
        op = msg.get("op")
        if op == "release":
            name = str(msg.get("shm"))
            if self._segments.pop(name, None) is not None:
                _remove(name)
            return
        if op != "fetch":
            self._reply(ident, {"ok": False, "error": f"unknown op {op!r}"})
            return
        problem = handshake_mismatch(self.handshake, msg.get("handshake") or {})
        if problem is not None:
            self._reply(ident, {"ok": False, "error": f"handshake refused: {problem}"})
            return
        tid = str(msg.get("id"))
        with self._lock:
            known = tid in self._entries
        if not known:
            self._reply(ident, {"ok": False, "error": f"unknown transfer {tid!r}: never made here, already "
                                                      f"fetched, or its lease ({self.lease_s:g} s) ran out"})
            return
        self._waiters.setdefault(tid, []).append((ident, bool(msg.get("shm"))))

    def _answer_waiters(self) -> None:
        for tid in list(self._waiters):
            with self._lock:
                entry = self._entries.get(tid)
                if entry is not None and entry.data is None:
                    continue  # its blocks are not copied out yet
                self._entries.pop(tid, None)  # one fetch takes it
            waiters = self._waiters.pop(tid)
            if entry is None:
                for ident, _ in waiters:
                    self._reply(ident, {"ok": False, "error": f"transfer {tid!r} expired before its blocks "
                                                              f"were ready"})
                continue
            (ident, use_shm), rest = waiters[0], waiters[1:]
            self._send_blocks(ident, entry, use_shm)
            for other, _ in rest:
                self._reply(other, {"ok": False, "error": f"transfer {tid!r} was fetched by another engine"})

    def _send_blocks(self, ident: bytes, entry: _Entry, use_shm: bool) -> None:
        data = entry.data
        assert data is not None
        raw = data.view(torch.uint8).numpy().reshape(-1) if data.numel() else b""
        head = {"ok": True, "hashes": entry.hashes, "shape": list(data.shape),
                "dtype": str(data.dtype).removeprefix("torch."), "shm": None}
        nbytes = data.numel() * data.element_size()
        # counted before the send: the fetcher may act on the reply before this thread runs again
        self.bytes_sent += nbytes
        self.transfers_sent += 1
        if use_shm and nbytes:
            name = f"kvserve-kv-{uuid.uuid4().hex}"
            with open(SHM_DIR / name, "wb") as f:
                f.write(raw)
            self._segments[name] = time.monotonic() + self.lease_s
            head["shm"] = name
            self._sock.send_multipart([ident, b"", _pack(head)])
        else:
            self._sock.send_multipart([ident, b"", _pack(head), raw], copy=False)

    def _reply(self, ident: bytes, msg: dict[str, Any]) -> None:
        self._sock.send_multipart([ident, b"", _pack(msg)])

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            gone = [tid for tid, e in self._entries.items() if e.deadline < now]
            for tid in gone:
                del self._entries[tid]
        if gone:
            self.transfers_expired += len(gone)
            logger.warning("KV sender: %d transfer(s) never fetched within the %g s lease; dropped",
                           len(gone), self.lease_s)
        for name in [n for n, deadline in self._segments.items() if deadline < now]:
            del self._segments[name]
            _remove(name)


def _remove(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        (SHM_DIR / name).unlink()


def is_local_host(host: str) -> bool:
    """Whether `host` is this machine (loopback, or one of this host's own addresses)."""
    try:
        addr = socket.gethostbyname(host)
    except OSError:
        return False
    if addr.startswith("127."):
        return True
    with contextlib.suppress(OSError):
        return addr in socket.gethostbyname_ex(socket.gethostname())[2]
    return False


def _listening(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=PROBE_S).close()
        return True
    except OSError:
        return False


def fetch(host: str, port: int, tid: str, handshake: dict[str, Any], timeout: float,
          transport: str = "auto") -> tuple[list[bytes], torch.Tensor]:
    """Pull transfer `tid` from the KVSender at host:port: (block hashes, [n, *block_shape]
    tensor). Raises KVTransferError; never returns part of a transfer."""
    use_shm = SHM_DIR.is_dir() and (transport == "shm" or (transport == "auto" and is_local_host(host)))
    if not _listening(host, port):
        raise KVTransferError(f"the prefill engine's KV sender at {host}:{port} is not reachable")
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{host}:{port}")
        sock.send_multipart([b"", _pack({"op": "fetch", "id": tid, "handshake": handshake, "shm": use_shm})])
        deadline = time.monotonic() + timeout
        while not sock.poll(int(PROBE_S * 1000)):
            if time.monotonic() > deadline:
                raise KVTransferError(f"no K/V from the prefill engine at {host}:{port} within {timeout:g} s")
            if not _listening(host, port):
                raise KVTransferError(f"the prefill engine at {host}:{port} went away during the transfer")
        frames = sock.recv_multipart(copy=False)
        head = _unpack(frames[1].bytes)
        if not head.get("ok"):
            raise KVTransferError(f"the prefill engine at {host}:{port} refused: {head.get('error')}")
        dtype = getattr(torch, head["dtype"])
        shape = tuple(head["shape"])
        if head["shm"] is not None:
            data = _read_segment(head["shm"], shape, dtype)
            sock.send_multipart([b"", _pack({"op": "release", "shm": head["shm"]})])
        elif len(frames) > 2 and len(frames[2].buffer):
            data = torch.frombuffer(bytearray(frames[2].buffer), dtype=torch.uint8).view(dtype).view(shape)
        else:
            data = torch.empty(shape, dtype=dtype)
        return [bytes(h) for h in head["hashes"]], data
    finally:
        sock.close()


def _read_segment(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The blocks, mapped from the sender's file (private, copy-on-write): no copy here; the
    pages stay ours after the sender removes the file, until the tensor is gone."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    with open(SHM_DIR / Path(name).name, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    if len(mapped) < nbytes:
        raise KVTransferError(f"shared-memory transfer {name} is shorter than its blocks")
    return torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)
