"""Speculative decoding through the engine (n-gram drafts): outputs unchanged, the KV cache as a
plain run leaves it, no block leaked, seeds reproducible, the target's distribution kept."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}


def _prompts(n: int, length: int = 24) -> list[list[int]]:
    rng = random.Random(0)
    out = []
    for i in range(n):
        motif = [rng.randrange(1, 200) for _ in range(rng.randrange(3, 7))]
        out.append([(motif * 10)[j] if i % 2 else rng.randrange(1, 200) for j in range(length)])
    return out


def _llm(model, spec: dict | None, **kw) -> LLM:
    kw = {"block_size": 4, "num_kv_blocks": 256, "max_model_len": 128, "check_integrity": True, **kw}
    return LLM(model=str(model), speculative_config=spec, **kw)


def _cached(llm: LLM) -> set[bytes]:
    return {b.block_hash for b in llm.engine.kv.cache.cached_blocks()}


def _tokens(outs) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in outs]


def test_greedy_outputs_and_kv_cache_equal_a_plain_run(tiny_model_factory):
    model = tiny_model_factory("llama")
    prompts = _prompts(12)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = _llm(model, None)
    spec = _llm(model, NGRAM)
    try:
        plain_outs = plain.generate(prompts, params, use_tqdm=False)
        spec_outs = spec.generate(prompts, params, use_tqdm=False)
        assert _tokens(spec_outs) == _tokens(plain_outs)
        stats = spec.engine.stats()
        # Each output counts its own drafts (usage's accepted / rejected prediction tokens).
        assert all(o.num_draft_tokens is None for o in plain_outs)
        assert sum(o.num_draft_tokens for o in spec_outs) == stats["spec_decode_num_draft_tokens"]
        assert sum(o.num_accepted_draft_tokens for o in spec_outs) == stats["spec_decode_num_accepted_tokens"]
        # both paths of verification ran: drafts kept and drafts rejected
        assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
        assert stats["spec_decode_num_accepted_tokens_pos_0"] >= stats["spec_decode_num_accepted_tokens_pos_3"]
        assert _cached(spec) == _cached(plain)
        assert spec.engine.kv.num_used_blocks == 0
    finally:
        plain.close()
        spec.close()


def test_greedy_equal_under_preemption_prefix_hits_n2_stops_and_logprobs(tiny_model_factory):
    model = tiny_model_factory("llama")
    base = _prompts(8)
    prompts = base + [p[:16] + [7, 7, 7] for p in base[:4]]  # shared prefixes: prefix-cache hits
    cases = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
             SamplingParams(max_tokens=30, temperature=0, n=2, ignore_eos=True),
             SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[5, 9, 11], logprobs=2)]
    for params in cases:
        runs = []
        for spec in (None, NGRAM):
            llm = _llm(model, spec, num_kv_blocks=40, max_num_seqs=8)  # too few blocks: preemption
            try:
                outs = llm.generate(prompts, params, use_tqdm=False)
                runs.append((outs, llm.engine.stats()))
                assert llm.engine.kv.num_used_blocks == 0
            finally:
                llm.close()
        (plain, _), (spec_outs, stats) = runs
        assert _tokens(spec_outs) == _tokens(plain)
        assert stats["spec_decode_num_accepted_tokens"] > 0
        if params.logprobs:
            for a, b in zip(plain, spec_outs):
                for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                    assert pa.keys() == pb.keys()
                    for t in pa:
                        assert pa[t].logprob == pytest.approx(pb[t].logprob, abs=1e-4)
    assert runs[1][1]["num_preemptions"] > 0 or runs[0][1]["num_preemptions"] > 0


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_seeded_sampling_repeats_and_aborts_leak_nothing(tiny_model_factory, method):
    """draft_model: the target rounded to int4 as its own KV's draft model, sampling its drafts."""
    model = tiny_model_factory("llama")
    prompts = _prompts(6 if method == "ngram" else 4)
    spec = NGRAM if method == "ngram" else {"method": "draft_model", "model": str(model), "quantization": "int4",
                                             "num_speculative_tokens": 3, "adaptive": False}
    params = SamplingParams(max_tokens=24, temperature=0.8, top_k=5, seed=7, ignore_eos=True)
    llm = _llm(model, spec)
    try:
        first = _tokens(llm.generate(prompts, params, use_tqdm=False))
        llm.engine.clear_kv_cache()
        assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == first
        stats = llm.engine.stats()
        assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
        # aborts between verify steps: every block comes back
        eng = llm.engine
        ids = [eng.add_request(None, p, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
               for p in prompts]
        for _ in range(6):
            eng.step()
        for rid in ids:
            eng.abort_request(rid)
        while eng.has_unfinished_requests():
            eng.step()
        assert eng.kv.num_used_blocks == 0
    finally:
        llm.close()


_DIST_PARAMS = SamplingParams(max_tokens=3, temperature=0.8, top_k=6, ignore_eos=True)


def _second_tokens(llm: LLM) -> Counter:
    outs = llm.generate([_prompts(1)[0]] * 2000, _DIST_PARAMS, use_tqdm=False)
    return Counter(o.outputs[0].token_ids[1] for o in outs)


@pytest.fixture(scope="module")
def plain_second_tokens(tiny_model_factory) -> Counter:
    llm = _llm(tiny_model_factory("llama"), None, num_kv_blocks=1024, max_num_seqs=256)
    try:
        return _second_tokens(llm)
    finally:
        llm.close()


@pytest.mark.parametrize("drafter", ["fixed", "draft_model"])
def test_sampled_tokens_keep_the_target_distribution(tiny_model_factory, plain_second_tokens, drafter):
    """The second output token's histogram over 2,000 samples at temperature 0.8 matches a plain
    run's (chi-squared, p > 0.01), with drafts that exercise rejection: fixed proposals that are
    the target's likeliest token half the time and a wrong one otherwise (q a point mass), or a
    draft model (the target rounded to int4: on a tiny random model q differs from p enough that
    drafts are often rejected) sampling from its own distribution q."""
    model = tiny_model_factory("llama")
    if drafter == "draft_model":
        spec = {"method": "draft_model", "model": str(model), "quantization": "int4", "num_speculative_tokens": 1,
                "adaptive": False, "disable_by_batch_size": 4096}  # 256 at once still draft
    else:
        spec = NGRAM
    llm = _llm(model, spec, num_kv_blocks=1024, max_num_seqs=256)
    try:
        if drafter == "fixed":
            rng = random.Random(1)
            eng = llm.engine
            likely: dict[tuple[int, ...], int] = {}

            def propose(req, num_decodes):
                key = tuple(req.all_token_ids)
                if key not in likely:  # the target's greedy pick after this history
                    likely[key] = _argmax_next(eng, req.all_token_ids)
                return [likely[key] if rng.random() < 0.5 else (likely[key] + 1) % 200 + 1]

            eng.scheduler.propose = propose
        hist = _second_tokens(llm)
        stats = llm.engine.stats()
        assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    finally:
        llm.close()
    tokens = sorted(set(plain_second_tokens) | set(hist))
    table = torch.tensor([[h.get(t, 0) for t in tokens] for h in (plain_second_tokens, hist)], dtype=torch.float64)
    assert _chi2_homogeneity_p(table) > 0.01


def _chi2_homogeneity_p(table: torch.Tensor) -> float:
    """p-value of Pearson's chi-squared test that the rows of a 2 x m count table share one
    distribution (columns with expected counts under 5 pooled into one)."""
    expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    small = (expected < 5).any(0)
    if small.any():
        table = torch.cat([table[:, ~small], table[:, small].sum(1, keepdim=True)], dim=1)
        expected = table.sum(1, keepdim=True) * table.sum(0, keepdim=True) / table.sum()
    stat = ((table - expected) ** 2 / expected).sum()
    dof = (table.shape[0] - 1) * (table.shape[1] - 1)
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def _argmax_next(engine, token_ids: list[int]) -> int:
    runner = engine.executor.runner
    hidden = runner.prefill_scratch(list(token_ids))
    return int(runner.model.compute_logits(hidden[-1:]).argmax())


def test_speculative_config_is_checked_by_name():
    for bad, msg in [({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
                     ({"method": "ngram"}, "num_speculative_tokens is required"),
                     ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be >= 1"),
                     ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
                      "prompt_lookup_min"),
                     ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown key 'typo'"),
                     ("not json", "speculative_config must be a JSON object")]:
        with pytest.raises(ValueError, match=msg):
            EngineConfig.from_kwargs(speculative_config=bad)
    cfg = EngineConfig.from_kwargs(speculative_config='{"method": "ngram", "num_speculative_tokens": 3}').speculative
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == ("ngram", 3, 2, 5)


def test_greedy_equal_with_kv_tiers(tiny_model_factory, tmp_path):
    """Evicted blocks go to host RAM and disk and come back: only blocks of accepted tokens are
    ever written there (drafts' K/V never are), so outputs equal a plain run's."""
    model = tiny_model_factory("llama")
    prompts = _prompts(8)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    runs = []
    for i, spec in enumerate((None, NGRAM)):
        llm = _llm(model, spec, num_kv_blocks=48, max_num_seqs=4, kv_offload_cpu="1MiB",
                   kv_offload_disk=str(tmp_path / f"disk{i}"))
        try:
            runs.append(_tokens(llm.generate(prompts, params, use_tqdm=False)))
            runs.append(_tokens(llm.generate(prompts, params, use_tqdm=False)))  # again: loads from the tiers
            assert llm.engine.kv.num_used_blocks == 0
        finally:
            llm.close()
    assert runs[0] == runs[1] == runs[2] == runs[3]


def test_a_prediction_drafts_and_leaves_the_output_alone(tiny_model_factory):
    """extra_args["prediction"] (OpenAI's predicted outputs): n-gram lookup searches it between the
    prompt and the output, so a right prediction is drafted nearly whole; a wrong one changes nothing."""
    model = tiny_model_factory("llama")
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 300) for _ in range(20)] for _ in range(3)]  # nothing to copy from
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    plain = _llm(model, None)
    spec = _llm(model, {**NGRAM, "prompt_lookup_min": 2})
    try:
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
        bare = spec.generate(prompts, params, use_tqdm=False)
        right = spec.generate(prompts, [SamplingParams(max_tokens=32, temperature=0, ignore_eos=True,
                                                       extra_args={"prediction": w}) for w in want], use_tqdm=False)
        wrong = spec.generate(prompts, [SamplingParams(max_tokens=32, temperature=0, ignore_eos=True,
                                                       extra_args={"prediction": [7] * 40}) for _ in want],
                              use_tqdm=False)
        for outs in (bare, right, wrong):
            assert [o.outputs[0].token_ids for o in outs] == want
        kept = sum(o.num_accepted_draft_tokens for o in right)
        assert kept >= 0.6 * sum(len(w) for w in want) and kept > 2 * sum(o.num_accepted_draft_tokens for o in bare)
        for bad, msg in [(["a"], "must be a list of token ids"), ([10**9], "contains 1000000000, outside")]:
            with pytest.raises(ValueError, match=f"extra_args.prediction {msg}"):
                spec.generate([prompts[0]], SamplingParams(max_tokens=4, extra_args={"prediction": bad}),
                              use_tqdm=False)
        assert spec.engine.kv.num_used_blocks == 0
    finally:
        plain.close()
        spec.close()
