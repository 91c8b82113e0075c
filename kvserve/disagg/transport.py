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

Nothing that arrives is trusted (auth.py). Every message is sealed with the deployment's key
(a nonce, the time, an HMAC-SHA256 frame) and refused unsealed, stale or replayed; a reply names
the request it answers. The fetcher takes only blocks of its own block shape and KV dtype, no
more than the transfer promised, whose bytes (the data frame, or the shm file, which any local
process might have touched) match the SHA-256 digest the sender signed; a missing or short data
frame is an error. The block hashes a reply names are checked by the caller against its own.

    fetch   -> {"op": "fetch", "id", "handshake", "shm": bool}
    reply   <- {"ok": true, "re": nonce, "hashes", "shape", "dtype", "digest", "shm": name | None}
               [+ data frame]
               {"ok": false, "re": nonce | None, "error": message}
    release -> {"op": "release", "shm": name}   (after an shm reply; no answer)

each as [body (msgpack, with "nonce" and "ts"), MAC] frames after ZeroMQ's envelope.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import mmap
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import zmq

from kvserve.disagg.auth import AuthError, TransferAuth

logger = logging.getLogger(__name__)

POLL_MS = 5  # how often the sender thread looks for new blocks and expired leases
PROBE_S = 0.5  # how often a waiting fetch checks that the prefill engine still listens
UNKNOWN_GRACE_S = 2.0  # how long a fetch of a transfer id not registered (yet) waits before it is refused
SHM_DIR = Path("/dev/shm")
MAX_REQUEST_BYTES = 1 << 20  # a fetch or release message (a handshake, an id): anything larger is no peer's


class KVTransferError(RuntimeError):
    """K/V could not be fetched: refused, unknown transfer, timeout, the peer is gone, or what
    came back failed a check."""


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
    """The prefill side: serves each transfer's blocks to the one decode engine that fetches them.

    Threads: the output rank's step thread (disagg/worker.py) adds transfers (`expect`, `put`)
    under the lock; one sender thread owns the socket, the waiting fetches and the shm files."""

    def __init__(self, host: str, port: int, handshake: dict[str, Any], lease_s: float,
                 auth: TransferAuth) -> None:
        self.handshake = handshake
        self.lease_s = lease_s
        self.auth = auth
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        if port:
            self._sock.bind(f"tcp://{host}:{port}")
        else:
            port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.host, self.port = host, port
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._waiters: dict[str, list[tuple[bytes, bytes, bool]]] = {}  # fetches that came before the blocks
        self._segments: dict[str, float] = {}  # shm file -> when it is removed unless released first
        self.bytes_sent = 0
        self.transfers_sent = 0
        self.transfers_expired = 0
        self.messages_refused = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvserve-kv-sender", daemon=True)
        self._thread.start()

    # ---- the engine thread ------------------------------------------------------

    def expect(self, hashes: list[bytes], tid: str | None = None) -> str:
        """A new transfer whose blocks come soon (`put`), under `tid` (a new id when None);
        returns its id. A fetch that arrives before them waits for them."""
        tid = tid or uuid.uuid4().hex
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
        ident = frames[0]
        try:
            msg = self.auth.open(frames[2:] if len(frames) > 2 and frames[1] == b"" else [])
        except AuthError as e:
            self.messages_refused += 1
            logger.warning("KV sender: refused a message: %s", e)
            self._reply(ident, None, {"ok": False, "error": f"refused: {e}"})
            return
        op, nonce = msg.get("op"), msg["nonce"]
        if op == "release":
            name = str(msg.get("shm"))
            if self._segments.pop(name, None) is not None:
                _remove(name)
            return
        if op != "fetch":
            self._reply(ident, nonce, {"ok": False, "error": f"unknown op {op!r}"})
            return
        problem = handshake_mismatch(self.handshake, msg.get("handshake") or {})
        if problem is not None:
            self._reply(ident, nonce, {"ok": False, "error": f"handshake refused: {problem}"})
            return
        tid = str(msg.get("id"))
        # An id not known yet waits a little: the engine names a transfer in its response one step
        # before its ranks register it here (disagg/worker.py).
        self._waiters.setdefault(tid, []).append((ident, nonce, bool(msg.get("shm")), time.monotonic()))

    def _answer_waiters(self) -> None:
        now = time.monotonic()
        for tid in list(self._waiters):
            with self._lock:
                entry = self._entries.get(tid)
                if entry is not None and entry.data is None:
                    continue  # its blocks are not copied out yet
                if entry is None and now - self._waiters[tid][0][3] < UNKNOWN_GRACE_S:
                    continue  # not registered yet, perhaps
                self._entries.pop(tid, None)  # one fetch takes it
            waiters = self._waiters.pop(tid)
            if entry is None:
                for ident, nonce, _, _ in waiters:
                    self._reply(ident, nonce, {"ok": False, "error": f"unknown transfer {tid!r}: never made here, "
                                                                     f"already fetched, or its lease "
                                                                     f"({self.lease_s:g} s) ran out"})
                continue
            (ident, nonce, use_shm, _), rest = waiters[0], waiters[1:]
            self._send_blocks(ident, nonce, entry, use_shm)
            for other, other_nonce, _, _ in rest:
                self._reply(other, other_nonce, {"ok": False, "error": f"transfer {tid!r} was fetched by another "
                                                                       f"engine"})

    def _send_blocks(self, ident: bytes, nonce: bytes, entry: _Entry, use_shm: bool) -> None:
        data = entry.data
        assert data is not None
        raw = data.view(torch.uint8).numpy().reshape(-1) if data.numel() else b""
        head = {"ok": True, "re": nonce, "hashes": entry.hashes, "shape": list(data.shape),
                "dtype": str(data.dtype).removeprefix("torch."), "digest": hashlib.sha256(raw).digest(), "shm": None}
        nbytes = data.numel() * data.element_size()
        # counted before the send: the fetcher may act on the reply before this thread runs again
        self.bytes_sent += nbytes
        self.transfers_sent += 1
        if use_shm and nbytes:
            name = f"kvserve-kv-{uuid.uuid4().hex}"
            # this user's only: another local user's process must not read or rewrite the K/V
            fd = os.open(SHM_DIR / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with open(fd, "wb") as f:
                f.write(raw)
            self._segments[name] = time.monotonic() + self.lease_s
            head["shm"] = name
            self._sock.send_multipart([ident, b"", *self.auth.seal(head)[1]])
        else:
            self._sock.send_multipart([ident, b"", *self.auth.seal(head)[1], raw], copy=False)

    def _reply(self, ident: bytes, nonce: bytes | None, msg: dict[str, Any]) -> None:
        self._sock.send_multipart([ident, b"", *self.auth.seal(dict(msg, re=nonce))[1]])

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


def fetch(host: str, port: int, tid: str, handshake: dict[str, Any], auth: TransferAuth, timeout: float,
          max_blocks: int, transport: str = "auto") -> tuple[list[bytes], torch.Tensor]:
    """Pull transfer `tid` from the KVSender at host:port: (the block hashes it claims, a
    [n, *block_shape] tensor of this engine's block shape and KV dtype, `handshake`'s, with
    n <= max_blocks). Raises KVTransferError; never returns part of a transfer, or bytes that
    are not exactly what the sender signed."""
    use_shm = SHM_DIR.is_dir() and (transport == "shm" or (transport == "auto" and is_local_host(host)))
    block_bytes = math.prod(handshake["block_shape"]) * getattr(torch, handshake["kv_dtype"]).itemsize
    if not _listening(host, port):
        raise KVTransferError(f"the prefill engine's KV sender at {host}:{port} is not reachable")
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_blocks * block_bytes + MAX_REQUEST_BYTES)  # a flood is cut off
    try:
        sock.connect(f"tcp://{host}:{port}")
        nonce, sealed = auth.seal({"op": "fetch", "id": tid, "handshake": handshake, "shm": use_shm})
        sock.send_multipart([b"", *sealed])
        deadline = time.monotonic() + timeout
        while not sock.poll(int(PROBE_S * 1000)):
            if time.monotonic() > deadline:
                raise KVTransferError(f"no K/V from the prefill engine at {host}:{port} within {timeout:g} s")
            if not _listening(host, port):
                raise KVTransferError(f"the prefill engine at {host}:{port} went away during the transfer")
        frames = sock.recv_multipart(copy=False)
        try:
            head = auth.open([f.bytes for f in frames[1:3]])
        except AuthError as e:
            raise KVTransferError(f"the reply from {host}:{port} failed authentication: {e}") from None
        if not head.get("ok"):
            raise KVTransferError(f"the prefill engine at {host}:{port} refused: {head.get('error')}")
        if head.get("re") != nonce:
            raise KVTransferError(f"the reply from {host}:{port} answers another request")
        if head.get("shm") is not None:
            name = str(head["shm"])
            try:
                raw = _read_segment(name)
            finally:
                sock.send_multipart([b"", *auth.seal({"op": "release", "shm": name})[1]])
        elif len(frames) == 4:
            raw = memoryview(frames[3].buffer)
        else:
            raise KVTransferError(f"the reply from {host}:{port} has {len(frames) - 3} data frames, not one")
        return _checked_blocks(head, raw, handshake, block_bytes, max_blocks)
    finally:
        sock.close()


