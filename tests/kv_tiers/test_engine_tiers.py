"""KV tiers in the engine: blocks evicted from a deliberately tiny device pool go to host RAM
and disk, come back on a later hit, and the outputs equal a full recompute."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from kvserve.request import RequestStatus
from tests.conftest import assert_greedy_parity, hf_greedy

BS = 16
ENTRY = 8192 + 512  # one tiny-llama block in fp32 (2 layers x K,V x 16 x 2 heads x 16 dims x 4 B) + header


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(length)] for _ in range(n)]


def _llm(model_dir: Path, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 12)
    return LLM(model=str(model_dir), dtype="float32", block_size=BS, check_integrity=True, **kw)


GREEDY = SamplingParams(max_tokens=6, temperature=0, logprobs=5)


def _run(llm: LLM, prompts: list[list[int]]):
    return [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]


def _saved_to_disk(model_dir: Path, disk: str, prompt: list[int]):
    """Run `prompt` on an engine with a disk tier and stop it: its blocks are saved to disk."""
    llm = _llm(model_dir, num_kv_blocks=64, kv_offload_disk=disk)
    try:
        return _run(llm, [prompt])[0]
    finally:
        llm.close()  # blocks still on the device are saved to disk at shutdown


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama")


def test_evicted_blocks_go_to_ram_then_disk_and_come_back(model_dir, tmp_path):
    target, *others = _prompts(5, 81, seed=1)  # 5 full blocks each; the pool holds 12
    llm = _llm(model_dir, kv_offload_cpu=3 * ENTRY, kv_offload_disk=str(tmp_path / "kv"),
               kv_offload_disk_size="1MiB")
    try:
        first = _run(llm, [target])[0]
        _run(llm, others)  # evicts the target's blocks: to RAM first, then on to disk as RAM fills
        llm.engine.tiers.flush()
        stats = llm.stats()
        assert stats["kv_tier_cpu_entries"] == 3 and stats["kv_tier_disk_entries"] > 0
        assert stats["kv_tier_cpu_bytes_offloaded"] > 0 and stats["kv_tier_disk_bytes_offloaded"] > 0
        again = _run(llm, [target])[0]
        split = again.num_cached_tokens_by_tier
        assert again.num_cached_tokens == sum(split.values()) == 5 * BS
        assert split.get("cpu", 0) + split.get("disk", 0) > 0, split
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        assert_greedy_parity([again], hf_greedy(model_dir, [target], 6))
        assert llm.stats()["kv_tier_bytes_onloaded"] > 0
    finally:
        llm.close()


def test_disk_admission_takes_only_blocks_hit_in_ram(model_dir, tmp_path):
    """--kv-offload-disk-min-hits 1: a block leaving host RAM goes to disk only if it was hit there."""
    hot, *others = _prompts(6, 81, seed=7)
    llm = _llm(model_dir, kv_offload_cpu=5 * ENTRY, kv_offload_disk=str(tmp_path / "kv"),
               kv_offload_disk_min_hits=1)
    try:
        _run(llm, [hot])
        _run(llm, others[:2])  # the hot prompt's blocks go to RAM
        assert _run(llm, [hot])[0].num_cached_tokens_by_tier.get("cpu", 0) > 0  # a hit in RAM
        _run(llm, others[2:])  # RAM overflows: cold blocks are dropped, the hit ones go to disk
        llm.engine.tiers.flush()
        s = llm.stats()
        assert 0 < s["kv_tier_disk_entries"] < s["kv_tier_cpu_bytes_offloaded"] // ENTRY
        for f in (tmp_path / "kv").rglob("*.kv"):
            assert f.stat().st_size < ENTRY
    finally:
        llm.close()


def test_disk_tier_survives_restart(model_dir, tmp_path):
    prompt = _prompts(1, 70, seed=2)[0]
    disk = str(tmp_path / "kv")
    first = _saved_to_disk(model_dir, disk, prompt)
    llm = _llm(model_dir, num_kv_blocks=64, kv_offload_disk=disk)
    try:
        again = _run(llm, [prompt])[0]
        assert again.num_cached_tokens_by_tier.get("disk") == 4 * BS
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
    finally:
        llm.close()


def test_corrupt_and_truncated_disk_entries_are_skipped_and_deleted(model_dir, tmp_path):
    prompt = _prompts(1, 70, seed=3)[0]
    disk = tmp_path / "kv"
    first = _saved_to_disk(model_dir, str(disk), prompt)
    files = sorted(disk.rglob("*.kv"))
    assert len(files) == 4
    for f in files[:2]:  # damage two of the four blocks, whichever they are
        raw = bytearray(f.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        f.write_bytes(raw)
    files[2].write_bytes(files[2].read_bytes()[:100])
    llm = _llm(model_dir, num_kv_blocks=64, kv_offload_disk=str(disk))
    try:
        again = _run(llm, [prompt])[0]
        assert again.outputs[0].token_ids == first.outputs[0].token_ids
        assert again.num_cached_tokens < 4 * BS  # the chain stops at the first damaged block
        assert sum(1 for f in files[:3] if f.exists()) < 3  # what was read and found bad is gone
    finally:
        llm.close()


def test_disk_at_its_size_limit_still_correct(model_dir, tmp_path):
    prompts = _prompts(6, 50, seed=4)
    ref = _run(_llm(model_dir, num_kv_blocks=64), prompts)
    llm = _llm(model_dir, num_kv_blocks=8, kv_offload_cpu=2 * ENTRY, kv_offload_disk=str(tmp_path / "kv"),
               kv_offload_disk_size=3 * ENTRY)
    try:
        for _ in range(2):
            outs = _run(llm, prompts)
            assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
        llm.engine.tiers.flush()
        assert llm.stats()["kv_tier_disk_bytes_used"] <= 3 * ENTRY
    finally:
        llm.close()


def test_many_requests_offloading_and_onloading_at_once(model_dir, tmp_path):
    """Shared prefixes, a pool far smaller than the working set, n > 1, preemption: the
    integrity checks run every step and greedy outputs equal a plain run's."""
    rng = random.Random(5)
    bases = _prompts(4, 48, seed=6)
    prompts = [rng.choice(bases) + [rng.randrange(3, 300) for _ in range(rng.randrange(1, 30))]
               for _ in range(24)]
    params = [SamplingParams(max_tokens=rng.randrange(2, 10), temperature=0, n=rng.choice([1, 1, 2]))
              for _ in prompts]
    ref = _llm(model_dir, num_kv_blocks=256).generate(prompts, params, use_tqdm=False)
    llm = _llm(model_dir, num_kv_blocks=14, kv_offload_cpu=10 * ENTRY, kv_offload_disk=str(tmp_path / "kv"),
               max_num_seqs=6)
    try:
        for _ in range(2):
            outs = llm.generate(prompts, params, use_tqdm=False)
            assert [[c.token_ids for c in o.outputs] for o in outs] == [[c.token_ids for c in o.outputs]
                                                                      for o in ref]
        s = llm.stats()
        assert s["kv_tier_cpu_hits"] > 0 and s["kv_blocks_used"] == 0
    finally:
        llm.close()


