"""Scheduler behaviour against a fake model: budget, ordering, preemption, n > 1 forks."""

from __future__ import annotations

import pytest

from kvserve.config import SchedulerConfig
from kvserve.core.kv_manager import KVCacheManager
from kvserve.core.sched_output import SchedulerOutput
from kvserve.core.scheduler import Scheduler
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import SamplingParams

BS = 4


def fake_token(tokens: list[int]) -> int:
    """A deterministic 'model': the next token depends on the whole context."""
    return (sum(t * (i + 1) for i, t in enumerate(tokens)) % 97) + 3


def make_sched(num_blocks=64, budget=16, max_seqs=8, max_len=256, prefix="hash", caching=True, share=0.5):
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=caching, prefix_cache=prefix)
    return Scheduler(SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                                     max_model_len=max_len, short_prompt_share=share), kv)


def req(rid: str, n_prompt: int, max_tokens: int = 5, start: int = 1, priority: int = 0,
        arrival: float | None = None, **kw) -> Request:
    params = SamplingParams(max_tokens=max_tokens, **kw)
    return Request(rid, [start + i for i in range(n_prompt)], params, eos_token_id=None,
                   arrival_time=arrival, priority=priority, max_tokens=max_tokens)


def step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    sampled = {}
    for rid in out.num_scheduled_tokens:
        r = s.requests[rid]
        if r.num_computed_tokens == r.num_tokens:  # reached its end: the model samples
            sampled[rid] = [fake_token(r.all_token_ids)]
    s.update(out, sampled)
    s.kv.check_integrity(s.block_holders())
    return out


def run_all(s: Scheduler, reqs: list[Request], max_steps=1000) -> list[SchedulerOutput]:
    for r in reqs:
        s.add_request(r)
    outs = []
    while s.has_unfinished_requests():
        outs.append(step(s))
        assert len(outs) < max_steps, "scheduler made no progress"
    assert s.kv.num_used_blocks == 0
    return outs


def expected_output(prompt: list[int], n: int) -> list[int]:
    toks = list(prompt)
    for _ in range(n):
        toks.append(fake_token(toks))
    return toks[len(prompt):]


@pytest.mark.parametrize("prefix", ["hash", "radix"])
def test_budget_respected_and_outputs_right(prefix):
    s = make_sched(budget=7, prefix=prefix)
    reqs = [req(f"r{i}", 5 + 9 * i, max_tokens=6, start=10 * i) for i in range(5)]
    outs = run_all(s, reqs)
    for o in outs:
        assert 0 < o.total_num_scheduled_tokens <= 7
        assert len(o.num_scheduled_tokens) <= 8
    for r in reqs:
        assert r.status == RequestStatus.FINISHED_LENGTH
        assert r.output_token_ids == expected_output(r.prompt_token_ids, 6)


def test_decodes_not_starved_by_long_prompt():
    s = make_sched(budget=8)
    short = [req(f"s{i}", 3, max_tokens=20, start=i) for i in range(3)]
    for r in short:
        s.add_request(r)
    step(s)  # the three short prompts prefill together (9 > 8: one is chunked)
    step(s)
    assert all(r.status == RequestStatus.RUNNING and r.num_output_tokens >= 1 for r in short)
    s.add_request(req("long", 100, max_tokens=2, start=50))
    for _ in range(10):
        out = step(s)
        for r in short:
            if not r.is_finished:
                assert out.num_scheduled_tokens.get(r.request_id) == 1
        # the long prompt gets only what is left of the budget
        assert out.num_scheduled_tokens.get("long", 0) <= 8 - sum(
            1 for r in short if r.request_id in out.num_scheduled_tokens)


def test_long_prompt_is_chunked():
    s = make_sched(budget=7)
    r = req("a", 30, max_tokens=2)
    s.add_request(r)
    chunks = []
    while r.num_output_tokens == 0:
        chunks.append(step(s).num_scheduled_tokens["a"])
    assert chunks == [7, 7, 7, 7, 2]


