"""KV events: which blocks a replica holds, in which tier, published for routers.

An engine started with `--kv-events-endpoint tcp://HOST:PORT` publishes every block its
prefix cache (device) and its KV tiers (cpu, disk, remote) store or remove. The wire format,
in the spirit of vLLM's KVEventsConfig (documented in the README, "KV events"):

  PUB  (endpoint)         multipart [TOPIC, seq as 8 bytes big-endian, msgpack(batch)]
       batch    = {"v": 1, "instance": str, "seq": int, "ts": float, "model_fingerprint": str,
                   "block_size": int, "hash_scheme": str, "events": [event, ...]}
       event    = {"type": "BlockStored", "block_hashes": [bytes, ...], "parent_block_hash": bytes | None,
                   "block_size": int, "medium": str}     (hashes in chain order, each the next one's parent)
                | {"type": "BlockRemoved", "block_hashes": [bytes, ...], "medium": str}
                | {"type": "AllBlocksCleared", "medium": str}
  ROUTER (replay_endpoint) a client (DEALER) sends b"SNAPSHOT" and gets one frame,
       msgpack({"v": 1, "instance", "seq", "model_fingerprint", "block_size", "hash_scheme",
                "blocks": {medium: [[hash, parent | None], ...]}})
       the state after batch `seq`: apply later batches (seq + 1, ...) on top.

An idle publisher sends a heartbeat every second: a batch with "heartbeat": true, no events
and the seq of its last batch. `instance` changes when the engine restarts (seq starts again
at 1); a subscriber that sees another instance, a gap in seq, or a heartbeat ahead of it
asks for a new snapshot. Hashes are the prefix cache's
chain hashes (`hash_scheme`): sha256 over the parent hash, the block's tokens and the
request's cache_salt, the same on every machine, so a router computes them from a prompt.

Pure Python (zmq and msgpack, no torch): the engine and the router both use it.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import msgpack
import zmq

logger = logging.getLogger(__name__)

TOPIC = b"kvserve.kv_events"
WIRE_VERSION = 1
HASH_SCHEME = "kvserve.block.v1:sha256(parent,salt,tokens)"  # prefix_cache.hash_block_tokens
SNAPSHOT_REQUEST = b"SNAPSHOT"
MEDIUMS = ("device", "cpu", "disk", "remote")  # fastest first

STORED, REMOVED, CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"


@dataclass(frozen=True, slots=True)
class KVEvent:
    kind: str  # STORED | REMOVED | CLEARED
    medium: str
    block_hash: bytes = b""
    parent_hash: bytes = b""  # b"": the first block of a chain


class KVEventSink:
    """Where the prefix cache and the tiers report block changes; thread-safe (the tiers
    report from their background writer). The engine takes the events after each step."""

    def __init__(self) -> None:
        self._events: list[KVEvent] = []
        self._lock = threading.Lock()

    def stored(self, block_hash: bytes, parent_hash: bytes, medium: str) -> None:
        with self._lock:
            self._events.append(KVEvent(STORED, medium, block_hash, parent_hash))

    def removed(self, block_hash: bytes, medium: str) -> None:
        with self._lock:
            self._events.append(KVEvent(REMOVED, medium, block_hash))

    def cleared(self, medium: str) -> None:
        with self._lock:
            self._events.append(KVEvent(CLEARED, medium))

    def take(self) -> list[KVEvent]:
        with self._lock:
            out, self._events = self._events, []
        return out


class BlockMirror:
    """Which blocks are held in which medium, rebuilt from events: the publisher keeps one to
    answer snapshots, a router keeps one per replica to score prompts."""

    def __init__(self) -> None:
        self.blocks: dict[str, dict[bytes, bytes]] = {m: {} for m in MEDIUMS}  # medium -> hash -> parent

    def apply(self, ev: KVEvent) -> None:
        held = self.blocks.setdefault(ev.medium, {})
        if ev.kind == STORED:
            held[ev.block_hash] = ev.parent_hash
        elif ev.kind == REMOVED:
            held.pop(ev.block_hash, None)
        elif ev.kind == CLEARED:
            held.clear()

    def load(self, blocks: dict[str, list[list[Any]]]) -> None:
        self.blocks = {m: {} for m in MEDIUMS}
        for medium, pairs in blocks.items():
            self.blocks[medium] = {bytes(h): bytes(p or b"") for h, p in pairs}

    def dump(self) -> dict[str, list[list[Any]]]:
        return {m: [[h, p or None] for h, p in held.items()] for m, held in self.blocks.items()}

    def match(self, hashes: list[bytes]) -> list[str]:
        """For each leading block of a prompt (its chain hashes), the fastest medium holding it;
        stops at the first block held nowhere."""
        out = []
        for h in hashes:
            medium = next((m for m in MEDIUMS if h in self.blocks.get(m, ())), None)
            if medium is None:
                break
            out.append(medium)
        return out

    def count(self, medium: str) -> int:
        return len(self.blocks.get(medium, ()))


def _event_dicts(events: list[KVEvent], block_size: int) -> list[dict[str, Any]]:
    """Wire events; consecutive stores of one chain in one medium share an event (as vLLM's do)."""
    out: list[dict[str, Any]] = []
    for ev in events:
        last = out[-1] if out else None
        if ev.kind == STORED:
            if (last is not None and last["type"] == STORED and last["medium"] == ev.medium
                    and last["block_hashes"][-1] == ev.parent_hash):
                last["block_hashes"].append(ev.block_hash)
                continue
            out.append({"type": STORED, "block_hashes": [ev.block_hash], "parent_block_hash": ev.parent_hash or None,
                        "block_size": block_size, "medium": ev.medium})
        elif ev.kind == REMOVED:
            if last is not None and last["type"] == REMOVED and last["medium"] == ev.medium:
                last["block_hashes"].append(ev.block_hash)
                continue
            out.append({"type": REMOVED, "block_hashes": [ev.block_hash], "medium": ev.medium})
        else:
            out.append({"type": CLEARED, "medium": ev.medium})
    return out


def events_from_wire(events: list[dict[str, Any]]) -> Iterable[KVEvent]:
    for e in events:
        kind, medium = e["type"], e.get("medium") or "device"
        if kind == STORED:
            parent = bytes(e.get("parent_block_hash") or b"")
            for h in e["block_hashes"]:
                yield KVEvent(STORED, medium, bytes(h), parent)
                parent = bytes(h)
        elif kind == REMOVED:
            for h in e["block_hashes"]:
                yield KVEvent(REMOVED, medium, bytes(h))
        elif kind == CLEARED:
            yield KVEvent(CLEARED, medium)


def pack(obj: dict[str, Any]) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(buf: bytes) -> dict[str, Any]:
    return msgpack.unpackb(buf, raw=False)


class KVEventPublisher:
    """Publishes what a KVEventSink collects over ZMQ PUB and answers snapshot requests, from
    its own thread: the engine step never waits on it, and events the tiers' background
    writer reports go out without waiting for the next step. The mirror is updated in the
    thread that sends, so a snapshot at seq N is exactly the state after batch N."""

    POLL_MS = 20  # the longest an event waits before it is sent
    HEARTBEAT_S = 1.0  # an idle publisher repeats its seq this often, so a subscriber notices what it missed

    def __init__(self, sink: KVEventSink, endpoint: str, replay_endpoint: str, model_fingerprint: str,
                 block_size: int) -> None:
        self.sink = sink
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.header = {"v": WIRE_VERSION, "instance": uuid.uuid4().hex, "model_fingerprint": model_fingerprint,
                       "block_size": block_size, "hash_scheme": HASH_SCHEME}
        self.mirror = BlockMirror()
        self.seq = 0
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = self._ctx.socket(zmq.ROUTER)
        for sock, addr in ((self._pub, endpoint), (self._replay, replay_endpoint)):
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.bind(addr)
            except zmq.ZMQError as e:
                self._ctx.destroy(linger=0)
                raise ValueError(f"kv_events: cannot bind {addr!r}: {e}") from None
        self._thread = threading.Thread(target=self._run, name="kvserve-kv-events", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Send what is left, then stop."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._ctx.destroy(linger=0)

    def _run(self) -> None:
        try:
            last = time.monotonic()
            while not self._stop.is_set():
                if self._replay.poll(self.POLL_MS):
                    ident, *_ = self._replay.recv_multipart()
                    snap = {**self.header, "seq": self.seq, "blocks": self.mirror.dump()}
                    self._replay.send_multipart([ident, pack(snap)])
                if self._send(self.sink.take()):
                    last = time.monotonic()
                elif time.monotonic() - last > self.HEARTBEAT_S:
                    last = time.monotonic()
                    beat = {**self.header, "seq": self.seq, "ts": time.time(), "heartbeat": True, "events": []}
                    self._pub.send_multipart([TOPIC, struct.pack(">Q", self.seq), pack(beat)])
            self._send(self.sink.take())
        except zmq.ContextTerminated:
            pass
        except Exception:  # noqa: BLE001 - routing hints must never take the engine down
            logger.exception("kv events publisher stopped")

    def _send(self, events: list[KVEvent]) -> bool:
        if not events:
            return False
        for ev in events:
            self.mirror.apply(ev)
        self.seq += 1
        batch = {**self.header, "seq": self.seq, "ts": time.time(),
                 "events": _event_dicts(events, self.header["block_size"])}
        self._pub.send_multipart([TOPIC, struct.pack(">Q", self.seq), pack(batch)])
        return True


def request_snapshot(replay_endpoint: str, timeout: float = 5.0, ctx: zmq.Context | None = None) -> dict[str, Any]:
    """One snapshot from a replay endpoint; raises TimeoutError if none comes in time."""
    own = ctx is None
    ctx = ctx or zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(replay_endpoint)
        sock.send(SNAPSHOT_REQUEST)
        if not sock.poll(int(timeout * 1000)):
            raise TimeoutError(f"no KV events snapshot from {replay_endpoint} within {timeout:.0f}s")
        return unpack(sock.recv())
    finally:
        sock.close()
        if own:
            ctx.term()


class KVEventSubscriber:
    """Keeps a BlockMirror of one replica current, from its own thread: a snapshot from the
    replay endpoint, then every batch after it. Another instance (the engine restarted) or a
    gap in seq (a slow joiner, a dropped message) triggers a new snapshot; ZMQ reconnects
    by itself when a replica comes back."""

    def __init__(self, endpoint: str, replay_endpoint: str, snapshot_timeout: float = 2.0) -> None:
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self.snapshot_timeout = snapshot_timeout
        self.mirror = BlockMirror()
        self.lock = threading.Lock()  # held while the mirror changes; readers take it too
        self.instance: str | None = None
        self.seq = 0
        self.header: dict[str, Any] = {}
        self.snapshots = 0  # how many times the state was (re)built from a snapshot
        self.synced = threading.Event()
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._thread = threading.Thread(target=self._run, name="kvserve-kv-events-sub", daemon=True)
        self._thread.start()

    def match(self, hashes: list[bytes]) -> list[str]:
        with self.lock:
            return self.mirror.match(hashes)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._ctx.destroy(linger=0)

    def _run(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        sub.connect(self.endpoint)
        need_snapshot = True
        try:
            while not self._stop.is_set():
                if need_snapshot:
                    need_snapshot = not self._snapshot()
                    if need_snapshot:
                        self._stop.wait(0.5)
                        continue
                if not sub.poll(100):
                    continue
                _, _, payload = sub.recv_multipart()
                need_snapshot = not self._apply(unpack(payload))
        except zmq.ContextTerminated:
            pass
        except Exception:  # noqa: BLE001
            logger.exception("kv events subscriber for %s stopped", self.endpoint)
        finally:
            sub.close()

    def _snapshot(self) -> bool:
        try:
            snap = request_snapshot(self.replay_endpoint, self.snapshot_timeout, self._ctx)
        except TimeoutError:
            return False
        with self.lock:
            self.mirror.load(snap["blocks"])
            self.instance, self.seq = snap["instance"], snap["seq"]
            self.header = {k: snap[k] for k in ("model_fingerprint", "block_size", "hash_scheme")}
            self.snapshots += 1
        self.synced.set()
        return True

    def _apply(self, batch: dict[str, Any]) -> bool:
        """Apply one batch; False when the state must be rebuilt from a snapshot."""
        if batch.get("heartbeat"):  # says which seq the publisher is at: anything else means we missed some
            return batch["instance"] == self.instance and batch["seq"] == self.seq
        if batch["instance"] != self.instance or batch["seq"] > self.seq + 1:
            return False
        if batch["seq"] <= self.seq:  # already in the snapshot
            return True
        with self.lock:
            for ev in events_from_wire(batch["events"]):
                self.mirror.apply(ev)
            self.seq = batch["seq"]
        return True