def test_aborting_a_request_while_its_kv_is_fetched_leaves_nothing_staged(model_dir, tmp_path):
    prompt = _prompts(1, 70, seed=8)[0]
    disk = str(tmp_path / "kv")
    _saved_to_disk(model_dir, disk, prompt)  # the prompt's blocks are now on disk only
    llm = _llm(model_dir, num_kv_blocks=64, kv_offload_disk=disk)
    try:
        eng, tiers = llm.engine, llm.engine.tiers
        eng.add_request("gone", prompt, GREEDY)
        assert eng.scheduler.requests["gone"].status == RequestStatus.WAITING_FOR_REMOTE_KV  # the disk prefetch
        eng.abort_request("gone")
        worker = eng.executor.runner.connector_roles["tiers"]  # the output rank's worker role
        worker.store.join_reads()  # the fetch has finished (it may have run before or after the abort)
        eng.step()  # the abort's cancel reaches the worker
        loads = worker._loads
        assert not loads._results and not loads._running and not loads._cancelled
        assert not tiers._fetching and not tiers._staged
        again = _run(llm, [prompt])[0]  # the entries are still on disk for the next request
        assert again.num_cached_tokens_by_tier.get("disk") == 4 * BS
    finally:
        llm.close()


def test_tiers_need_the_hash_prefix_cache(model_dir):
    with pytest.raises(ValueError, match="prefix-cache hash"):
        _llm(model_dir, prefix_cache="radix", kv_offload_cpu="1MiB")
    with pytest.raises(ValueError, match="prefix caching"):
        _llm(model_dir, enable_prefix_caching=False, kv_offload_cpu="1MiB")
    with pytest.raises(ValueError, match="kv_remote"):
        _llm(model_dir, kv_remote="http://nope")