def test_priority_and_fcfs_order():
    s = make_sched(budget=100, max_seqs=1)
    a = req("a", 4, arrival=1.0)
    b = req("b", 4, arrival=2.0, priority=-1)  # lower value = served first
    c = req("c", 4, arrival=0.5)
    for r in (a, b, c):
        s.add_request(r)
    order = []
    while s.has_unfinished_requests():
        out = step(s)
        for d in out.new_reqs:
            order.append(d.req_id)
    assert order == ["b", "c", "a"]


@pytest.mark.parametrize("prefix", ["hash", "radix"])
def test_preemption_newest_first_and_same_output(prefix):
    # 10 blocks of 4 tokens; three requests that each grow to 24 tokens cannot all fit.
    s = make_sched(num_blocks=10, budget=64, prefix=prefix)
    reqs = [req(f"r{i}", 8, max_tokens=16, start=20 * i, arrival=float(i)) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    first_victim = None
    while s.has_unfinished_requests():
        out = step(s)
        if out.preempted_req_ids and first_victim is None:
            first_victim = sorted(out.preempted_req_ids)[-1]
    assert s.num_preemptions > 0
    assert first_victim == "r2"  # the newest request goes first
    for r in reqs:
        assert r.output_token_ids == expected_output(r.prompt_token_ids, 16)
    assert s.kv.num_used_blocks == 0


def test_resumed_request_reuses_cached_prefix():
    s = make_sched(num_blocks=12, budget=64)
    reqs = [req(f"r{i}", 16, max_tokens=16, start=30 * i, arrival=float(i)) for i in range(2)]
    run_all(s, reqs)
    assert any(r.num_preemptions for r in reqs)
    assert s.kv.prefix_cache_hits > 0


def test_n_samples_share_prompt_blocks():
    s = make_sched(num_blocks=64, budget=64, caching=False)
    leader = req("p#0", 10, max_tokens=4)
    follower = req("p#1", 10, max_tokens=4)
    follower.leader_id = "p#0"
    s.add_request(leader)
    s.add_request(follower)
    step(s)
    # (10 - 1) // 4 * 4 = 8 tokens = 2 full blocks are shared by reference.
    assert follower.block_ids[:2] == leader.block_ids[:2]
    assert follower.block_ids[2] != leader.block_ids[2]
    while s.has_unfinished_requests():
        step(s)
    assert follower.output_token_ids == leader.output_token_ids  # same fake model, same context
    assert s.kv.num_used_blocks == 0


def test_abort_frees_blocks():
    s = make_sched()
    r = req("a", 10, max_tokens=50)
    s.add_request(r)
    step(s)
    assert s.kv.num_used_blocks > 0
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert s.kv.num_used_blocks == 0
    assert not s.has_unfinished_requests()
    assert "a" in s.schedule().finished_req_ids


def test_hit_rate_counts_a_request_waiting_for_room_once():
    """A request that cannot get blocks looks up the prefix cache again each step; the hit-rate
    counters take it once, when it is scheduled (and again only after a preemption)."""
    s = make_sched(num_blocks=7, budget=64)  # 7 blocks of 4: r1's 4 prompt blocks wait until r0 is done
    reqs = [req(f"r{i}", 16, max_tokens=8, start=40 * i, arrival=float(i)) for i in range(2)]
    outs = run_all(s, reqs)
    assert len(outs) > 10 and not any(r.num_preemptions for r in reqs)
    assert s.kv.prefix_cache_queries == 2 * 16


def first_token_step(s: Scheduler, r: Request, max_steps=100) -> int:
    for i in range(max_steps):
        step(s)
        if r.num_output_tokens:
            return i
    raise AssertionError(f"{r.request_id} got no token in {max_steps} steps")


@pytest.mark.parametrize("share", [0.5, 0.0])
def test_short_prompt_does_not_wait_for_a_long_prompts_chunks(share):
    """A long prompt being prefilled leaves short_prompt_share of the budget to a short prompt
    that can finish in it: its first token comes in the next step, not after all the chunks."""
    s = make_sched(budget=16, share=share)
    long = req("long", 120, max_tokens=2, start=1)
    s.add_request(long)
    assert step(s).num_scheduled_tokens == {"long": 16}
    short = req("short", 6, max_tokens=2, start=200)
    s.add_request(short)
    out = step(s)
    if share:
        assert out.num_scheduled_tokens == {"long": 10, "short": 6}
        assert short.num_output_tokens == 1
    else:
        assert out.num_scheduled_tokens == {"long": 16}
        assert first_token_step(s, short) > 4
    run_all(s, [])
    assert long.output_token_ids == expected_output(long.prompt_token_ids, 2)
    assert short.output_token_ids == expected_output(short.prompt_token_ids, 2)


def test_long_prompt_keeps_the_rest_of_the_budget():
    """A stream of short prompts takes at most the share; the long one still advances every step."""
    s = make_sched(budget=16, max_seqs=64, num_blocks=256)
    long = req("long", 100, max_tokens=1, start=1)
    s.add_request(long)
    step(s)
    for i in range(6):
        s.add_request(req(f"s{i}", 4, max_tokens=1, start=300 + 10 * i))
        s.add_request(req(f"t{i}", 4, max_tokens=1, start=600 + 10 * i))
        out = step(s)
        assert out.num_scheduled_tokens["long"] >= 8
        assert out.num_scheduled_tokens[f"s{i}"] == 4 and out.num_scheduled_tokens[f"t{i}"] == 4
    run_all(s, [])


def test_cached_prompt_counts_as_short():
    """What the prefix cache holds is not prefilled again: a long prompt whose prefix is cached
    needs only its tail, and goes ahead of an uncached long prompt being chunked."""
    s = make_sched(budget=16, num_blocks=128)
    first = req("first", 60, max_tokens=1, start=1)
    run_all(s, [first])
    s.add_request(req("long", 120, max_tokens=1, start=500))
    step(s)
    again = req("again", 63, max_tokens=1, start=1)  # first's 60 tokens (15 full blocks) + 3
    s.add_request(again)
    out = step(s)
    assert out.num_scheduled_tokens["again"] == 3
    assert out.num_scheduled_tokens["long"] == 16 - 3
    run_all(s, [])


def test_short_prompts_keep_priority_order():
    """Only waiting requests of the first waiting priority go ahead: a short prompt of a later
    priority does not pass a long one of an earlier priority."""
    s = make_sched(budget=16, max_seqs=8)
    s.add_request(req("long", 100, max_tokens=1, start=1, priority=0))
    s.add_request(req("short", 4, max_tokens=1, start=300, priority=1))
    out = step(s)
    assert out.num_scheduled_tokens == {"long": 16}
    assert [r.request_id for r in s.waiting] == ["short"]
    run_all(s, [])


def test_waiting_order_restored_after_short_prompts_go_first():
    s = make_sched(budget=8, max_seqs=3)
    reqs = [req("a", 40, arrival=1.0), req("b", 40, arrival=2.0), req("c", 3, arrival=3.0),
            req("d", 40, arrival=4.0), req("e", 3, arrival=5.0)]
    for r in reqs:
        s.add_request(r)
    out = step(s)
    assert out.num_scheduled_tokens == {"c": 3, "a": 5}  # e does not fit in the share beside c
    assert [r.request_id for r in s.waiting] == ["b", "d", "e"]
    run_all(s, [])
    for r in reqs:
        assert r.output_token_ids == expected_output(r.prompt_token_ids, 5)


def test_short_prompt_share_must_be_below_one():
    for bad in (1.0, -0.1, "half", True):
        with pytest.raises(ValueError, match="short_prompt_share"):
            SchedulerConfig(short_prompt_share=bad)
