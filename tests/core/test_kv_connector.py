"""The scheduler against a fake KV connector: the two-halves interface (core/kv_connector.py).

The fake holds the first blocks of some prompts "remotely" and loads them after a few steps
(WAITING_FOR_REMOTE_KV), and sends the blocks of some finished requests (their blocks stay
held until it says they were sent)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvserve.core.kv_connector import DEVICE_TIER, EvictedBlock, KVConnector, MultiConnector, TierHit
from kvserve.core.prefix_cache import compute_block_hashes
from kvserve.core.sched_output import SchedulerOutput
from kvserve.request import Request, RequestStatus
from tests.core.test_scheduler import BS, expected_output, make_sched, req, step

REMOTE_BLOCKS = 2  # the fake has two blocks of every prompt of a request whose id says "load"
LOAD_STEPS = 3  # ... and they arrive after this many steps
SEND_STEPS = 2  # a "send" request's blocks are sent this many steps after it finishes


class FakeConnector(KVConnector):
    def __init__(self, first_block: int = 0, load_steps: int = LOAD_STEPS, send_steps: int = SEND_STEPS,
                 fail: bool = False) -> None:
        """Holds blocks first_block .. REMOTE_BLOCKS - 1 + first_block of "load*" prompts; `fail`:
        every load fails (load_error)."""
        self.first_block, self.load_steps, self.send_steps, self.fail = first_block, load_steps, send_steps, fail
        self.step = 0
        self.loading: dict[str, int] = {}  # request id -> the step its load finishes
        self.loaded: set[str] = set()
        self.sending: dict[str, tuple[int, list[int]]] = {}  # request id -> (step sent, its block ids)
        self.onloads: list[tuple[int, TierHit]] = []
        self.metas: list[dict[str, Any]] = []
        self.forgotten: list[str] = []
        self.counted: list[str] = []

    def on_evict(self, block: EvictedBlock) -> None:
        pass

    def lookup(self, request: Request, start_block: int, max_blocks: int) -> list[TierHit]:
        if request.request_id not in self.loaded:
            return []
        hashes = compute_block_hashes(request, max_blocks, BS)
        if start_block != self.first_block:
            return []
        end = min(max_blocks, self.first_block + REMOTE_BLOCKS)
        return [TierHit(hashes[i], "remote") for i in range(start_block, end)]

    def count_lookup(self, request: Request) -> None:
        self.counted.append(request.request_id)

    def on_allocated(self, request: Request, block_ids: list[int], hits: list[TierHit]) -> None:
        self.onloads.extend(zip(block_ids, hits))

    def build_meta(self, out: SchedulerOutput, requests: Mapping[str, Request]) -> dict[str, Any]:
        self.step += 1
        meta = {"step": self.step, "onloads": self.onloads, "scheduled": dict(out.num_scheduled_tokens)}
        self.onloads = []
        self.metas.append(meta)
        return meta

    def start_load(self, request: Request, num_device_blocks: int) -> bool:
        if "load" not in request.request_id:
            return False
        self.loading[request.request_id] = self.step + self.load_steps
        return True

    def finished_loading(self) -> list[str]:
        done = [rid for rid, at in self.loading.items() if at <= self.step]
        for rid in done:
            del self.loading[rid]
            self.loaded.add(rid)
        return done

    def request_finished(self, request: Request) -> bool:
        if "send" not in request.request_id:
            return False
        self.sending[request.request_id] = (self.step + self.send_steps, list(request.block_ids))
        return True

    def load_error(self, request_id: str) -> str | None:
        return "the fake failed" if self.fail else None

    def finished_sending(self) -> list[str]:
        done = [rid for rid, (at, _) in self.sending.items() if at <= self.step]
        for rid in done:
            del self.sending[rid]
        return done

    def forget(self, request_id: str) -> None:
        self.forgotten.append(request_id)


def _sched(**kw):
    s = make_sched(**kw)
    s.connector = FakeConnector()
    return s, s.connector


def test_a_request_waits_for_its_remote_kv_then_starts_with_it():
    s, conn = _sched()
    r = req("load-a", 3 * BS + 1, max_tokens=4)
    s.add_request(r)
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KV and s.num_loading == 1
    for _ in range(LOAD_STEPS):
        out = step(s)
        assert not out.num_scheduled_tokens and r.status == RequestStatus.WAITING_FOR_REMOTE_KV
    out = step(s)  # finished_loading names it at the start of this step: scheduled at once
    assert out.num_scheduled_tokens == {"load-a": BS + 1}  # the loaded blocks are not computed
    meta = out.kv_connector_meta
    assert meta is conn.metas[-1] and meta["scheduled"] == {"load-a": BS + 1}
    assert [b for b, _ in meta["onloads"]] == r.block_ids[:REMOTE_BLOCKS]
    assert [h.block_hash for _, h in meta["onloads"]] == compute_block_hashes(r, REMOTE_BLOCKS, BS)[:REMOTE_BLOCKS]
    assert r.num_cached_tokens == REMOTE_BLOCKS * BS
    assert r.num_cached_tokens_by_tier == {DEVICE_TIER: 0, "remote": REMOTE_BLOCKS * BS}
    assert conn.counted == ["load-a"]
    while s.has_unfinished_requests():
        step(s)
    assert r.output_token_ids == expected_output(r.prompt_token_ids, 4)
    assert conn.forgotten == ["load-a"] and s.kv.num_used_blocks == 0


def test_a_waiting_request_does_not_hold_back_others_and_can_be_aborted():
    s, conn = _sched()
    waiting, other = req("load-x", 2 * BS + 2), req("plain", 5, start=50)
    s.add_request(waiting)
    s.add_request(other)
    out = step(s)
    assert list(out.num_scheduled_tokens) == ["plain"]
    s.finish_requests(["load-x"], RequestStatus.FINISHED_ABORTED)
    assert "load-x" in conn.forgotten and s.num_loading == 0
    while s.has_unfinished_requests():
        step(s)
    assert s.kv.num_used_blocks == 0 and not s.held


def test_finished_requests_keep_their_blocks_until_sent():
    s, conn = _sched()
    sent, plain = req("send-a", 2 * BS + 1, max_tokens=2), req("plain", 2 * BS + 1, max_tokens=2, start=40)
    s.add_request(sent)
    s.add_request(plain)
    while sent.status != RequestStatus.FINISHED_LENGTH:
        step(s)
    blocks = conn.sending["send-a"][1]
    assert blocks and s.held == {"send-a": sent} and "send-a" not in s.requests
    assert sent.block_ids == blocks  # nothing freed: the connector still reads them
    assert "send-a" not in conn.forgotten
    s.kv.check_integrity(s.block_holders())
    while "plain" in s.requests:
        step(s)
    assert s.has_unfinished_requests()  # the engine keeps stepping until the blocks are sent
    while s.has_unfinished_requests():
        step(s)
    assert not s.held and "send-a" in conn.forgotten and s.kv.num_used_blocks == 0
    assert sent.output_token_ids == expected_output(sent.prompt_token_ids, 2)


def _multi(*parts: FakeConnector):
    for i, c in enumerate(parts):
        c.name = f"fake{i}"
    s = make_sched()
    s.connector = MultiConnector(list(parts))
    return s


def test_multi_connector_loads_from_each_in_turn_and_holds_until_all_sent():
    a, b = FakeConnector(0, load_steps=2, send_steps=1), FakeConnector(REMOTE_BLOCKS, load_steps=4, send_steps=3)
    s = _multi(a, b)
    r = req("load-send", 5 * BS + 1, max_tokens=2)
    s.add_request(r)
    for _ in range(4):  # a has finished, b not yet: it still waits
        assert not step(s).num_scheduled_tokens and r.status == RequestStatus.WAITING_FOR_REMOTE_KV
    out = step(s)
    assert out.num_scheduled_tokens == {"load-send": BS + 1}  # 4 blocks loaded: 2 from each
    meta_a, meta_b = out.kv_connector_meta["fake0"], out.kv_connector_meta["fake1"]
    assert [blk for blk, _ in meta_a["onloads"]] == r.block_ids[:2]
    assert [blk for blk, _ in meta_b["onloads"]] == r.block_ids[2:4]
    assert r.num_cached_tokens_by_tier == {DEVICE_TIER: 0, "remote": 4 * BS}
    while r.status != RequestStatus.FINISHED_LENGTH:
        step(s)
    held_steps = 0
    while s.has_unfinished_requests():
        assert s.held == {"load-send": r}
        step(s)
        held_steps += 1
    assert held_steps == 4  # b's 3 steps, then the step that frees it
    assert s.kv.num_used_blocks == 0 and "load-send" in a.forgotten and "load-send" in b.forgotten
    assert r.output_token_ids == expected_output(r.prompt_token_ids, 2)


def test_multi_connector_fails_a_request_whose_load_failed():
    s = _multi(FakeConnector(0, load_steps=1), FakeConnector(REMOTE_BLOCKS, load_steps=2, fail=True))
    r = req("load-bad", 5 * BS + 1)
    s.add_request(r)
    while s.has_unfinished_requests():
        step(s)
    assert s.take_failed() == {"load-bad": "the fake failed"}
    assert r.status == RequestStatus.FINISHED_ABORTED and s.kv.num_used_blocks == 0
