"""End-to-end greedy parity with HF transformers on tiny random models, under every
cache and scheduling configuration that changes how K/V are computed and reused."""

from __future__ import annotations

import random

import pytest

from kvserve import LLM, SamplingParams
from tests.conftest import assert_greedy_parity, hf_greedy

MAX_NEW = 12
ARCHS = ["llama", "llama3", "mistral", "qwen2", "qwen3"]


def prompts_mixed() -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(2, 300) for _ in range(37)]  # > 2 blocks of 16, shared by some prompts
    out = [[rng.randrange(2, 300) for _ in range(n)] for n in (1, 5, 16, 33, 70)]
    out += [shared + [rng.randrange(2, 300) for _ in range(n)] for n in (3, 20)]
    return out


@pytest.fixture(scope="module")
def references(tiny_model_factory):
    cache = {}

    def get(arch):
        if arch not in cache:
            path = tiny_model_factory(arch)
            cache[arch] = (path, hf_greedy(path, prompts_mixed(), MAX_NEW))
        return cache[arch]

    return get


def run(path, **kw):
    llm = LLM(model=str(path), dtype="float32", check_integrity=True, **kw)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0, logprobs=5, ignore_eos=True)
    prompts = prompts_mixed()
    first = llm.generate(prompts, params, use_tqdm=False)
    # A second pass over the same prompts exercises prefix-cache hits.
    second = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.kv.num_used_blocks == 0
    return llm, first, second


@pytest.mark.parametrize("arch", ARCHS)
def test_parity_default(arch, references):
    path, ref = references(arch)
    llm, first, second = run(path, num_kv_blocks=256)
    assert_greedy_parity(first, ref)
    assert_greedy_parity(second, ref)
    assert sum(o.num_cached_tokens for o in second) > 0


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("mode", ["hash", "radix", "off"])
def test_parity_prefix_cache_modes(arch, mode, references):
    path, ref = references(arch)
    kw = {"enable_prefix_caching": False} if mode == "off" else {"prefix_cache": mode}
    llm, first, second = run(path, num_kv_blocks=256, **kw)
    assert_greedy_parity(first, ref)
    assert_greedy_parity(second, ref)
    cached = [o.num_cached_tokens for o in second]
    if mode == "off":
        assert cached == [0] * len(cached)
    else:
        # Every prompt of at least one block + 1 token is served from the cache the second time.
        for o in second:
            assert o.num_cached_tokens == (len(o.prompt_token_ids) - 1) // 16 * 16


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_parity_tiny_chunks(arch, references):
    path, ref = references(arch)
    _, first, second = run(path, num_kv_blocks=256, max_num_batched_tokens=7)
    assert_greedy_parity(first, ref)
    assert_greedy_parity(second, ref)


@pytest.mark.parametrize("arch", ["llama", "mistral"])
@pytest.mark.parametrize("prefix", ["hash", "radix"])
def test_parity_forced_preemption(arch, prefix, references):
    path, ref = references(arch)
    # 8 blocks of 16 = 128 tokens; the longest request alone needs 6 blocks.
    llm, first, second = run(path, num_kv_blocks=8, prefix_cache=prefix)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_greedy_parity(first, ref)
    assert_greedy_parity(second, ref)
