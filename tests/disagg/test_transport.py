"""The KV transfer transport (disagg/transport.py): one protocol, TCP or shared memory."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvserve.disagg.transport import SHM_DIR, KVSender, KVTransferError, fetch, handshake_mismatch

HANDSHAKE = {"model": "m.gguf", "block_size": 4, "kv_dtype": "float32", "block_shape": [2, 2, 4, 2, 8],
             "fingerprint": "ab"}


@pytest.fixture
def sender():
    s = KVSender("127.0.0.1", 0, HANDSHAKE, lease_s=30)
    yield s
    s.close()


@pytest.mark.parametrize("transport", ["zmq", "shm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_round_trip(sender, transport, dtype):
    data = torch.randn(3, 2, 2, 4, 2, 8).to(dtype)
    hashes = [b"h0", b"h1", b"h2"]
    tid = sender.expect(hashes)
    sender.put(tid, data)
    got_hashes, got = fetch("127.0.0.1", sender.port, tid, HANDSHAKE, timeout=10, transport=transport)
    assert got_hashes == hashes
    assert got.dtype == dtype and got.shape == data.shape
    assert torch.equal(got.view(torch.uint8), data.view(torch.uint8))
    assert sender.num_pending == 0 and sender.transfers_sent == 1
    # one fetch takes a transfer; a second is refused, naming it
    with pytest.raises(KVTransferError, match="unknown transfer"):
        fetch("127.0.0.1", sender.port, tid, HANDSHAKE, timeout=10, transport=transport)
    deadline = time.monotonic() + 5
    while any(p.name.startswith("kvserve-kv-") for p in SHM_DIR.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.01)  # the release reaches the sender thread
    assert not any(p.name.startswith("kvserve-kv-") for p in SHM_DIR.iterdir())


def test_fetch_waits_for_blocks_copied_after_it_asked(sender):
    tid = sender.expect([b"h0"])
    data = torch.randn(1, 2, 2, 4, 2, 8)
    threading.Timer(0.3, sender.put, (tid, data)).start()
    _, got = fetch("127.0.0.1", sender.port, tid, HANDSHAKE, timeout=10, transport="zmq")
    assert torch.equal(got, data)


def test_handshake_names_what_differs(sender):
    tid = sender.expect([b"h0"])
    sender.put(tid, torch.zeros(1, 2, 2, 4, 2, 8))
    theirs = dict(HANDSHAKE, block_size=8)
    with pytest.raises(KVTransferError, match="block_size 8 there, 4 here"):
        fetch("127.0.0.1", sender.port, tid, theirs, timeout=10, transport="zmq")
    assert handshake_mismatch(HANDSHAKE, dict(HANDSHAKE, fingerprint="cd")).startswith("model fingerprint")
    assert handshake_mismatch(HANDSHAKE, dict(HANDSHAKE, kv_dtype="float8_e4m3fn")) is not None
    assert handshake_mismatch(HANDSHAKE, dict(HANDSHAKE)) is None


def test_lease_runs_out():
    s = KVSender("127.0.0.1", 0, HANDSHAKE, lease_s=0.2)
    try:
        tid = s.expect([b"h0"])
        s.put(tid, torch.zeros(1, 2, 2, 4, 2, 8))
        time.sleep(0.5)
        assert s.num_pending == 0 and s.transfers_expired == 1
        with pytest.raises(KVTransferError, match="lease"):
            fetch("127.0.0.1", s.port, tid, HANDSHAKE, timeout=5, transport="zmq")
    finally:
        s.close()


def test_sender_gone_mid_transfer_fails_fast():
    """The prefill engine dies after promising blocks: the fetch fails within a probe or two,
    not after its whole timeout, and returns nothing."""
    s = KVSender("127.0.0.1", 0, HANDSHAKE, lease_s=30)
    tid = s.expect([b"h0"])  # never put
    threading.Timer(0.5, s.close).start()
    start = time.monotonic()
    with pytest.raises(KVTransferError, match="went away"):
        fetch("127.0.0.1", s.port, tid, HANDSHAKE, timeout=60, transport="zmq")
    assert time.monotonic() - start < 5


def test_nobody_listening():
    import socket

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    with pytest.raises(KVTransferError, match="not reachable"):
        fetch("127.0.0.1", port, "x", HANDSHAKE, timeout=5)
