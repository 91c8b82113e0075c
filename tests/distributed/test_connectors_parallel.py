"""The KV connectors under tensor and pipeline parallelism (the `mp` executor): a block's K/V span
every rank (layers across stages, KV heads across tensor-parallel ranks), so what the KV tiers
keep and what a prefill engine sends must come back whole into ranks of another layout. Outputs
equal one rank's without any connector."""

from __future__ import annotations

import random

import pytest

from kvserve import LLM, SamplingParams
from tests.disagg.test_pd_engine import idle, with_key
from tests.distributed.test_parallel import assert_same_greedy

pytestmark = pytest.mark.slow

BS = 16
ENTRY = 8192 + 512  # one tiny-llama block in fp32 (2 layers x K,V x 16 x 2 heads x 16 dims x 4 B) + header
PARAMS = SamplingParams(max_tokens=6, temperature=0, logprobs=5, ignore_eos=True)
LAYOUTS = [(2, 1), (1, 2)]


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(length)] for _ in range(n)]


PROMPTS = _prompts(4, 81, seed=11)  # 5 full blocks each


def _llm(model_dir, tp: int = 1, pp: int = 1, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 12)
    return LLM(model=str(model_dir), dtype="float32", block_size=BS, check_integrity=True,
               tensor_parallel_size=tp, pipeline_parallel_size=pp, **kw)


def _run(llm: LLM, prompts, params: SamplingParams = PARAMS):
    return [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def reference(model_dir):
    llm = _llm(model_dir, num_kv_blocks=64)
    try:
        return _run(llm, PROMPTS)
    finally:
        llm.close()


@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_tiers_ram_and_disk_under_parallelism_match_one_rank(model_dir, reference, tmp_path, tp, pp):
    disk = str(tmp_path / "kv")
    llm = _llm(model_dir, tp, pp, kv_offload_cpu=3 * ENTRY, kv_offload_disk=disk)
    try:
        first = _run(llm, PROMPTS)  # the pool holds two prompts: the first ones go down to RAM, then disk
        llm.engine.tiers.flush()
        again = _run(llm, PROMPTS[:1])[0]
        split = again.num_cached_tokens_by_tier
        assert split.get("cpu", 0) + split.get("disk", 0) >= 4 * BS, split
        assert_same_greedy(first + [again], reference + reference[:1])
    finally:
        llm.close()  # what the device still caches is saved to disk
    restarted = _llm(model_dir, tp, pp, kv_offload_disk=disk)
    try:
        out = _run(restarted, PROMPTS[-1:])[0]
        assert out.num_cached_tokens_by_tier.get("disk", 0) >= 4 * BS, out.num_cached_tokens_by_tier
        assert_same_greedy([out], reference[-1:])
    finally:
        restarted.close()


def test_pd_transfer_between_a_tp2_prefill_and_a_pp2_decode_engine(model_dir, reference):
    """The whole block travels, so a prefill engine and a decode engine of other layouts meet."""
    p = LLM(**with_key(dict(model=str(model_dir), dtype="float32", block_size=BS, num_kv_blocks=64,
                            check_integrity=True, tensor_parallel_size=2, kv_role="prefill")))
    d = LLM(**with_key(dict(model=str(model_dir), dtype="float32", block_size=BS, num_kv_blocks=64,
                            check_integrity=True, pipeline_parallel_size=2, kv_role="decode")))
    try:
        send = SamplingParams(temperature=0, max_tokens=1, extra_args={"kv_transfer_params": {"do_remote_decode": True}})
        transfer = [o.kv_transfer_params for o in _run(p, PROMPTS, send)]
        idle(p)
        outs = []
        for prompt, t in zip(PROMPTS, transfer):
            params = SamplingParams(max_tokens=6, temperature=0, logprobs=5, ignore_eos=True,
                                    extra_args={"kv_transfer_params": t})
            outs += _run(d, [prompt], params)
        idle(d)
        assert all(o.num_cached_tokens_by_tier.get("kv_transfer", 0) == 5 * BS for o in outs), \
            [o.num_cached_tokens_by_tier for o in outs]
        assert_same_greedy(outs, reference)
    finally:
        p.close()
        d.close()


SEP = " # # "
DOCS = ["The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog.",
        "Paged attention stores keys and values in fixed-size blocks. Prefix caching reuses the KV cache.",
        "Continuous batching lets requests join and leave every step. Paged attention stores keys."]
BLEND = dict(dtype="float32", block_size=4, num_kv_blocks=400, check_integrity=True, enable_blending=True,
             blend_max_deviation=1e9)  # a random model's K/V deviate wildly: the guard would recompute all


def _rag(order, question: str) -> str:
    return "Notes for the answer." + SEP + SEP.join(DOCS[i] for i in order) + SEP + question


def _blend_runs(llm: LLM) -> list:
    """Chunks computed on their own first, then reused (in another order) at several recompute
    ratios and check layers: before, in and after a stage of a 4-layer model split in two."""
    outs = []
    runs = [((0, 1, 2), 0.0, 1), ((1, 2, 0), 0.3, 1), ((2, 0, 1), 0.3, 2), ((2, 1, 0), 0.5, 0), ((0, 2, 1), 1.0, 1)]
    for order, ratio, check in runs:
        params = SamplingParams(temperature=0, max_tokens=6, logprobs=5, ignore_eos=True,
                                extra_args={"blend": {"recompute_ratio": ratio, "check_layer": check}})
        outs += llm.generate([_rag(order, f"Question {ratio} {check}: what")], params, use_tqdm=False)
    return outs


@pytest.fixture(scope="module")
def blend_model(tmp_path_factory):
    from tests.conftest import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-blend-4"), "llama", num_hidden_layers=4))


@pytest.fixture(scope="module")
def blend_reference(blend_model):
    llm = LLM(blend_model, **BLEND)
    try:
        return _blend_runs(llm)
    finally:
        llm.close()


@pytest.mark.parametrize("tp,pp", LAYOUTS)
def test_blending_under_parallelism_matches_one_rank(blend_model, blend_reference, tp, pp):
    """Every rank runs the same plan on its heads and layers and adds its share of the measures
    that pick tokens: the same tokens are recomputed (the usage split) and the outputs match."""
    llm = LLM(blend_model, tensor_parallel_size=tp, pipeline_parallel_size=pp, **BLEND)
    try:
        outs = _blend_runs(llm)
        assert llm.engine.stats()["kv_blocks_used"] == 0
    finally:
        llm.close()
    for out, ref in zip(outs, blend_reference):
        assert out.num_cached_tokens_by_tier == ref.num_cached_tokens_by_tier
        assert out.num_cached_tokens_by_tier["recomputed"] > 0
    assert_same_greedy(outs, blend_reference)
