"""Constrained decoding end to end on the embedded default model (SmolLM2-135M, offline)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from kvserve import LLM, SamplingParams
from kvserve.sampling_params import StructuredOutputsParams as SO

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "person": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 20},
            "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                        "required": ["city"]}},
            "required": ["name", "address"]}},
        "required": ["person"]},
    "array_bounds": {"type": "object", "properties": {
        "colors": {"type": "array", "items": {"type": "string", "maxLength": 10}, "minItems": 2, "maxItems": 3}},
        "required": ["colors"]},
    "enum": {"type": "object", "properties": {"size": {"enum": ["small", "medium", "large"]}}, "required": ["size"]},
    "any_of": {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}},
               "required": ["value"]},
    "optional": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                  "b": {"type": "string", "maxLength": 10}}, "required": ["a"]},
    "number_bounds": {"type": "object", "properties": {"t": {"type": "integer", "minimum": -10, "maximum": 10},
                                                       "n": {"type": "number", "minimum": 5, "maximum": 9}},
                      "required": ["t", "n"]},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
                "required": ["code"]},
}


def chat(llm: LLM, text: str) -> str:
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                   tokenize=False)


def constrained(so: SO, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 100, **kw}, structured_outputs=so)


def test_json_outputs_validate(llm):
    prompts = [chat(llm, f"Give an example JSON object ({name}).") for name in SCHEMAS]
    outs = llm.generate(prompts, [constrained(SO(json=s)) for s in SCHEMAS.values()], use_tqdm=False)
    for (name, schema), out in zip(SCHEMAS.items(), outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (name, c.text)
        jsonschema.validate(json.loads(c.text), schema)
    stats = llm.engine.stats()
    assert stats["structured_outputs_compiles"] >= len(SCHEMAS) and stats["structured_outputs_compiling"] == 0
    assert stats["structured_outputs_mask_steps"] > 0 and stats["structured_outputs_mask_seconds"] > 0


def test_json_object_regex_and_choice(llm):
    prompts = [chat(llm, "Reply with the JSON {\"answer\": 4} and nothing else."), chat(llm, "What is your phone number?"), chat(llm, "Best color?")]
    params = [constrained(SO(json_object=True)), constrained(SO(regex=r"\(\d{3}\) \d{3}-\d{4}")),
              constrained(SO(choice=["red", "green", "blue"]), temperature=1.0, seed=3)]
    obj, phone, color = (o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False))
    assert isinstance(json.loads(obj.text), dict) and obj.finish_reason == "stop"
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", phone.text) and phone.finish_reason == "stop"
    assert color.text in ("red", "green", "blue") and color.finish_reason == "stop"


def test_logprobs_come_from_the_masked_distribution(llm):
    out = llm.generate([chat(llm, "Yes or no?")], constrained(SO(choice=["yes", "no"]), logprobs=5),
                       use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no")
    first = out.logprobs[0]
    finite = [tid for tid, lp in first.items() if lp.logprob > float("-inf")]
    tok = llm.get_tokenizer()
    assert all(("yes" if out.text == "yes" else "no").startswith(tok.decode([t]).strip()) or
               tok.decode([t]).strip() in ("y", "ye", "yes", "n", "no") for t in finite)
    assert sum(2.718281828 ** first[t].logprob for t in finite) == pytest.approx(1.0, abs=1e-3)


def test_max_tokens_mid_grammar_returns_the_partial_text(llm):
    schema = SCHEMAS["nested"]
    out = llm.generate([chat(llm, "A person as JSON.")], constrained(SO(json=schema), max_tokens=5),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert out.text.startswith('{"person": ')


def test_mixed_batch_leaves_unconstrained_requests_as_they_were(llm):
    plain = [chat(llm, q) for q in ("Hi!", "Name a fruit.", "What is 2+2?", "Count to five.", "Say something.",
                                    "Tell me a joke.", "Capital of France?", "Define entropy.")]
    greedy = SamplingParams(temperature=0, max_tokens=16)
    alone = llm.generate(plain, greedy, use_tqdm=False)
    mixed_prompts, mixed_params = [], []
    for i, p in enumerate(plain):
        mixed_prompts += [p, chat(llm, f"JSON example {i}")]
        mixed_params += [greedy, constrained(SO(json=SCHEMAS["enum"] if i % 2 else SCHEMAS["optional"]),
                                             temperature=0.7, seed=i)]
    mixed = llm.generate(mixed_prompts, mixed_params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[0::2]] == [o.outputs[0].token_ids for o in alone]
    for out, params in zip(mixed[1::2], mixed_params[1::2]):
        jsonschema.validate(json.loads(out.outputs[0].text), json.loads(json.dumps(params.structured_outputs.json)))


def test_n_samples_each_follow_the_grammar_with_their_own_matcher(llm):
    eng = llm.engine
    rid = eng.add_request(None, llm.get_tokenizer()(chat(llm, "A color list as JSON."))["input_ids"],
                          constrained(SO(json=SCHEMAS["array_bounds"]), n=3, temperature=1.0, seed=7))
    seen_matchers, done = 0, None
    while done is None:
        for out in eng.step():
            if out.request_id == rid and out.finished:
                done = out
        seen_matchers = max(seen_matchers, len(eng.structured.matchers))
    assert seen_matchers == 3
    assert len(done.outputs) == 3
    for c in done.outputs:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), SCHEMAS["array_bounds"])


def test_invalid_constraint_is_refused_naming_the_field(llm):
    with pytest.raises(ValueError, match=r"prompts\[1\]: structured_outputs\.regex: "):
        llm.generate(["a", "b"], [SamplingParams(max_tokens=2), constrained(SO(regex="a(b"))], use_tqdm=False)
    with pytest.raises(ValueError, match=r"structured_outputs\.json: .*strin"):
        llm.engine.add_request(None, [1, 2, 3], constrained(SO(json={"type": "strin"})))
    assert not llm.engine.has_unfinished_requests()


def test_a_failed_compile_ends_only_its_request(llm, monkeypatch):
    """A grammar that passes the check but fails to compile (on the pool) ends its request with an
    error naming the field; the others in the batch finish."""
    from kvserve.structured.backend import StructuredOutputError

    eng = llm.engine
    backend = eng.structured.backend()
    real = backend.compile

    def compile_or_fail(key):
        if "pick-me-to-fail" in key.text:
            raise StructuredOutputError("structured_outputs.regex: too complex to compile")
        return real(key)

    monkeypatch.setattr(backend, "compile", compile_or_fail)
    tok = llm.get_tokenizer()
    ids = tok(chat(llm, "Say yes."))["input_ids"]
    ok = [eng.add_request(None, ids, constrained(SO(choice=["yes", "no"])) if i else SamplingParams(max_tokens=4))
          for i in range(2)]
    bad = eng.add_request(None, ids, constrained(SO(regex="(pick-me-to-fail)")))
    finished, errors = {}, {}
    while eng.has_unfinished_requests():
        finished.update({o.request_id: o for o in eng.step() if o.finished})
        errors.update(eng.take_errors())
    assert errors == {bad: "structured_outputs.regex: too complex to compile"}
    assert set(finished) == set(ok) and finished[ok[1]].outputs[0].text in ("yes", "no")
    # The engine process sends it as the request's own fault: the server answers 400, not 502.
    from kvserve.engine.wire import error_kind

    assert error_kind(errors[bad]) == "invalid" and error_kind("kv_transfer: the fetch timed out") == "kv_load"


def test_preemption_keeps_the_matcher_consistent():
    """8 blocks of 16 tokens for 6 requests of ~40 + 60 tokens: requests are preempted and recomputed
    with their output tokens kept, so their matchers (which accepted those tokens) stay right."""
    llm = LLM(dtype="float32", num_kv_blocks=12, block_size=16, check_integrity=True)
    try:
        prompts = [chat(llm, f"Describe person {i} as JSON.") for i in range(6)]
        outs = llm.generate(prompts, constrained(SO(json=SCHEMAS["nested"]), max_tokens=60), use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
        for out in outs:
            assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
            jsonschema.validate(json.loads(out.outputs[0].text), SCHEMAS["nested"])
    finally:
        llm.engine.close()


def test_the_c_decode_stack_samples_under_the_mask(llm, monkeypatch):
    runner = llm.engine.executor.worker.runner
    if runner.decode_stack is None:
        pytest.skip("no C decode stack on this machine (no compiler, or KVSERVE_DECODE_STACK=0)")
    calls = []
    real = runner.decode_stack.forward
    monkeypatch.setattr(runner.decode_stack, "forward", lambda *a: calls.append(1) or real(*a))
    out = llm.generate([chat(llm, "Pick a size.")], constrained(SO(json=SCHEMAS["enum"])), use_tqdm=False)
    assert calls, "the decode steps did not take the C decode stack"
    jsonschema.validate(json.loads(out[0].outputs[0].text), SCHEMAS["enum"])


@pytest.mark.parametrize("backend", ["guidance"])
def test_the_other_backend_end_to_end(backend):
    llm = LLM(dtype="float32", kv_cache_memory="64MiB", structured_outputs_backend=backend)
    try:
        schemas = [SCHEMAS[k] for k in ("nested", "any_of", "pattern")]
        outs = llm.generate([chat(llm, "JSON please.")] * 3, [constrained(SO(json=s)) for s in schemas],
                            use_tqdm=False)
        assert llm.engine.structured.backend().name == backend
        for schema, out in zip(schemas, outs):
            jsonschema.validate(json.loads(out.outputs[0].text), schema)
    finally:
        llm.engine.close()


def test_ignore_eos_still_ends_where_the_grammar_ends(llm):
    """With ignore_eos the end token does not stop the request; the grammar's end does (its end
    token is not part of the text)."""
    out = llm.generate([chat(llm, "Yes or no?")], constrained(SO(choice=["yes", "no"]), ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no") and out.finish_reason == "stop"
    assert out.token_ids[-1] == llm.engine.eos_token_id


@pytest.mark.slow
def test_pipeline_parallel_matches_one_rank(llm):
    """Two stages keep two batches in flight; a request's next mask is computed only once its token
    came back, so greedy constrained outputs equal those of one rank."""
    names = ["nested", "enum", "pattern", "any_of"]
    prompts = [chat(llm, f"JSON {n}") for n in names]
    params = [constrained(SO(json=SCHEMAS[n])) for n in names]
    one = llm.generate(prompts, params, use_tqdm=False)
    pp = LLM(dtype="float32", kv_cache_memory="64MiB", pipeline_parallel_size=2)
    try:
        assert pp.engine.executor.max_concurrent_batches == 2
        two = pp.generate(prompts, params, use_tqdm=False)
    finally:
        pp.engine.close()
    assert [o.outputs[0].text for o in two] == [o.outputs[0].text for o in one]
    for name, out in zip(names, two):
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMAS[name])


def test_auto_sends_what_xgrammar_refuses_to_guidance(llm):
    """A whitespace_pattern (xgrammar has none) and a Lark grammar (xgrammar reads EBNF only) go to
    llguidance under `auto`; a constraint both refuse gets the first refusal."""
    st = llm.engine.structured
    ws = SO(json={"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                  "required": ["n"]}, whitespace_pattern=r"[ ]?")
    lark = SO(grammar='start: "yes" | "no"')
    assert (st.check(ws), st.check(lark), st.check(SO(regex="a+"))) == ("guidance", "guidance", "xgrammar")
    outs = llm.generate([chat(llm, "Give n as JSON."), chat(llm, "Yes or no?")], [constrained(ws), constrained(lark)],
                        use_tqdm=False)
    assert re.fullmatch(r'\{ ?"n" ?: ?[0-9] ?\}', outs[0].outputs[0].text)
    assert outs[1].outputs[0].text in ("yes", "no")
    with pytest.raises(ValueError, match=r"^structured_outputs\.json: .*uniqueItems"):
        st.check(SO(json={"type": "array", "uniqueItems": True}))


def test_a_slow_compile_never_holds_up_other_requests(llm, monkeypatch):
    """The compile runs on the pool: while it is held, the engine serves other requests to the end,
    and the constrained one waits unscheduled; released, it runs."""
    import threading

    eng = llm.engine
    backend = eng.structured.backend()
    real, gate = backend.compile, threading.Event()
    monkeypatch.setattr(backend, "compile", lambda key: gate.wait(30) and real(key))
    ids = llm.get_tokenizer()(chat(llm, "Hello"))["input_ids"]
    slow = eng.add_request(None, ids, constrained(SO(regex="(held-back)")))
    other = eng.add_request(None, ids, SamplingParams(temperature=0, max_tokens=8))
    done = set()
    while other not in done:
        done |= {o.request_id for o in eng.step() if o.finished}
        assert eng.scheduler.requests[slow].num_computed_tokens == 0  # never scheduled
    gate.set()
    outs = {}
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    assert outs[slow].outputs[0].text == "held-back"


@pytest.mark.slow
def test_tensor_parallel_ranks_share_the_step_bitmask():
    """Two tensor-parallel ranks in their own processes: the SchedulerOutput (bitmask included)
    reaches both; the output rank samples under it."""
    tp = LLM(dtype="float32", kv_cache_memory="64MiB", tensor_parallel_size=2)
    try:
        names = ["nested", "enum"]
        outs = tp.generate([chat(tp, f"JSON {n}") for n in names], [constrained(SO(json=SCHEMAS[n])) for n in names],
                           use_tqdm=False)
    finally:
        tp.engine.close()
    for name, out in zip(names, outs):
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMAS[name])


def test_a_reasoning_end_holds_the_grammar_back_until_it_comes(llm):
    """StructuredOutputsParams.reasoning_end: no mask while the sequence reasons, the grammar from
    the token after the end text on; a prompt whose end already holds it is constrained at once."""
    import time

    eng = llm.engine
    tok = llm.get_tokenizer()
    so = SO(choice=["yes", "no"], reasoning_end="</think>")
    st = eng.structured
    st.add("gated", so, tok("Question?")["input_ids"])
    st.add("open", so, tok("Question? <think>Easy.</think>")["input_ids"])
    while st.pending:
        st.wait(1.0)
        assert not st.poll()
    assert st.bitmask(["gated", "open"]).req_ids == ["open"]
    for t in tok("<think>Let me see.</")["input_ids"]:
        assert st.accept({"gated": [t]}) == ([], {}) and st.bitmask(["gated"]) is None
    st.accept({"gated": tok("think>")["input_ids"]})
    assert st.bitmask(["gated"]).req_ids == ["gated"]  # constrained from the next token
    yes = tok("yes")["input_ids"]
    st.accept({"gated": yes})
    assert st.accept({"gated": [tok.eos_token_id]}) == (["gated"], {})
    st.release("gated")
    st.release("open")
    # End to end: an answer continued after the reasoning is constrained from its first token.
    text = chat(llm, "Is the sky blue?") + "<think>It is.</think>"
    out = llm.generate(text, SamplingParams(temperature=0, max_tokens=8, structured_outputs=so), use_tqdm=False)[0]
    assert out.outputs[0].text in ("yes", "no"), time.time()
