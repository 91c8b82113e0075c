"""kv_cache_dtype='bfloat16' for a float32 model, end to end on a tiny random llama: K/V rounded to
bfloat16 (8 significant bits) as they are written, computed in float32.

Stated tolerance (bfloat16 vs 'auto' float32 KV): every token's logprob within MAX_LP_DIFF and their
mean within MEAN_LP_DIFF. Measured on these prompts (a relative rounding error of at most 2^-9 per
K/V element): prompt logprobs max 0.0072, mean 0.0017, the same in one step, in chunks of 8 and one
token a step; greedy tokens 8 of 8 equal, their logprobs max 0.005. Greedy tokens may differ only
at a near-tie of 'auto's top two tokens (closer than 2 * MAX_LP_DIFF).
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.worker.model_runner import kv_bytes_per_block, resolve_kv_cache_dtype
from tests.worker.kv_dtype_common import BS, assert_greedy_close
from tests.worker.kv_dtype_common import engine as _llm
from tests.worker.kv_dtype_common import prompt_logprobs as _prompt_logprobs
from tests.worker.kv_dtype_common import prompts as _prompts

MAX_LP_DIFF = 0.05
MEAN_LP_DIFF = 0.01
GREEDY = SamplingParams(max_tokens=8, temperature=0, logprobs=5, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory) -> Path:
    return tiny_model_factory("llama")


def _assert_greedy_close(outs, auto_outs) -> int:
    return assert_greedy_close(outs, auto_outs, MAX_LP_DIFF, MEAN_LP_DIFF)


def test_the_cache_holds_bfloat16_and_the_same_memory_twice_the_tokens(model_dir):
    from transformers import AutoConfig

    memory = 8 * kv_bytes_per_block(AutoConfig.from_pretrained(model_dir), BS, torch.float32)
    auto = _llm(model_dir, "auto", num_kv_blocks=None, kv_cache_memory=memory)
    bf16 = _llm(model_dir, "bfloat16", num_kv_blocks=None, kv_cache_memory=memory)
    sa, sb = auto.stats(), bf16.stats()
    assert (sa["kv_blocks_total"], sb["kv_blocks_total"]) == (8, 16)
    assert (sa["kv_cache_dtype"], sb["kv_cache_dtype"]) == ("float32", "bfloat16")
    assert bf16.engine.dtype == torch.float32
    assert all(t.dtype == torch.bfloat16 for kv in bf16.engine.executor.runner.kv_caches for t in kv)


@pytest.mark.parametrize("budget", [2048, 8, 1])
def test_prompt_logprobs_close_to_auto_and_rounded(model_dir, budget):
    """Teacher-forced, so no sampled token can diverge. In one step per prompt (2048), in chunks of 8
    that read earlier chunks back, and one token a step through the decode kernel: within the
    stated tolerance, and measurably rounded (the prompt's own K/V too: a first chunk attends to
    them as the cache holds them)."""
    prompts = _prompts()
    auto = _prompt_logprobs(_llm(model_dir, "auto", max_num_batched_tokens=budget), prompts)
    bf16 = _prompt_logprobs(_llm(model_dir, "bfloat16", max_num_batched_tokens=budget), prompts)
    diffs = (torch.tensor(bf16) - torch.tensor(auto)).abs()
    assert len(diffs) == sum(len(p) - 1 for p in prompts)
    assert float(diffs.max()) < MAX_LP_DIFF and 0 < float(diffs.mean()) < MEAN_LP_DIFF, \
        (float(diffs.max()), float(diffs.mean()))


def test_greedy_generation_close_to_auto(model_dir):
    prompts = _prompts()
    auto = _llm(model_dir, "auto").generate(prompts, GREEDY, use_tqdm=False)
    bf16 = _llm(model_dir, "bfloat16").generate(prompts, GREEDY, use_tqdm=False)
    assert _assert_greedy_close(bf16, auto) >= 7


def test_prefix_cache_chunked_prefill_and_preemption(model_dir):
    """8 blocks of 16 for prompts of up to 5 blocks, chunks of 16 tokens, a shared prefix, run twice:
    preemptions happen, the second pass hits the prefix cache and gives the first pass's tokens,
    integrity holds every step."""
    rng = random.Random(3)
    shared = [rng.randrange(3, 300) for _ in range(37)]
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (5, 33, 70)]
    prompts += [shared + [rng.randrange(3, 300) for _ in range(n)] for n in (3, 20)]
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=5, ignore_eos=True)
    auto = _llm(model_dir, "auto", num_kv_blocks=8, max_num_batched_tokens=16).generate(prompts, params,
                                                                                         use_tqdm=False)
    llm = _llm(model_dir, "bfloat16", num_kv_blocks=8, max_num_batched_tokens=16)
    first, second = (llm.generate(prompts, params, use_tqdm=False) for _ in range(2))
    assert llm.engine.scheduler.num_preemptions > 0
    assert sum(o.num_cached_tokens for o in second) > 0
    assert llm.engine.kv.num_used_blocks == 0
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]
    _assert_greedy_close(first, auto)


def test_an_unknown_kv_cache_dtype_is_refused_by_name(model_dir):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, bfloat16, float32, got 'float16'"):
        _llm(model_dir, "float16")


def test_float32_kv_needs_a_float32_model(model_dir):
    with pytest.raises(ValueError, match=r"kv_cache_dtype='float32' needs a float32 model \(dtype\)"):
        _llm(model_dir, "float32", dtype="bfloat16")


@pytest.mark.parametrize("kv,dtype,kernels,device,want", [
    ("auto", torch.float32, True, "cpu", "bfloat16"),  # GGUF / int8 / AWQ / GPTQ linears in float32 kernels
    ("auto", torch.float32, False, "cpu", "auto"),  # a float32 model: its K/V as computed
    ("auto", torch.bfloat16, True, "cpu", "auto"),  # already 16 bits
    ("auto", torch.float32, True, "cuda", "auto"),  # the GPU kernels take the model's dtype
    ("float32", torch.float32, True, "cpu", "float32"),
    ("fp8", torch.float32, True, "cpu", "fp8"),
])
def test_auto_is_bfloat16_for_float32_kernels_on_a_cpu(kv, dtype, kernels, device, want):
    assert resolve_kv_cache_dtype(kv, dtype, kernels, device) == want


def test_a_gguf_keeps_bfloat16_kv_by_default_and_float32_on_request():
    """The engine decides 'auto' once and its rank allocates that cache; 'float32' keeps K/V as computed."""
    for kv, want in (("auto", torch.bfloat16), ("float32", torch.float32)):
        llm = LLM(dtype="float32", kv_cache_dtype=kv, num_kv_blocks=8)  # the default model: a GGUF
        runner = llm.engine.executor.worker.runner
        assert llm.engine.kv_dtype == runner.kv_dtype == want
        assert all(c.dtype == want for pair in runner.kv_caches for c in pair)
        assert llm.engine.cache_config.kv_cache_dtype == ("bfloat16" if kv == "auto" else "float32")
        out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
