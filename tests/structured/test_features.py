"""Constrained decoding with what the engine already does: prefix caching, stop strings, and
prefill/decode disaggregation (the decode side runs the matcher from the first token)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvserve import LLM, SamplingParams
from kvserve.sampling_params import StructuredOutputsParams as SO
from tests.disagg.test_pd_engine import idle, with_key
from tests.structured.test_engine import SCHEMAS, chat, constrained


def test_a_cached_prefix_gives_the_same_constrained_output(llm):
    prompt = chat(llm, "Describe a person as JSON, with a name and the city they live in. " * 4)
    params = constrained(SO(json=SCHEMAS["nested"]))
    first = llm.generate([prompt], params, use_tqdm=False)[0]
    second = llm.generate([prompt], params, use_tqdm=False)[0]
    assert second.num_cached_tokens > 0
    assert second.outputs[0].text == first.outputs[0].text
    jsonschema.validate(json.loads(second.outputs[0].text), SCHEMAS["nested"])


def test_a_stop_string_ends_a_constrained_request(llm):
    out = llm.generate([chat(llm, "Code?")], constrained(SO(regex="ab-cd-ef"), stop=["-ef"]),
                       use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == ("ab-cd", "stop", "-ef")


@pytest.mark.slow
def test_prefill_decode_disaggregation_decodes_under_the_grammar(llm):
    """The router's prefill call samples one token (constrained too) and keeps the K/V; the decode
    engine fetches them and generates the whole constrained output: what one engine generates."""
    tok = llm.get_tokenizer()
    prompts = [tok(chat(llm, f"JSON for {name}"))["input_ids"] for name in ("nested", "pattern")]
    params = [constrained(SO(json=SCHEMAS[name])) for name in ("nested", "pattern")]
    alone = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    p_eng = LLM(**with_key({"kv_role": "prefill"}), dtype="float32", kv_cache_memory="64MiB")
    d_eng = LLM(**with_key({"kv_role": "decode"}), dtype="float32", kv_cache_memory="64MiB")
    try:
        for ids, sp, ref in zip(prompts, params, alone):
            pre = SamplingParams(**{**_fields(sp), "max_tokens": 1,
                                    "extra_args": {"kv_transfer_params": {"do_remote_decode": True}}})
            transfer = p_eng.generate([{"prompt_token_ids": ids}], pre, use_tqdm=False)[0].kv_transfer_params
            idle(p_eng)
            dec = SamplingParams(**{**_fields(sp), "extra_args": {"kv_transfer_params": transfer}})
            out = d_eng.generate([{"prompt_token_ids": ids}], dec, use_tqdm=False)[0]
            assert out.num_cached_tokens > 0  # the K/V came from the prefill engine
            assert out.outputs[0].text == ref.outputs[0].text
    finally:
        p_eng.engine.close()
        d_eng.engine.close()


def _fields(sp: SamplingParams) -> dict:
    return {"temperature": sp.temperature, "max_tokens": sp.max_tokens, "structured_outputs": sp.structured_outputs}


def test_a_blended_prompt_is_decoded_under_the_grammar():
    """Blending reuses chunks' K/V before the step's forward; the grammar masks sampling after it:
    a RAG prompt whose chunks are blended still answers with JSON that validates."""
    llm = LLM(dtype="float32", kv_cache_memory="64MiB", enable_blending=True, blend_max_deviation=1e9)
    try:
        docs = ["Paris is the capital of France. It lies on the Seine." * 3,
                "Rome is the capital of Italy. It lies on the Tiber." * 3]
        params = constrained(SO(json=SCHEMAS["nested"]))
        for order in ([0, 1], [1, 0]):  # the second prompt reuses both chunks, in another order
            text = chat(llm, "Notes # # " + " # # ".join(docs[i] for i in order) + " # # A person as JSON.")
            out = llm.generate([text], params, use_tqdm=False)[0]
            jsonschema.validate(json.loads(out.outputs[0].text), SCHEMAS["nested"])
        assert out.num_cached_tokens_by_tier.get("blended", 0) > 0
    finally:
        llm.engine.close()