@pytest.mark.parametrize("write_through", [None, False])
def test_remote_write_through_is_the_default_and_can_be_turned_off(model_dir, redis_server, write_through):
    """By default every newly computed full block goes to the shared store after its step, with
    nothing evicted; with kv_remote_write_through=False only evicted blocks go there."""
    extra = {} if write_through is None else {"kv_remote_write_through": write_through}
    llm = _llm(model_dir, num_kv_blocks=64, kv_remote=redis_server.url, **extra)
    try:
        _run(llm, _prompts(1, 70, seed=11))  # 4 full blocks, none evicted from the 64-block pool
        llm.engine.tiers.flush()
        stats = llm.stats()
        sent, entries = stats["kv_tier_remote_bytes_offloaded"], stats["kv_tier_remote_entries"]
        if write_through is None:
            assert entries == 4 and 4 * 8192 < sent < 4 * ENTRY, stats
        else:
            assert entries == 0 and sent == 0, stats
    finally:
        llm.close()


def test_tier_hit_rate_counts_a_request_waiting_for_room_once(model_dir):
    """A request whose blocks are in RAM but that must wait for room on the device looks the tiers
    up again every step; the tier's query and hit counters take it once, when it is scheduled."""
    target, *others = _prompts(4, 70, seed=21)  # 4 full blocks each; the pool holds 12
    llm = _llm(model_dir, kv_offload_cpu=64 * ENTRY)
    try:
        _run(llm, [target])
        _run(llm, others)  # the target's 4 full blocks go to RAM
        before = llm.stats()
        long = _prompts(1, 150, seed=22)[0]  # 10 of the 12 blocks: the target waits until it ends
        outs = llm.generate([long, target], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)
        assert outs[1].num_cached_tokens_by_tier.get("cpu") == 4 * BS
        after = llm.stats()
        queried = after["kv_tier_cpu_queries"] - before["kv_tier_cpu_queries"]
        hit = after["kv_tier_cpu_hits"] - before["kv_tier_cpu_hits"]
        assert hit == 4 * BS and queried == 4 * BS + BS, (queried, hit)  # + the long prompt's one miss
    finally:
        llm.close()


def test_an_idle_engine_waits_for_a_prefetch_inside_the_step(model_dir, tmp_path):
    """With only a disk prefetch to wait for, the engine does not sleep and poll: the step's plan
    asks the output rank's worker role to wait for the load (idle_wait_s), and a step with tokens
    scheduled never waits."""
    prompt = _prompts(1, 70, seed=9)[0]
    disk = str(tmp_path / "kv")
    _saved_to_disk(model_dir, disk, prompt)
    llm = _llm(model_dir, num_kv_blocks=64, kv_offload_disk=disk)
    try:
        eng = llm.engine
        worker = eng.executor.runner.connector_roles["tiers"]
        seen: list[tuple[float, bool]] = []
        after = worker.after_forward

        def spy(meta, runner):
            seen.append((meta.idle_wait_s, eng.scheduler.requests["p"].status == RequestStatus.RUNNING))
            after(meta, runner)

        worker.after_forward = spy
        eng.add_request("p", prompt, GREEDY)
        assert eng.scheduler.requests["p"].status == RequestStatus.WAITING_FOR_REMOTE_KV
        while eng.has_unfinished_requests():
            eng.step()
        assert seen[0][0] > 0  # the first step had nothing but the prefetch to wait for
        assert all(w == 0 for w, running in seen if running)  # the steps that compute never wait
    finally:
        llm.close()
