"""KV events: the wire format, publisher and subscriber over real sockets, and an engine whose
published state matches its prefix cache and tiers exactly."""

from __future__ import annotations

import time

import pytest

from kvserve import LLM, SamplingParams
from kvserve.core.kv_events import (CLEARED, REMOVED, STORED, BlockMirror, KVEvent, KVEventPublisher, KVEventSink,
                                    KVEventSubscriber, _event_dicts, events_from_wire, pack, request_snapshot,
                                    unpack)
from tests.serving import free_port


def _h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def _wait(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _endpoints() -> tuple[str, str]:
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


def test_wire_events_coalesce_chains_and_round_trip():
    events = [KVEvent(STORED, "device", _h(1), b""), KVEvent(STORED, "device", _h(2), _h(1)),
              KVEvent(STORED, "cpu", _h(3), _h(2)), KVEvent(STORED, "device", _h(9), _h(7)),
              KVEvent(REMOVED, "device", _h(1)), KVEvent(REMOVED, "device", _h(2)), KVEvent(CLEARED, "disk")]
    wire = unpack(pack({"events": _event_dicts(events, 16)}))["events"]
    assert [(e["type"], e["medium"], len(e.get("block_hashes", []))) for e in wire] == [
        (STORED, "device", 2), (STORED, "cpu", 1), (STORED, "device", 1), (REMOVED, "device", 2),
        ("AllBlocksCleared", "disk", 0)]
    assert wire[0]["parent_block_hash"] is None and wire[2]["parent_block_hash"] == _h(7)
    assert wire[0]["block_size"] == 16
    assert list(events_from_wire(wire)) == events


def test_mirror_match_reports_the_fastest_medium_and_stops_at_a_gap():
    m = BlockMirror()
    for ev in [KVEvent(STORED, "disk", _h(1)), KVEvent(STORED, "device", _h(1)), KVEvent(STORED, "cpu", _h(2), _h(1)),
               KVEvent(STORED, "device", _h(4), _h(3))]:
        m.apply(ev)
    assert m.match([_h(1), _h(2), _h(3), _h(4)]) == ["device", "cpu"]
    m.apply(KVEvent(REMOVED, "device", _h(1)))
    assert m.match([_h(1), _h(2)]) == ["disk", "cpu"]
    m.apply(KVEvent(CLEARED, "disk"))
    assert m.match([_h(1), _h(2)]) == []
    copy = BlockMirror()
    copy.load(unpack(pack({"b": m.dump()}))["b"])
    assert copy.blocks == m.blocks


def test_subscriber_follows_publisher_and_resyncs_after_a_restart():
    pub_addr, replay_addr = _endpoints()
    sink = KVEventSink()
    pub = KVEventPublisher(sink, pub_addr, replay_addr, "fp", 16)
    sink.stored(_h(1), b"", "device")  # before anyone subscribes: reaches the subscriber by snapshot
    _wait(lambda: pub.seq == 1)
    sub = KVEventSubscriber(pub_addr, replay_addr)
    try:
        assert sub.synced.wait(10)
        assert sub.header == {"model_fingerprint": "fp", "block_size": 16, "hash_scheme": pub.header["hash_scheme"]}
        for i in range(2, 40):
            sink.stored(_h(i), _h(i - 1), "device")
            if i % 5 == 0:
                sink.removed(_h(i - 3), "device")
        _wait(lambda: _h(39) in sub.mirror.blocks["device"])  # the last event arrived
        assert sub.seq == pub.seq and sub.mirror.blocks == pub.mirror.blocks
        assert sub.match([_h(1), _h(2)]) == ["device"]  # _h(2) was removed at i = 5
        assert sub.match([_h(3), _h(4)]) == ["device", "device"]
        snap = request_snapshot(replay_addr)
        assert snap["seq"] == pub.seq and len(snap["blocks"]["device"]) == len(pub.mirror.blocks["device"])

        pub.close()  # the engine restarts on the same addresses: a new instance, seq from 1
        sink2 = KVEventSink()
        pub = KVEventPublisher(sink2, pub_addr, replay_addr, "fp", 16)
        sink2.stored(_h(100), b"", "cpu")
        _wait(lambda: sub.instance == pub.header["instance"] and sub.mirror.blocks == pub.mirror.blocks, 20)
        assert sub.snapshots >= 2
        assert sub.match([_h(1)]) == [] and sub.match([_h(100)]) == ["cpu"]
    finally:
        sub.close()
        pub.close()


def test_bad_endpoint_is_refused_with_the_flag_name():
    with pytest.raises(ValueError, match="kv_events_endpoint"):
        LLM(model=None, kv_events_endpoint="localhost:5557")
    with pytest.raises(ValueError, match="kv_events_replay_endpoint needs kv_events_endpoint"):
        LLM(model=None, kv_events_replay_endpoint="tcp://127.0.0.1:5558")


def _device_hashes(llm: LLM) -> set[bytes]:
    return {b.block_hash for b in llm.engine.kv.cache.cached_blocks()}


@pytest.mark.parametrize("offload", [None, "cpu", "disk"])
def test_engine_publishes_exactly_its_cached_blocks(tiny_model_factory, tmp_path, offload):
    pub_addr, replay_addr = _endpoints()
    kw = {"cpu": {"kv_offload_cpu": "64MiB"}, "disk": {"kv_offload_disk": str(tmp_path)}, None: {}}[offload]
    llm = LLM(model=str(tiny_model_factory("llama")), num_kv_blocks=24, block_size=4, max_model_len=64,
              kv_events_endpoint=pub_addr, kv_events_replay_endpoint=replay_addr, check_integrity=True, **kw)
    sub = KVEventSubscriber(pub_addr, replay_addr)
    try:
        assert sub.synced.wait(10)
        params = SamplingParams(max_tokens=4, temperature=0)
        prompts = [[(7 * i + j) % 250 + 1 for j in range(30)] for i in range(6)]  # more than the pool holds
        for p in prompts:
            llm.generate([p], params, use_tqdm=False)
            _wait(lambda: sub.mirror.blocks["device"].keys() == _device_hashes(llm))
        assert sub.header["block_size"] == 4
        assert sub.header["model_fingerprint"] == llm.engine.model_fingerprint.hex()
        if offload:  # evicted blocks went to host RAM or disk and are announced there
            tier = getattr(llm.engine.executor.runner.connector_roles["tiers"].store, {"cpu": "host"}.get(offload, offload))
            # Offline, the engine steps only inside generate(); the writer thread's last writes are
            # reported with a later step, as a server's engine loop runs while writes are queued.
            _wait(lambda: not llm.engine.step() and not llm.engine.has_unfinished_requests())
            _wait(lambda: len(sub.mirror.blocks[offload]) == tier.stats()["entries"] > 0)
        # a new subscriber (a restarted router) gets the same state from the snapshot alone
        late = KVEventSubscriber(pub_addr, replay_addr)
        try:
            assert late.synced.wait(10)
            assert late.mirror.blocks == sub.mirror.blocks
        finally:
            late.close()
        llm.engine.clear_kv_cache()
        _wait(lambda: not any(sub.mirror.blocks.values()))
    finally:
        sub.close()
        llm.close()
