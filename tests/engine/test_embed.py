"""LLM.embed: the final hidden states (after the final norm) pooled LAST or MEAN and L2-normalized,
against HF transformers on the same tiny weights, batched and chunked like any prefill."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve import LLM, PoolingParams, SamplingParams

# Our forward and HF's differ in kernel order (fused QKV, paged attention): float32 rounding only.
HF_ATOL = 1e-4
# The same prompt through the same engine, alone or among others, chunked or not: reassociation only.
SAME_ATOL = 1e-5


def prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(3, 300) for _ in range(n)] for n in (1, 7, 16, 33, 70)]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def hf_hidden(model_dir):
    """Final hidden states [T, hidden] of each prompt from HF (LlamaModel's last_hidden_state is after the norm)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return [model.model(torch.tensor([p])).last_hidden_state[0] for p in prompts()]


def make_llm(model_dir, **kw) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", num_kv_blocks=64, check_integrity=True, **kw)


def vectors(outs) -> torch.Tensor:
    return torch.tensor([o.outputs.embedding for o in outs])


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_embed_matches_hf(model_dir, hf_hidden, pooling):
    llm = make_llm(model_dir, pooling=pooling)
    outs = llm.embed(prompts(), use_tqdm=False)
    pooled = [h[-1] if pooling == "last" else h.mean(0) for h in hf_hidden]
    ref = torch.nn.functional.normalize(torch.stack(pooled), dim=-1)
    got = vectors(outs)
    assert got.shape == (len(prompts()), 64)
    torch.testing.assert_close(got, ref, atol=HF_ATOL, rtol=0)
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(outs)), atol=1e-6)
    assert [o.prompt_token_ids for o in outs] == prompts()
    assert llm.engine.kv.num_used_blocks == 0
    assert not llm.engine.has_unfinished_requests()


def test_pooling_params_override_and_unnormalized(model_dir, hf_hidden):
    llm = make_llm(model_dir)  # --pooling last
    outs = llm.embed(prompts(), PoolingParams(pooling_type="MEAN", normalize=False), use_tqdm=False)
    for o, h in zip(outs, hf_hidden):
        torch.testing.assert_close(torch.tensor(o.outputs.embedding), h.mean(0), atol=HF_ATOL, rtol=0)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_same_vector_alone_in_a_batch_and_chunked(model_dir, pooling):
    target = prompts()[-1]  # 70 tokens
    alone = vectors(make_llm(model_dir, pooling=pooling).embed([target], use_tqdm=False))[0]
    batch = vectors(make_llm(model_dir, pooling=pooling).embed(prompts(), use_tqdm=False))[-1]
    # A step budget of 16 tokens: the prompt runs in 5 chunks, sharing steps with the others.
    small = make_llm(model_dir, pooling=pooling, max_num_batched_tokens=16)
    chunked = vectors(small.embed(prompts(), use_tqdm=False))[-1]
    assert small.engine.kv.num_used_blocks == 0
    torch.testing.assert_close(batch, alone, atol=SAME_ATOL, rtol=0)
    torch.testing.assert_close(chunked, alone, atol=SAME_ATOL, rtol=0)


def test_prefix_cache_last_reuses_mean_recomputes(model_dir):
    llm = make_llm(model_dir)
    p = prompts()[-1]
    first, second = (llm.embed([p], use_tqdm=False)[0] for _ in range(2))
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 64  # 4 full blocks of 16
    torch.testing.assert_close(torch.tensor(second.outputs.embedding), torch.tensor(first.outputs.embedding),
                               atol=SAME_ATOL, rtol=0)
    mean = PoolingParams(pooling_type="MEAN")
    assert [llm.embed([p], mean, use_tqdm=False)[0].num_cached_tokens for _ in range(2)] == [0, 0]
    assert llm.engine.kv.num_used_blocks == 0


def test_embeddings_and_generations_share_steps(model_dir):
    """Embedding and generation requests in the same steps: the generation is what it is alone,
    the embedding too, and nothing is left holding blocks."""
    gen_params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    alone_llm = make_llm(model_dir)
    gen_alone = alone_llm.generate([prompts()[2]], gen_params, use_tqdm=False)[0].outputs[0].token_ids
    emb_alone = alone_llm.embed([prompts()[3]], use_tqdm=False)[0].outputs.embedding

    llm = make_llm(model_dir, max_num_batched_tokens=16)
    eng = llm.engine
    gid = eng.add_request(None, prompts()[2], gen_params)
    eid = eng.add_request(None, prompts()[3], PoolingParams().to_sampling_params())
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    assert done[gid].outputs[0].token_ids == gen_alone and done[gid].embedding is None
    assert done[eid].outputs[0].token_ids == [] and done[eid].outputs[0].finish_reason == "stop"
    torch.testing.assert_close(torch.tensor(done[eid].embedding), torch.tensor(emb_alone), atol=SAME_ATOL, rtol=0)
    assert eng.kv.num_used_blocks == 0


def test_preempted_mean_request_recomputes_cleanly(model_dir):
    """A generation that grows takes the blocks of a newer embedding request mid-prefill (6 blocks
    for both): the embedding is preempted, recomputed from its first token with a fresh pooler,
    and its vector is what it is alone."""
    mean = PoolingParams(pooling_type="MEAN")
    alone = make_llm(model_dir).embed([prompts()[-1]], mean, use_tqdm=False)[0].outputs.embedding
    llm = LLM(model=str(model_dir), dtype="float32", num_kv_blocks=6, check_integrity=True,
              max_num_batched_tokens=32, max_model_len=96)
    eng = llm.engine
    eng.add_request(None, prompts()[2], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    eid = eng.add_request(None, prompts()[-1], mean.to_sampling_params())
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert eng.scheduler.num_preemptions > 0
    torch.testing.assert_close(torch.tensor(done[eid].embedding), torch.tensor(alone), atol=SAME_ATOL, rtol=0)
    assert eng.kv.num_used_blocks == 0


def test_bad_inputs_name_the_field(model_dir):
    llm = make_llm(model_dir, max_model_len=64)
    with pytest.raises(ValueError, match=r"prompts\[1\]: prompt must not be empty"):
        llm.embed(["fine", ""], use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompts\[0\]: prompt_token_ids contains 999"):
        llm.embed([[5, 999]], use_tqdm=False)
    with pytest.raises(ValueError, match=r"prompts\[0\]: prompt is 65 tokens, more than max_model_len=64"):
        llm.embed([[5] * 65], use_tqdm=False)
    assert len(llm.embed([[5] * 64], use_tqdm=False)[0].outputs.embedding) == 64  # a full context is fine
    with pytest.raises(ValueError, match="pooling_type must be one of LAST, MEAN"):
        PoolingParams(pooling_type="CLS")
    with pytest.raises(ValueError, match="pooling must be one of last, mean"):
        make_llm(model_dir, pooling="cls")
    bad = SamplingParams(n=2, extra_args={"pooling": {}})
    with pytest.raises(ValueError, match="n must be 1 for an embedding request"):
        llm.engine.add_request(None, [5, 6], bad)
    assert not llm.engine.has_unfinished_requests()
