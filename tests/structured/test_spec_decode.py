"""Structured outputs with speculative decoding (n-gram drafts): the drafts are cut where the
grammar refuses them, each verify row is sampled under the mask of its draft prefix, and the
outputs equal a run without drafts (greedy), on the embedded default model."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from kvserve import LLM, SamplingParams
from kvserve.kernels.tuning import TUNING_ENV
from kvserve.sampling_params import StructuredOutputsParams as SO
from kvserve.structured.backend import constraint_key
from kvserve.structured.manager import StructuredOutputManager
from tests.structured.test_engine import SCHEMAS, chat, constrained

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}
BACKENDS = ["xgrammar", "guidance"]


@pytest.fixture(scope="module")
def spec_llm():
    """The conftest `llm` with n-gram drafts, and like it with the kernels' fixed defaults: its
    outputs are compared token for token with `llm`'s, and tuning may choose other prefill paths
    (int8 codes, bfloat16 attention products) whose rounding moves near-tied tokens."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(TUNING_ENV, "off")
        llm = LLM(dtype="float32", kv_cache_memory="64MiB", check_integrity=True, speculative_config=NGRAM)
    yield llm
    llm.engine.close()


def _ready(st, rid: str, so: SO, prompt_ids=()) -> None:
    st.add(rid, so, list(prompt_ids))
    while st.pending:
        st.wait(1.0)
        assert not st.poll()


@pytest.fixture(params=BACKENDS)
def manager(llm, request):
    eng = llm.engine
    st = StructuredOutputManager(request.param, eng.tokenizer, eng.vocab_size, eng.eos_token_id)
    yield st
    st.close()


def test_drafts_are_cut_where_the_grammar_refuses_and_rows_follow_each_prefix(llm, manager):
    st, tok = manager, llm.get_tokenizer()
    so = SO(regex=r"\(\d{3}\) \d{3}-\d{4}")
    _ready(st, "phone", so)
    good = tok("(555) 123-4567", add_special_tokens=False)["input_ids"]
    drafts = good[:3] + tok("abc", add_special_tokens=False)["input_ids"]
    assert st.fit_drafts("phone", drafts) == good[:3]  # cut at the first token the grammar refuses
    assert st.fit_drafts("phone", good[:4]) == good[:4]
    assert st.fit_drafts("phone", good[:2] + [st.eos_token_id] + good[2:4]) == good[:2]  # an end is sampled, not drafted

    grammar = st.bitmask(["phone"], {"phone": good[:4]})
    assert grammar.req_ids == ["phone"] and grammar.counts == [5]
    rows = grammar.bitmask
    # The same rows from a fresh matcher walking the drafts one by one.
    name = st.names[0]
    fresh = st.backend(name).matcher(st.cache.get((name, constraint_key(so))).result())
    want = np.zeros_like(rows)
    for i in range(5):
        fresh.fill_bitmask(want, i)
        if i < 4:
            assert fresh.accept(good[i])
    assert np.array_equal(rows, want)
    # The manager's matcher came back: the first row again, and the step's tokens still fit.
    assert np.array_equal(st.bitmask(["phone"]).bitmask[0], want[0])
    assert st.accept({"phone": good[:2]}) == ([], {})
    assert st.fit_drafts("phone", good[2:6]) == good[2:6]


def test_drafts_while_reasoning_are_free_until_the_end_text(llm):
    st = llm.engine.structured
    tok = llm.get_tokenizer()
    so = SO(choice=["yes", "no"], reasoning_end="</think>")
    _ready(st, "gated", so, tok("Question?")["input_ids"])
    thinking = tok("<think>Hm.</think>", add_special_tokens=False)["input_ids"]
    yes = tok("yes", add_special_tokens=False)["input_ids"]
    junk = tok("maybe", add_special_tokens=False)["input_ids"]
    assert st.fit_drafts("gated", thinking[:2]) == thinking[:2]  # no end text yet: nothing to check
    assert st.fit_drafts("gated", thinking + yes) == thinking + yes
    assert st.fit_drafts("gated", thinking + junk) == thinking  # the grammar starts after the end text
    grammar = st.bitmask(["gated"], {"gated": thinking + yes})
    rows = grammar.bitmask
    n = len(thinking)
    assert grammar.counts == [n + len(yes) + 1]
    assert (rows[:n] == -1).all()  # still reasoning: every token
    bits = np.unpackbits(rows[n].view(np.uint8), bitorder="little")
    allowed = set(np.flatnonzero(bits).tolist())
    assert yes[0] in allowed and junk[0] not in allowed and len(allowed) < 10
    assert st.bitmask(["gated"]) is None  # without drafts a reasoning sequence has no row
    st.release("gated")


def test_greedy_constrained_outputs_equal_a_run_without_drafts(llm, spec_llm):
    prompts = [chat(llm, "Reply with the JSON {\"answer\": 4, \"unit\": \"apples\"} and nothing else."),
               chat(llm, "Repeat this phone number: (555) 123-4567, (555) 123-4567."),
               chat(llm, "Give an example JSON object (nested).")]
    params = [constrained(SO(json_object=True), max_tokens=40),
              constrained(SO(regex=r"(\(\d{3}\) \d{3}-\d{4}, )+"), max_tokens=40),
              constrained(SO(json=SCHEMAS["nested"]), max_tokens=60)]
    want = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0] for o in spec_llm.generate(prompts, params, use_tqdm=False)]
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    assert [c.finish_reason for c in got] == [c.finish_reason for c in want]
    stats = spec_llm.engine.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0  # constrained requests drafted and kept drafts
    assert stats["structured_outputs_mask_steps"] > 0
    assert spec_llm.engine.kv.num_used_blocks == 0
    jsonschema.validate(json.loads(got[2].text), SCHEMAS["nested"])


def test_sampled_constrained_outputs_follow_the_grammar_and_seeds_repeat(spec_llm):
    prompts = [chat(spec_llm, f"JSON example {i}: {{\"size\": \"small\"}} or {{\"size\": \"large\"}}") for i in range(4)]
    params = [constrained(SO(json=SCHEMAS["enum"]), temperature=0.8, seed=i, max_tokens=30) for i in range(4)]
    first = spec_llm.generate(prompts, params, use_tqdm=False)
    second = spec_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in second]
    for out in first:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMAS["enum"])


def test_mixed_batch_with_plain_drafting_requests(llm, spec_llm):
    prompts = [chat(llm, "Count: one two three one two three one two three"),
               chat(llm, "Reply with the JSON {\"answer\": 4} and nothing else."),
               chat(llm, "Say: red green blue red green blue")]
    params = [SamplingParams(temperature=0, max_tokens=24), constrained(SO(json_object=True), max_tokens=30),
              SamplingParams(temperature=0, max_tokens=24)]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    got = [o.outputs[0].token_ids for o in spec_llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
