"""Blending on a real engine (offline LLM, a tiny 4-layer model): at a 100% recompute ratio it is a
plain prefill; reused chunks are re-rotated exactly; blended and ordinary requests share batches;
the usage split, the quality guard and bad input; no block leaks (check_integrity after every step)."""

from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.blend.forward import attention_mass
from kvserve.request import Request
from tests.conftest import build_tiny_model

SEP = " # # "
DOCS = ["The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog.",
        "Paged attention stores keys and values in fixed-size blocks. Prefix caching reuses the KV cache.",
        "Continuous batching lets requests join and leave every step. Paged attention stores keys."]
SYSTEM = "Prefix caching reuses the KV cache of a shared prompt. Answer from the notes."
QUESTION = "Continuous batching lets requests"
ENGINE = dict(dtype="float32", block_size=4, num_kv_blocks=400, check_integrity=True, max_num_batched_tokens=256)
# A random tiny model's K/V deviate wildly between contexts: the quality guard would recompute every
# blend, so it is off here but in its own test.
NO_GUARD = dict(blend_max_deviation=1e9)


def rag(order, question=QUESTION, system=SYSTEM) -> str:
    return system + SEP + SEP.join(DOCS[i] for i in order) + SEP + question


def greedy(n: int = 8, **extra) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, logprobs=0, extra_args=extra or None)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny-blend"), "llama", num_hidden_layers=4))


@pytest.fixture(scope="module")
def plain(model):
    return LLM(model, **ENGINE)


@pytest.fixture(scope="module")
def blend(model):
    return LLM(model, enable_blending=True, **NO_GUARD, **ENGINE)


def _idle(llm: LLM) -> None:
    assert llm.engine.stats()["kv_blocks_used"] == 0  # every block back: nothing held, nothing leaked


def test_full_recompute_is_a_plain_prefill(plain, blend):
    for order in ([0, 1, 2], [2, 0, 1]):
        want = plain.generate(rag(order), greedy(), use_tqdm=False)[0]
        got = blend.generate(rag(order), greedy(blend={"recompute_ratio": 1.0}), use_tqdm=False)[0]
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        lp_got = [next(iter(p.values())).logprob for p in got.outputs[0].logprobs]
        lp_want = [next(iter(p.values())).logprob for p in want.outputs[0].logprobs]
        assert lp_got == pytest.approx(lp_want, abs=1e-4)
        split = got.num_cached_tokens_by_tier
        assert split["blended"] == 0 and split["recomputed"] > 0
    _idle(blend)


def test_reuse_accounting_and_warmups(blend):
    system = "Accounting. " + SYSTEM
    stats0 = blend.engine.stats()
    first = blend.generate(rag([0, 1, 2], "First question", system), greedy(4), use_tqdm=False)[0]
    stats1 = blend.engine.stats()
    second = blend.generate(rag([2, 1, 0], "Second question", system), greedy(4), use_tqdm=False)[0]
    stats2 = blend.engine.stats()
    for out in (first, second):
        split = out.num_cached_tokens_by_tier
        span = split["blended"] + split["recomputed"]
        assert split["blended"] > 0.6 * span  # most of the chunks' tokens kept their reused K/V
        assert split["recomputed"] >= 0.15 * span
        assert out.num_cached_tokens == split["device"]  # cached_tokens counts exact hits only
    assert second.num_cached_tokens_by_tier["device"] >= 12  # the system prompt: an ordinary prefix hit
    assert stats1["blend_warmup_tokens"] >= stats0["blend_warmup_tokens"]
    assert stats2["blend_warmup_tokens"] == stats1["blend_warmup_tokens"]  # reordered: every chunk was cached
    assert stats2["blend_requests"] == stats0["blend_requests"] + 2
    assert stats2["blend_blended_tokens"] - stats0["blend_blended_tokens"] == sum(
        o.num_cached_tokens_by_tier["blended"] for o in (first, second))
    _idle(blend)


def test_blended_and_ordinary_requests_in_one_batch(plain, blend):
    prompts = [rag([1, 0, 2]), "The quick brown fox jumps over", rag([0, 2, 1], "Paged attention"),
               [5, 6, 7, 8, 9, 10, 11, 12, 13]]
    got = blend.generate(prompts, greedy(), use_tqdm=False)
    want = plain.generate(prompts, greedy(), use_tqdm=False)
    for i in (1, 3):  # the ordinary ones are untouched
        assert got[i].outputs[0].token_ids == want[i].outputs[0].token_ids
        assert "blended" not in got[i].num_cached_tokens_by_tier
    for i in (0, 2):
        assert got[i].num_cached_tokens_by_tier["blended"] > 0
        assert len(got[i].outputs[0].token_ids) == 8
    _idle(blend)


