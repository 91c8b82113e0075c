"""The KV transfer transport (disagg/transport.py): one protocol, TCP or shared memory, every
message sealed with the deployment's key (the attacks on it: test_transfer_security.py)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvserve.disagg.auth import TransferAuth
from kvserve.disagg.transport import SHM_DIR, KVSender, KVTransferError, fetch, handshake_mismatch

HANDSHAKE = {"model": "m.gguf", "block_size": 4, "kv_dtype": "float32", "block_shape": [2, 2, 4, 2, 8],
             "fingerprint": "ab"}
KEY = b"0123456789abcdef-test-key"


def _sender(handshake: dict = HANDSHAKE, lease_s: float = 30) -> KVSender:
    return KVSender("127.0.0.1", 0, handshake, lease_s, TransferAuth(KEY))


def _fetch(port: int, tid: str, handshake: dict = HANDSHAKE, timeout: float = 10, transport: str = "zmq"):
    return fetch("127.0.0.1", port, tid, handshake, TransferAuth(KEY), timeout, max_blocks=8, transport=transport)


@pytest.fixture
def sender():
    s = _sender()
    yield s
    s.close()


@pytest.mark.parametrize("transport", ["zmq", "shm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_round_trip(transport, dtype):
    handshake = dict(HANDSHAKE, kv_dtype=str(dtype).removeprefix("torch."))
    sender = _sender(handshake)
    try:
        data = torch.randn(3, 2, 2, 4, 2, 8).to(dtype)
        hashes = [b"h0", b"h1", b"h2"]
        tid = sender.expect(hashes)
        sender.put(tid, data)
        got_hashes, got = _fetch(sender.port, tid, handshake, transport=transport)
        assert got_hashes == hashes
        assert got.dtype == dtype and got.shape == data.shape
        assert torch.equal(got.view(torch.uint8), data.view(torch.uint8))
        assert sender.num_pending == 0 and sender.transfers_sent == 1
        # one fetch takes a transfer; a second is refused, naming it
        with pytest.raises(KVTransferError, match="unknown transfer"):
            _fetch(sender.port, tid, handshake, transport=transport)
        deadline = time.monotonic() + 5
        while any(p.name.startswith("kvserve-kv-") for p in SHM_DIR.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.01)  # the release reaches the sender thread
        assert not any(p.name.startswith("kvserve-kv-") for p in SHM_DIR.iterdir())
    finally:
        sender.close()


def test_fetch_waits_for_blocks_copied_after_it_asked(sender):
    tid = sender.expect([b"h0"])
    data = torch.randn(1, 2, 2, 4, 2, 8)
    threading.Timer(0.3, sender.put, (tid, data)).start()
    _, got = _fetch(sender.port, tid)
    assert torch.equal(got, data)


def test_handshake_names_what_differs(sender):
    tid = sender.expect([b"h0"])
    sender.put(tid, torch.zeros(1, 2, 2, 4, 2, 8))
    theirs = dict(HANDSHAKE, block_size=8)
    with pytest.raises(KVTransferError, match="block_size 8 there, 4 here"):
        _fetch(sender.port, tid, theirs)
    assert handshake_mismatch(HANDSHAKE, dict(HANDSHAKE, fingerprint="cd")).startswith("model fingerprint")
    assert handshake_mismatch(HANDSHAKE, dict(HANDSHAKE, kv_dtype="float8_e4m3fn")) is not None
    assert handshake_mismatch(HANDSHAKE, dict(HANDSHAKE)) is None


def test_lease_runs_out():
    s = _sender(lease_s=0.2)
    try:
        tid = s.expect([b"h0"])
        s.put(tid, torch.zeros(1, 2, 2, 4, 2, 8))
        time.sleep(0.5)
        assert s.num_pending == 0 and s.transfers_expired == 1
        with pytest.raises(KVTransferError, match="lease"):
            _fetch(s.port, tid, timeout=5)
    finally:
        s.close()


def test_sender_gone_mid_transfer_fails_fast():
    """The prefill engine dies after promising blocks: the fetch fails within a probe or two,
    not after its whole timeout, and returns nothing."""
    s = _sender()
    tid = s.expect([b"h0"])  # never put
    threading.Timer(0.5, s.close).start()
    start = time.monotonic()
    with pytest.raises(KVTransferError, match="went away"):
        _fetch(s.port, tid, timeout=60)
    assert time.monotonic() - start < 5


def test_nobody_listening():
    import socket

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    with pytest.raises(KVTransferError, match="not reachable"):
        _fetch(port, "x", timeout=5)