def _checked_blocks(head: dict[str, Any], raw: Any, handshake: dict[str, Any], block_bytes: int,
                    max_blocks: int) -> tuple[list[bytes], torch.Tensor]:
    """The reply's hashes and blocks, once they are this engine's shape, dtype and size and the
    bytes match the signed digest: nothing that fails here can reach the KV cache."""
    hashes = head.get("hashes")
    if not isinstance(hashes, list) or not all(isinstance(h, bytes) for h in hashes):
        raise KVTransferError("the reply's hashes are not a list of block hashes")
    if len(hashes) > max_blocks:
        raise KVTransferError(f"the reply has {len(hashes)} blocks; the transfer promised {max_blocks}")
    want = [len(hashes), *handshake["block_shape"]]
    if head.get("shape") != want or head.get("dtype") != handshake["kv_dtype"]:
        raise KVTransferError(f"the reply's blocks are {head.get('dtype')} {head.get('shape')}; this engine's KV "
                              f"cache takes {handshake['kv_dtype']} {want}")
    if len(raw) != len(hashes) * block_bytes:
        raise KVTransferError(f"the reply's data is {len(raw)} bytes; {len(hashes)} blocks are "
                              f"{len(hashes) * block_bytes}")
    buf = bytearray(raw)  # copied before the digest: an shm file could change under its mapping
    if not isinstance(head.get("digest"), bytes) or hashlib.sha256(buf).digest() != head["digest"]:
        raise KVTransferError("the reply's data does not match the digest its sender signed")
    data = torch.frombuffer(buf, dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)
    return [bytes(h) for h in hashes], data.view(getattr(torch, handshake["kv_dtype"])).view(want)


def _read_segment(name: str) -> memoryview:
    """The sender's file's bytes, mapped (private, copy-on-write)."""
    try:
        with open(SHM_DIR / Path(name).name, "rb") as f:
            return memoryview(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY))
    except (OSError, ValueError) as e:
        raise KVTransferError(f"shared-memory transfer {name}: {e}") from None
