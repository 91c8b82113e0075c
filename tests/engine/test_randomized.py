"""Randomized engine runs: whatever the budget, pool size, prefix cache and arrival
pattern, greedy outputs equal those of a plain run, and no block leaks."""

from __future__ import annotations

import random

import pytest

from kvserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def reference_llm(tiny_model_factory):
    return LLM(model=str(tiny_model_factory("qwen2")), dtype="float32", num_kv_blocks=512,
               enable_prefix_caching=False, max_num_batched_tokens=4096)


def workload(rng: random.Random):
    shared = [rng.randrange(3, 300) for _ in range(rng.randrange(10, 60))]
    reqs = []
    for _ in range(rng.randrange(4, 10)):
        tail = [rng.randrange(3, 300) for _ in range(rng.randrange(1, 40))]
        prompt = shared + tail if rng.random() < 0.6 else tail
        params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=rng.randrange(1, 12),
                                n=rng.choice([1, 1, 2]))
        reqs.append((prompt, params))
    return reqs


def run_random(seed: int, reference_llm, model_dir) -> int:
    """One randomized run checked against the plain run; returns its preemption count."""
    rng = random.Random(seed)
    reqs = workload(rng)
    expected = {}
    for i, (prompt, params) in enumerate(reqs):
        out = reference_llm.generate([prompt], params, use_tqdm=False)[0]
        expected[i] = [c.token_ids for c in out.outputs]
    block_size = rng.choice([4, 16])
    # From just enough for the largest request (forcing preemption) to plenty.
    need = max(-(-(len(p) + sp.max_tokens) // block_size) for p, sp in reqs)
    llm = LLM(model=str(model_dir), dtype="float32", check_integrity=True,
              num_kv_blocks=need + rng.choice([0, 3, 200]), block_size=block_size,
              max_num_batched_tokens=rng.choice([3, 7, 64]), max_num_seqs=rng.choice([2, 4, 32]),
              prefix_cache=rng.choice(["hash", "radix"]), max_model_len=256)
    eng = llm.engine
    pending = list(enumerate(reqs))
    ids: dict[str, int] = {}
    results = {}
    # Requests arrive over time, while others are mid-flight.
    while pending or eng.has_unfinished_requests():
        for _ in range(rng.randrange(0, 3)):
            if pending:
                i, (prompt, params) = pending.pop(0)
                ids[eng.add_request(None, prompt, params)] = i
        for out in eng.step():
            if out.finished:
                results[ids[out.request_id]] = [c.token_ids for c in out.outputs]
    assert results == expected
    assert eng.kv.num_used_blocks == 0
    return eng.scheduler.num_preemptions


@pytest.mark.parametrize("seed", range(10))
def test_random_configs_match_plain_run(seed, reference_llm, tiny_model_factory):
    run_random(seed, reference_llm, tiny_model_factory("qwen2"))


def test_random_runs_do_preempt(reference_llm, tiny_model_factory):
    """The workload above is only a stress test if some runs actually run out of blocks."""
    assert sum(run_random(s, reference_llm, tiny_model_factory("qwen2")) for s in range(10, 14)) > 0
