"""Attacks on prefill/decode K/V transfer (issue 31): a decode engine with real sockets, fed by a
real prefill engine and by fake senders (threads speaking transport.py's wire protocol). Each
bad transfer fails its one request's load only: the request is prefilled on the decode engine
and answers exactly what one plain engine answers, the cache stays consistent and holds the
right K/V afterwards, and the engine goes on serving."""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable

import msgpack
import pytest
import torch
import zmq

from kvserve import LLM, SamplingParams
from kvserve.config import KVTransferConfig
from kvserve.disagg.auth import TransferAuth, sign_params
from kvserve.disagg.params import check_transfer_params
from tests.disagg.test_pd_engine import BLOCK, KEY, _llm, decode, greedy, idle, prefill

PROMPT = list(range(60, 93))  # 8 full blocks before its last token
OTHER = list(range(200, 233))  # as long: the same number of blocks
KEY_BYTES = KEY.encode()

Reply = Callable[[bytes], list[bytes]]  # the fetch's nonce -> the reply's frames after the envelope


class FakeSender:
    """A KV sender that answers every fetch with `reply(nonce)`, or never when reply is None."""

    def __init__(self, reply: Reply | None) -> None:
        self.reply = reply
        self.fetches = 0
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._sock.poll(10):
                continue
            frames = self._sock.recv_multipart()
            msg = msgpack.unpackb(frames[2], raw=False)
            if msg.get("op") != "fetch":
                continue
            self.fetches += 1
            if self.reply is not None:
                self._sock.send_multipart([frames[0], b"", *self.reply(msg["nonce"])])

    def params(self, num_blocks: int, key: bytes = KEY_BYTES) -> dict:
        return sign_params(key, {"do_remote_prefill": True, "do_remote_decode": False, "remote_host": "127.0.0.1",
                                 "remote_port": self.port, "remote_request_id": "t", "remote_num_blocks": num_blocks,
                                 "remote_engine_id": None})

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close()


def blocks_reply(hashes: list[bytes], data: torch.Tensor, key: bytes = KEY_BYTES, *, shape=None, dtype=None,
                 digest_of: bytes | None = None, frames: int = 1, re: bytes | None = None) -> Reply:
    """A reply carrying `data` under `hashes`, sealed with `key`; the keywords make it lie."""
    auth = TransferAuth(key)
    raw = data.contiguous().view(torch.uint8).numpy().tobytes()

    def reply(nonce: bytes) -> list[bytes]:
        head = {"ok": True, "re": re or nonce, "hashes": hashes, "shape": list(shape or data.shape),
                "dtype": dtype or str(data.dtype).removeprefix("torch."),
                "digest": hashlib.sha256(raw if digest_of is None else digest_of).digest(), "shm": None}
        return [*auth.seal(head)[1], *[raw] * frames]
    return reply


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def pair(model_dir):
    p = _llm(model_dir, kv_role="prefill")
    d = _llm(model_dir, kv_role="decode", kv_transfer_config={"kv_connector_extra_config": {"transport": "zmq"}})
    yield p, d
    p.engine.close()
    d.engine.close()


@pytest.fixture(scope="module")
def reference(model_dir):
    """What one plain engine answers, greedily."""
    llm = _llm(model_dir)
    outs = llm.generate([{"prompt_token_ids": x} for x in (PROMPT, OTHER)], greedy(), use_tqdm=False)
    llm.engine.close()
    return {tuple(x): o.outputs[0].token_ids for x, o in zip((PROMPT, OTHER), outs)}


def real_blocks(pair, prompt: list[int]) -> tuple[list[bytes], torch.Tensor]:
    """The prompt's hashes and K/V, fetched from the real prefill engine as a decode engine would."""
    from kvserve.disagg.transport import fetch

    p, d = pair
    t = prefill(p, [prompt])[0]
    return fetch("127.0.0.1", t["remote_port"], t["remote_request_id"], d.engine.transfer.handshake,
                 TransferAuth(KEY_BYTES), 10, t["remote_num_blocks"], "zmq")


