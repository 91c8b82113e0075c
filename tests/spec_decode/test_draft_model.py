"""Speculative decoding with a second model drafting on the ranks (draft_model with its own KV
tensors, self_quantized sharing the target's): greedy outputs equal a plain run's under
preemption, prefix hits, n = 2 and mixed batches; seeds repeat; no block leaks; bad configs name
their field. Seeds and aborts with a draft model: test_engine.py."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.config import EngineConfig

from tests.conftest import build_tiny_model
from tests.spec_decode.test_engine import _llm, _prompts, _tokens


def _methods(model, small) -> dict[str, dict]:
    """Draft configs, each exercising another part: a draft of other weights (rejections on its own
    K/V), the target's own weights quantized to int4 as a separate draft model (runs of accepted
    drafts, own K/V catching up after a fully accepted run), and self_quantized int8 / int4
    (the target's KV cache shared)."""
    k = {"num_speculative_tokens": 3, "adaptive": False}
    return {"other_model": {"method": "draft_model", "model": str(small), **k},
            "int4_copy": {"method": "draft_model", "model": str(model), "quantization": "int4", **k},
            "self_int8": {"method": "self_quantized", "quantization": "int8", **k},
            "self_int4": {"method": "self_quantized", **k}}


@pytest.fixture(scope="module")
def models(tiny_model_factory, tmp_path_factory):
    small = build_tiny_model(tmp_path_factory.mktemp("draft"), "llama", seed=1, num_hidden_layers=1)
    return tiny_model_factory("llama"), small


@pytest.mark.parametrize("name", ["other_model", "int4_copy", "self_int8", "self_int4"])
def test_greedy_equal_with_preemption_prefix_hits_n2_and_mixed_batches(models, name):
    model, small = models
    spec = _methods(model, small)[name]
    base = _prompts(6)
    prompts = base + [p[:16] + [7, 7, 7] for p in base[:3]]  # shared prefixes: prefix-cache hits
    # max_tokens 2 leaves no room for drafts: those requests decode plainly in the same batches
    params = [SamplingParams(max_tokens=(2, 24, 24)[i % 3], temperature=0, ignore_eos=True, n=1 + (i % 4 == 0))
              for i in range(len(prompts))]
    runs = []
    for s in (None, spec):
        llm = _llm(model, s, num_kv_blocks=24, max_num_seqs=6)  # too few blocks: preemption
        try:
            runs.append((_tokens(llm.generate(prompts, params, use_tqdm=False)), llm.engine.stats()))
            assert llm.engine.kv.num_used_blocks == 0
        finally:
            llm.close()
    (plain, _), (got, stats) = runs
    assert got == plain
    assert stats["spec_decode_num_drafts"] > 0
    if name != "other_model":  # the target's own weights, quantized: many drafts are right (int8 ~all, int4 ~half)
        assert stats["spec_decode_num_accepted_tokens"] > stats["spec_decode_num_draft_tokens"] // 3
    assert stats["num_preemptions"] > 0 or runs[0][1]["num_preemptions"] > 0


def test_draft_configs_are_checked_by_name(models, tmp_path):
    model, _ = models
    for bad, msg in [({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
                     ({"method": "self_quantized", "quantization": "int3", "num_speculative_tokens": 2},
                      "speculative_config.quantization"),
                     ({"method": "ngram", "model": "x", "num_speculative_tokens": 2},
                      "speculative_config.model does not apply"),
                     ({"method": "self_quantized", "prompt_lookup_max": 3, "num_speculative_tokens": 2},
                      "prompt_lookup_max does not apply")]:
        with pytest.raises(ValueError, match=msg):
            EngineConfig.from_kwargs(speculative_config=bad)
    other_vocab = build_tiny_model(tmp_path / "v", "llama", vocab_size=352)
    shorter = build_tiny_model(tmp_path / "s", "llama", max_position_embeddings=64)
    for spec, msg in [({"method": "draft_model", "model": str(tmp_path / "missing")}, "speculative_config.model"),
                      ({"method": "draft_model", "model": str(other_vocab)}, "share the target's tokenizer"),
                      ({"method": "draft_model", "model": str(shorter)}, "lower max_model_len to 64"),
                      ({"method": "self_quantized", "quantization": "gguf"}, "speculative_config.quantization"),
                      ({"method": "self_quantized", "tp": 2}, "tensor_parallel_size > 1 is not supported")]:
        tp = spec.pop("tp", 1)
        with pytest.raises(ValueError, match=msg):
            LLM(model=str(model), speculative_config={**spec, "num_speculative_tokens": 2}, num_kv_blocks=16,
                tensor_parallel_size=tp)


def test_the_draft_model_sleeps_while_nobody_drafts_and_catches_up(models):
    """From disable_by_batch_size decodes on nobody drafts, and the draft model does not run at all;
    once a request drafts again its first pass feeds every token it missed, so its drafts are as
    good as before (the target's int4 copy) and the outputs equal a plain run's."""
    model, small = models
    spec = {**_methods(model, small)["int4_copy"], "disable_by_batch_size": 2}
    prompts = _prompts(3)
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (6, 12, 40)]
    plain = _llm(model, None)
    llm = _llm(model, spec)
    try:
        want = _tokens(plain.generate(prompts, params, use_tqdm=False))
        drafter = llm.engine.executor.runner.drafter
        calls = []  # per step: (drafting requests, draft passes run)
        draft, run = drafter.draft, drafter._run

        def counted_draft(runner, so, order):
            calls.append([len(so.draft_token_ids), 0])
            return draft(runner, so, order)

        def counted_run(runner, spans):
            calls[-1][1] += 1
            return run(runner, spans)

        drafter.draft, drafter._run = counted_draft, counted_run
        assert _tokens(llm.generate(prompts, params, use_tqdm=False)) == want
        stats = llm.engine.stats()
    finally:
        plain.close()
        llm.close()
    idle = [passes for drafting, passes in calls if drafting == 0]
    assert idle and not any(idle)  # steps without drafts (prefills, the busy batch) ran no draft pass
    assert any(drafting for drafting, _ in calls)
    # ~40% kept, as when the draft runs every step; feeding a drafting request only its newest token
    # (no catch-up) keeps none of them (checked: 0 of 78).
    assert stats["spec_decode_num_accepted_tokens"] > stats["spec_decode_num_draft_tokens"] // 4
