"""Proof that a K/V transfer message comes from this deployment and is fresh.

The prefill and decode engines of one deployment share a key (kv_connector_extra_config's
auth_key_file or auth_key; `kvserve router --launch-pd` makes one per deployment). Two things
are signed with it, HMAC-SHA256, each under its own label so that one never passes for the other:

- every message of the transfer protocol (transport.py), in both directions. Its msgpack body
  carries a random nonce and the sender's wall-clock time; the MAC is the next frame. A
  message whose MAC is wrong or missing, whose time is more than `window_s` from this host's,
  or whose nonce was seen before is refused: a recorded frame cannot be played again.
- the kv_transfer_params a prefill engine returns (their `remote_auth`): a decode engine
  fetches only from where a peer's signed params say, never from where a client says.

Pure Python (no torch): params.py checks requests with it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import threading
import time
from typing import Any

import msgpack

REPLAY_WINDOW_S = 60.0  # how far a message's clock may be from ours (hosts run NTP)
PARAMS_MAC = "remote_auth"  # the kv_transfer_params field holding their MAC
_MSG_LABEL = b"kvserve kv-transfer message\0"
_PARAMS_LABEL = b"kvserve kv-transfer params\0"
_NONCE_BYTES = 16


class AuthError(RuntimeError):
    """A message that is not provably this deployment's, or not fresh."""


def _mac(key: bytes, label: bytes, body: bytes) -> bytes:
    return hmac.new(key, label + body, hashlib.sha256).digest()


def _canonical(params: dict[str, Any]) -> bytes:
    return json.dumps({k: v for k, v in params.items() if k != PARAMS_MAC}, sort_keys=True,
                      separators=(",", ":")).encode()


def sign_params(key: bytes, params: dict[str, Any]) -> dict[str, Any]:
    """`params` with their MAC added (hex, as JSON carries it)."""
    return {**params, PARAMS_MAC: _mac(key, _PARAMS_LABEL, _canonical(params)).hex()}


def params_signed(key: bytes, params: dict[str, Any]) -> bool:
    """Whether `params` carry a MAC of every other field under `key` (compared in constant time)."""
    given = params.get(PARAMS_MAC)
    if not isinstance(given, str):
        return False
    try:
        want = _mac(key, _PARAMS_LABEL, _canonical(params)).hex()
    except (TypeError, ValueError):  # not JSON: no peer made these
        return False
    return hmac.compare_digest(want, given)


class TransferAuth:
    """Seals and opens transfer messages with the deployment's key.

    Threads: the sender thread and every fetch thread open messages; the nonces seen are kept
    under one lock, each until no message carrying it could still be fresh."""

    def __init__(self, key: bytes, window_s: float = REPLAY_WINDOW_S) -> None:
        self._key = key
        self.window_s = window_s
        self._lock = threading.Lock()
        self._seen: dict[bytes, float] = {}  # nonce -> when it may be forgotten
        self._next_purge = 0.0

    def seal(self, msg: dict[str, Any]) -> tuple[bytes, list[bytes]]:
        """(the nonce, the [body, MAC] frames) of `msg` stamped with a fresh nonce and the time."""
        nonce = os.urandom(_NONCE_BYTES)
        body = msgpack.packb({**msg, "nonce": nonce, "ts": time.time()}, use_bin_type=True)
        return nonce, [body, _mac(self._key, _MSG_LABEL, body)]

    def open(self, frames: list[bytes]) -> dict[str, Any]:
        """The message of [body, MAC] frames; AuthError unless it is sealed with this key, within
        the clock window, and never seen before."""
        if len(frames) != 2:
            raise AuthError(f"expected a body and a MAC frame, got {len(frames)} frame(s)")
        body, mac = frames
        if not hmac.compare_digest(_mac(self._key, _MSG_LABEL, body), mac):
            raise AuthError("bad MAC: the peer holds another key, or is not a kvserve engine")
        msg = msgpack.unpackb(body, raw=False)
        if not isinstance(msg, dict):
            raise AuthError("message body is not a map")
        nonce, ts = msg.get("nonce"), msg.get("ts")
        if not isinstance(nonce, bytes) or len(nonce) != _NONCE_BYTES or not isinstance(ts, float):
            raise AuthError("message without a nonce and a time")
        now = time.time()
        if abs(now - ts) > self.window_s:
            raise AuthError(f"stale message: sent {now - ts:+.0f} s from now (clocks must agree within "
                            f"{self.window_s:g} s)")
        with self._lock:
            if now >= self._next_purge:
                self._seen = {n: t for n, t in self._seen.items() if t > now}
                self._next_purge = now + self.window_s
            if nonce in self._seen:
                raise AuthError("replayed message: its nonce was seen before")
            self._seen[nonce] = ts + 2 * self.window_s
        return msg