def assert_recomputed(d, prompt, params, reference, caplog, reason: str) -> None:
    """The transfer is refused for `reason`; the request is prefilled here and answers right;
    the blocks it cached hold the right K/V (a plain request reuses them and answers right)."""
    failed = d.engine.stats()["kv_transfer_failed"]
    with caplog.at_level(logging.WARNING, logger="kvserve.disagg.connector"):
        out = decode(d, [prompt], [params])[0]
    assert reason in caplog.text
    assert out.outputs[0].token_ids == reference[tuple(prompt)]
    assert out.num_cached_tokens == 0 and "kv_transfer" not in out.num_cached_tokens_by_tier
    assert d.engine.stats()["kv_transfer_failed"] == failed + 1
    d.engine.kv.check_integrity(d.engine.scheduler.block_holders())
    again = d.generate([{"prompt_token_ids": prompt}], greedy(), use_tqdm=False)[0]
    assert again.outputs[0].token_ids == reference[tuple(prompt)]
    assert again.num_cached_tokens_by_tier == {"device": (len(prompt) - 1) // BLOCK * BLOCK}
    idle(d)
    assert d.engine.stats()["kv_blocks_used"] == 0


LIES = {  # what a sender of the deployment (it holds the key) gets wrong -> the reason it is refused
    "hashes": "fetched block 0 of 8 is not this prompt's",
    "shape": "this engine's KV cache takes float32",
    "dtype": "the reply's blocks are int32",
    "short": "the reply's data is",
    "missing_frame": "has 0 data frames, not one",
    "two_frames": "has 2 data frames, not one",
    "digest": "does not match the digest its sender signed",
    "too_many": "the reply has 9 blocks; the transfer promised 8",
    "bad_mac": "failed authentication: bad MAC",
    "no_mac": "failed authentication: expected a body and a MAC frame",
    "other_request": "answers another request",
}


def lying_reply(lie: str, hashes: list[bytes], data: torch.Tensor, other_hashes: list[bytes]) -> Reply:
    n = data.shape[0]
    if lie == "hashes":  # hashes of another prompt: the sender's claim, not what the decode engine computes
        return blocks_reply(other_hashes, data)
    if lie == "shape":  # the same bytes, heads and head_dim merged
        return blocks_reply(hashes, data.reshape(*data.shape[:4], -1))
    if lie == "dtype":
        return blocks_reply(hashes, data.view(torch.int32))
    if lie == "short":  # the right header over one block too few of bytes, digest and all
        cut = data[:n - 1].contiguous().view(torch.uint8).numpy().tobytes()
        return lambda nonce: [*blocks_reply(hashes, data, digest_of=cut, frames=0)(nonce), cut]
    if lie == "missing_frame":
        return blocks_reply(hashes, data, frames=0)
    if lie == "two_frames":
        return blocks_reply(hashes, data, frames=2)
    if lie == "digest":  # bytes changed on the way
        return blocks_reply(hashes, data, digest_of=b"what the sender computed")
    if lie == "too_many":
        return blocks_reply([*hashes, hashes[-1]], torch.cat([data, data[-1:]]))
    if lie == "bad_mac":
        return blocks_reply(hashes, data, key=b"another-deployment-key")
    if lie == "no_mac":
        return lambda nonce: blocks_reply(hashes, data)(nonce)[:1]
    assert lie == "other_request"
    return blocks_reply(hashes, data, re=b"\0" * 16)


@pytest.mark.parametrize("lie", sorted(LIES))
def test_bad_transfer_is_recomputed(pair, reference, caplog, lie):
    _, d = pair
    d.engine.clear_kv_cache()
    hashes, data = real_blocks(pair, PROMPT)
    other_hashes, _ = real_blocks(pair, OTHER)
    assert len(hashes) == len(other_hashes) == 8
    sender = FakeSender(lying_reply(lie, hashes, data, other_hashes))
    try:
        d.engine.clear_kv_cache()
        assert_recomputed(d, PROMPT, sender.params(8), reference, caplog, LIES[lie])
        assert sender.fetches == 1
    finally:
        sender.close()


def test_replayed_reply_is_refused(pair, reference, caplog):
    """A reply recorded from an earlier transfer, played to a later fetch of the same prompt."""
    _, d = pair
    d.engine.clear_kv_cache()
    hashes, data = real_blocks(pair, PROMPT)
    genuine = blocks_reply(hashes, data)
    recorded: list[list[bytes]] = []

    def reply(nonce: bytes) -> list[bytes]:
        if not recorded:
            recorded.append(genuine(nonce))
        return recorded[0]

    sender = FakeSender(reply)
    try:
        first = decode(d, [PROMPT], [sender.params(8)])[0]  # the genuine reply: used
        assert first.num_cached_tokens_by_tier.get("kv_transfer") == 32
        d.engine.clear_kv_cache()
        assert_recomputed(d, PROMPT, sender.params(8), reference, caplog, "replayed message")
    finally:
        sender.close()


def test_sender_refuses_unsealed_and_replayed_fetches(pair):
    p, d = pair
    t = prefill(p, [PROMPT])[0]
    hs = d.engine.transfer.handshake
    auth = TransferAuth(KEY_BYTES)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{t['remote_port']}")

    def ask(frames: list[bytes]) -> tuple[dict, int]:
        sock.send_multipart([b"", *frames])
        assert sock.poll(5000)
        got = sock.recv_multipart()
        return auth.open(got[1:3]), len(got)

    try:
        fetch_msg = {"op": "fetch", "id": t["remote_request_id"], "handshake": hs, "shm": False}
        unsealed = msgpack.packb({**fetch_msg, "nonce": b"n" * 16, "ts": time.time()})
        for frames, why in [([unsealed], "expected a body and a MAC frame"),
                            (TransferAuth(b"another-deployment-key").seal(fetch_msg)[1], "bad MAC")]:
            head, n = ask(frames)
            assert not head["ok"] and why in head["error"] and n == 3  # no data frame
        sealed = auth.seal(fetch_msg)[1]
        head, n = ask(sealed)
        assert head["ok"] and n == 4
        head, n = ask(sealed)  # the same frames again
        assert not head["ok"] and "replayed message" in head["error"] and n == 3
        assert p.engine.executor.runner.connector_roles["kv_transfer"].sender.messages_refused == 3
    finally:
        sock.close()


def test_client_cannot_name_a_sender(pair, model_dir):
    """The probe's attack: a client points the decode engine at its own sender."""
    _, d = pair
    attacker = FakeSender(None)
    try:
        unsigned = {k: v for k, v in attacker.params(8).items() if k != "remote_auth"}
        for params, why in [(unsigned, "remote_auth is missing"),
                            (attacker.params(8, key=b"the-attacker-guessed-this"), "remote_auth is wrong"),
                            (dict(attacker.params(8), remote_port=attacker.port + 1), "remote_auth is wrong")]:
            with pytest.raises(ValueError, match=f"kv_transfer_params.{why}"):
                d.generate([{"prompt_token_ids": PROMPT}], greedy(extra_args={"kv_transfer_params": params}),
                           use_tqdm=False)
        assert attacker.fetches == 0
    finally:
        attacker.close()
    # a decode engine with a list of prefill peers fetches from those only
    cfg = KVTransferConfig("decode", {"kv_connector_extra_config": {"auth_key": KEY, "peers": ["10.0.0.7:5600"]}})
    signed = sign_params(KEY_BYTES, {"do_remote_prefill": True, "remote_host": "10.0.0.7", "remote_port": 5600,
                                     "remote_request_id": "t", "remote_num_blocks": 8})
    check_transfer_params(signed, cfg, 1)
    with pytest.raises(ValueError, match="kv_transfer_params.remote_host 10.0.0.8:5600 is not one of this engine's"):
        check_transfer_params(sign_params(KEY_BYTES, dict(signed, remote_host="10.0.0.8")), cfg, 1)
    # and an engine with a role starts only with the deployment's key
    with pytest.raises(ValueError, match="kv_role decode needs the deployment's shared key"):
        LLM(model=str(model_dir), dtype="float32", num_kv_blocks=16, kv_role="decode")


def test_silent_peers_cost_their_own_requests_only(pair, reference):
    """Four senders that never answer hold fetches of their own; a transfer from the real
    prefill engine meanwhile takes what it takes alone."""
    p, d = pair
    d.engine.clear_kv_cache()
    silent = [FakeSender(None) for _ in range(4)]
    try:
        hung = [d.engine.add_request(None, x, greedy(extra_args={"kv_transfer_params": s.params(8)}))
                for s, x in zip(silent, [[i, *OTHER[1:]] for i in range(4)])]
        deadline = time.monotonic() + 5
        while sum(s.fetches for s in silent) < 4 and time.monotonic() < deadline:
            d.engine.step()
        assert [s.fetches for s in silent] == [1, 1, 1, 1]
        t = prefill(p, [PROMPT])[0]
        start = time.monotonic()
        rid = d.engine.add_request(None, PROMPT, SamplingParams(temperature=0, max_tokens=8,
                                                                extra_args={"kv_transfer_params": t}))
        done = None
        while done is None and time.monotonic() - start < 10:
            done = next((o for o in d.engine.step() if o.request_id == rid and o.finished), None)
        took = time.monotonic() - start
        print(f"\ntransfer + 8 tokens with 4 silent peers hanging: {took * 1000:.0f} ms")
        assert done is not None and took < 3
        assert done.outputs[0].token_ids == reference[tuple(PROMPT)]
        assert done.num_cached_tokens_by_tier.get("kv_transfer") == 32
        for r in hung:
            d.engine.abort_request(r)
        failed = d.engine.stats()["kv_transfer_failed"]
    finally:
        for s in silent:
            s.close()
    deadline = time.monotonic() + 5  # their fetches see the senders gone within a probe or two
    while d.engine.stats()["kv_transfer_failed"] < failed + 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert d.engine.stats()["kv_transfer_failed"] == failed + 4
    idle(d)
    d.engine.kv.check_integrity(d.engine.scheduler.block_holders())
    assert d.engine.stats()["kv_blocks_used"] == 0


def test_whole_blocks_refuse_data_of_another_shape(pair):
    """The last line of defence, under the connector's checks: nothing is written."""
    _, d = pair
    blocks = d.engine.executor.runner.connector_roles["kv_transfer"].blocks
    good = blocks.gather([0, 1])
    with pytest.raises(ValueError, match=r"KV block data is \[2, .*\]; 2 blocks of this cache are \[2, "):
        blocks.scatter([0, 1], good.reshape(*good.shape[:4], -1))
    with pytest.raises(ValueError, match=r"; 1 blocks of this cache are"):
        blocks.scatter([0], good)
    assert torch.equal(blocks.gather([0, 1]), good)