def test_blended_blocks_never_serve_a_plain_prefill(plain, blend):
    """The approximate K/V of a blend (ratio 0: naive reuse) are cached apart: the same tokens sent
    without blending (token ids: nothing marks chunks) are computed exactly."""
    text = rag([2, 1, 0], "Approximate or exact")
    naive = blend.generate(text, greedy(blend={"recompute_ratio": 0.0}), use_tqdm=False)[0]
    assert naive.num_cached_tokens_by_tier["blended"] > 0
    ids = naive.prompt_token_ids
    got = blend.generate([ids], greedy(), use_tqdm=False)[0]
    want = plain.generate([ids], greedy(), use_tqdm=False)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.num_cached_tokens < len(ids) // 2  # at most the exact prefix before the first chunk
    again = blend.generate(text, greedy(blend={"recompute_ratio": 0.0}), use_tqdm=False)[0]
    assert again.num_cached_tokens >= len(ids) - 8  # the same blended prompt reuses the blended blocks
    _idle(blend)


def test_quality_guard_falls_back_to_a_full_prefill(model, plain):
    strict = LLM(model, enable_blending=True, blend_max_deviation=1e-12, **ENGINE)
    text = rag([1, 2, 0])
    strict.generate(rag([0, 1, 2]), greedy(2), use_tqdm=False)  # caches the chunks
    got = strict.generate(text, greedy(), use_tqdm=False)[0]
    want = plain.generate(text, greedy(), use_tqdm=False)[0]
    assert got.outputs[0].token_ids == want.outputs[0].token_ids
    assert got.num_cached_tokens_by_tier["blended"] == 0
    assert strict.engine.stats()["blend_fallbacks"] >= 1
    _idle(strict)


def test_chunked_prefill_n_and_chat(model, plain):
    llm = LLM(model, enable_blending=True, **NO_GUARD, **{**ENGINE, "max_num_batched_tokens": 16})
    text = rag([0, 1, 2], QUESTION + " " + DOCS[1])  # a long question: prefilled in chunks after the blend
    outs = llm.generate(text, SamplingParams(temperature=0, max_tokens=6, n=2), use_tqdm=False)[0]
    assert [len(c.token_ids) for c in outs.outputs] == [6, 6]
    assert outs.outputs[0].token_ids == outs.outputs[1].token_ids
    chat = llm.chat([{"role": "user", "content": rag([2, 0, 1])}], greedy(), use_tqdm=False)[0]
    assert chat.num_cached_tokens_by_tier["blended"] > 0
    _idle(llm)


def test_fp8_kv_cache(model):
    llm = LLM(model, enable_blending=True, kv_cache_dtype="fp8", **NO_GUARD, **ENGINE)
    ref = LLM(model, kv_cache_dtype="fp8", **ENGINE)
    llm.generate(rag([0, 1, 2]), greedy(2), use_tqdm=False)
    got = llm.generate(rag([2, 1, 0]), greedy(blend={"recompute_ratio": 1.0}), use_tqdm=False)[0]
    want = ref.generate(rag([2, 1, 0]), greedy(), use_tqdm=False)[0]
    assert got.outputs[0].token_ids[:2] == want.outputs[0].token_ids[:2]
    out = llm.generate(rag([1, 0, 2]), greedy(), use_tqdm=False)[0]
    assert out.num_cached_tokens_by_tier["blended"] > 0 and len(out.outputs[0].token_ids) == 8
    _idle(llm)


def test_bad_input_names_the_field(model, blend, plain):
    for text, match in ((f"question{SEP}", "marks no chunk"), (f"sys{SEP} {SEP}q", "chunk 0 .* is empty")):
        with pytest.raises(ValueError, match=match):
            blend.generate(text, greedy(), use_tqdm=False)
    with pytest.raises(ValueError, match=r"blend.chunks\[0\] does not occur"):
        blend.generate("some prompt", greedy(blend={"chunks": ["absent"]}), use_tqdm=False)
    with pytest.raises(ValueError, match="without --enable-blending"):
        plain.generate([[5, 6, 7, 8]], greedy(blend={"chunks": [[0, 2]]}), use_tqdm=False)
    small = LLM(model, enable_blending=True, blend_max_chunk_tokens=8, **ENGINE)
    with pytest.raises(ValueError, match=r"blend.chunks\[0\] is \d+ tokens, more than blend_max_chunk_tokens=8"):
        small.generate(rag([0, 1]), greedy(), use_tqdm=False)
    _idle(blend)


def _layer0_keys(llm: LLM, ids: list[int]) -> torch.Tensor:
    """Layer 0's K of the full blocks of `ids`, computed as a prompt [n, Hkv, D]."""
    llm.generate([ids + [3]], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    n = len(ids) // 4
    blocks = llm.engine.kv.cache.match(Request("probe", ids + [3], SamplingParams()), n)
    assert len(blocks) == n
    k = llm.engine.executor.runner.kv_caches[0][0]
    return k[torch.tensor(blocks)].reshape(n * 4, *k.shape[2:]).float()


@pytest.mark.parametrize("arch", ["llama", "llama3", "qwen3"])
def test_rerotation_matches_k_computed_at_the_new_position(arch, tmp_path):
    """Layer 0's K depends on the token and its position only: a chunk's K computed at 0.. and
    re-rotated by an offset equals its K computed at that offset (RoPE, llama3 scaling, q/k norm)."""
    llm = LLM(str(build_tiny_model(tmp_path, arch)), dtype="float32", block_size=4, num_kv_blocks=64)
    chunk = list(range(40, 56))
    offset = 12
    alone = _layer0_keys(llm, chunk)
    placed = _layer0_keys(llm, list(range(100, 100 + offset)) + chunk)[offset:]
    model = llm.engine.executor.runner.model
    assert torch.allclose(model.rerotate_keys(alone, torch.full((len(chunk),), offset)), placed, atol=1e-5)
    assert not torch.allclose(alone, placed, atol=1e-3)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_query_probe_reproduces_hf_attention_weights(arch, tmp_path):
    """The model's public query probe (what blending ranks tokens with) gives the queries its
    attention is given: with the cached keys they reproduce HF's attention probabilities."""
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path, arch)
    ids = list(range(30, 50))
    llm = LLM(str(path), dtype="float32", block_size=4, num_kv_blocks=64, enable_prefix_caching=False)
    runner = llm.engine.executor.runner
    model, layers = runner.model, range(len(runner.kv_caches))
    with model.probe_queries(layers) as queries:
        runner.prefill_scratch(ids)
        probed = dict(queries)
    assert sorted(probed) == list(layers) and all(model.model.layers[i].self_attn.query_probe is None for i in layers)
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    pos = torch.arange(len(ids))[None]
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_attentions=True, output_hidden_states=True)
        want = out.attentions
        cos, sin = hf.model.rotary_emb(out.hidden_states[0], pos)
    for i in layers:
        attn = hf.model.layers[i].self_attn  # the layer's keys from its input, as HF computes them
        with torch.no_grad():
            x = hf.model.layers[i].input_layernorm(out.hidden_states[i])
            k = attn.k_proj(x).view(1, len(ids), -1, attn.head_dim)
            if getattr(attn, "k_norm", None) is not None:
                k = attn.k_norm(k)
            k = k.transpose(1, 2)
            _, k = apply_rotary_pos_emb(k, k, cos, sin)
        q = probed[i]  # [T, H, D]
        kk = k[0].transpose(0, 1).repeat_interleave(q.shape[1] // k.shape[1], dim=1)  # [T, H, D]
        scores = torch.einsum("thd,phd->htp", q, kk) * model.attention_scale
        mask = torch.ones(len(ids), len(ids), dtype=torch.bool).triu(1)
        probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
        assert torch.allclose(probs, want[i][0], atol=1e-4), (i, (probs - want[i][0]).abs().max())


def test_chunks_come_back_from_the_kv_tiers(model):
    """A chunk evicted from the device pool is found in the host tier, not computed again."""
    llm = LLM(model, enable_blending=True, kv_offload_cpu="64MiB", **NO_GUARD,
              **{**ENGINE, "num_kv_blocks": 160})
    llm.generate(rag([0, 1, 2]), greedy(2), use_tqdm=False)
    warm = llm.engine.stats()["blend_warmup_tokens"]
    for i in range(12):  # other prompts push the chunks out of the device pool
        llm.generate([[20 + i] * 200], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    hits = llm.engine.stats()["kv_tier_cpu_hits"]
    out = llm.generate(rag([2, 0, 1], system="Tiers. " + SYSTEM), greedy(), use_tqdm=False)[0]
    stats = llm.engine.stats()
    assert stats["kv_tier_cpu_hits"] > hits
    assert stats["blend_warmup_tokens"] == warm  # nothing computed again
    assert out.num_cached_tokens_by_tier["blended"] > 0
    _idle(llm)


@pytest.mark.parametrize("heads, kv_heads, rows", [(4, 2, 5), (3, 3, 40)])
def test_attention_mass_is_the_questions_softmax_summed(heads, kv_heads, rows):
    """What ranks the tokens to recompute: each query's causal softmax over the keys, per head
    (grouped-query heads reading their key head), summed; 40 rows cross the QUERY_ROWS chunking."""
    g = torch.Generator().manual_seed(0)
    num_keys, dim, scale = 60, 8, 8 ** -0.5
    q = torch.randn(rows, heads, dim, generator=g)
    k = torch.randn(num_keys, kv_heads, dim, generator=g)
    positions = torch.arange(num_keys - rows, num_keys)
    want = torch.zeros(num_keys)
    for t in range(rows):
        for h in range(heads):
            keys = k[:positions[t] + 1, h // (heads // kv_heads)]
            want[:positions[t] + 1] += torch.softmax(keys @ q[t, h] * scale, dim=0)
    got = attention_mass(q, k, positions, scale)
    assert torch.allclose(got, want, atol=1e-5)
    assert got.sum().item() == pytest.approx(rows * heads, rel=1e-5)
