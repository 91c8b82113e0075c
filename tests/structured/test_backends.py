"""The grammar backends on a small hand-made vocabulary, and the compile cache."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest

from kvserve.sampling_params import StructuredOutputsParams
from kvserve.structured.backend import ConstraintKey, StructuredOutputError, Vocab, constraint_key
from kvserve.structured.cache import CompileCache
from kvserve.structured.registry import backend_class, resolve

BACKENDS = ["xgrammar", "guidance"]
EOS, SPECIAL = 256, 257
# 256 single bytes, then <eos>, a special token, then a few multi-byte tokens.
MULTI = [b'{"', b'":', b'", "', b"true", b"false", b"ab", b"abc", b"12"]
VOCAB = Vocab([bytes([i]) for i in range(256)] + [b"", b""] + MULTI, [EOS], [EOS, SPECIAL])
TOK = {t: i for i, t in enumerate(VOCAB.token_bytes) if t}


def allowed(mask: np.ndarray, row: int) -> set[int]:
    bits = np.unpackbits(mask[row].view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits[:len(VOCAB.token_bytes)]).tolist())


@pytest.fixture(params=BACKENDS)
def backend(request):
    return backend_class(request.param).from_vocab(VOCAB)


def walk(backend, key: ConstraintKey, tokens: list[int]):
    m = backend.matcher(backend.compile(key))
    mask = backend.allocate_bitmask(1)
    for t in tokens:
        m.fill_bitmask(mask, 0)
        assert t in allowed(mask, 0), f"token {VOCAB.token_bytes[t]!r} masked"
        assert m.accept(t)
    return m, mask


def test_regex_masks_follow_the_grammar(backend):
    m, mask = walk(backend, ConstraintKey("regex", "ab(c|d)"), [TOK[b"ab"]])
    m.fill_bitmask(mask, 0)
    assert allowed(mask, 0) == {TOK[b"c"], TOK[b"d"]}  # not "abc" (a second "ab"), not EOS yet
    assert m.accept(TOK[b"d"]) and not m.is_terminated()
    m.fill_bitmask(mask, 0)
    assert allowed(mask, 0) == {EOS}  # complete: only the end may follow, never the special token
    assert m.accept(EOS) and m.is_terminated()
    assert not m.accept(TOK[b"c"])


def test_rollback_of_the_end_token(backend):
    m, mask = walk(backend, ConstraintKey("regex", "ab"), [TOK[b"ab"], EOS])
    m.rollback(1)
    assert not m.is_terminated()
    m.fill_bitmask(mask, 0)
    assert allowed(mask, 0) == {EOS}


def test_a_token_the_grammar_forbids_is_rejected(backend):
    m = backend.matcher(backend.compile(ConstraintKey("regex", "[0-9]+")))
    assert not m.accept(TOK[b"a"])


def test_rollback_returns_to_an_earlier_state(backend):
    m, mask = walk(backend, ConstraintKey("regex", "(ab|12)x"), [TOK[b"12"]])
    m.rollback(1)
    m.fill_bitmask(mask, 0)
    assert TOK[b"ab"] in allowed(mask, 0) and TOK[b"12"] in allowed(mask, 0)


def test_choice_and_json(backend):
    m, _ = walk(backend, constraint_key(StructuredOutputsParams(choice=["true", "false"])), [TOK[b"false"], EOS])
    assert m.is_terminated()
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
              "additionalProperties": False}
    doc = [TOK[b'{"'], TOK[b"a"], TOK[b'":'], TOK[b" "], TOK[b"true"], TOK[b"}"], EOS]
    m, _ = walk(backend, constraint_key(StructuredOutputsParams(json=schema)), doc)
    assert m.is_terminated()


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("params, field, words", [
    (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"type": "strin"}}}), "json", "strin"),
    (StructuredOutputsParams(json='{"type": "object",'), "json", ""),
    (StructuredOutputsParams(json={"type": "string", "pattern": "(a"}), "json", ""),
    (StructuredOutputsParams(regex="a(b"), "regex", ""),
    (StructuredOutputsParams(grammar="root ::= (("), "grammar", ""),
])
def test_invalid_constraints_name_their_field(name, params, field, words):
    with pytest.raises(StructuredOutputError, match=rf"^structured_outputs\.{field}: .*{words}"):
        backend_class(name).check(constraint_key(params))


@pytest.mark.parametrize("name", BACKENDS)
def test_unsupported_keyword_is_refused_not_ignored(name):
    schema = {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "integer"},
                                                      "contains": {"const": 3}}}}
    with pytest.raises(StructuredOutputError, match=r"^structured_outputs\.json: .*contains"):
        backend_class(name).check(constraint_key(StructuredOutputsParams(json=schema)))


def test_xgrammar_refuses_a_whitespace_pattern():
    with pytest.raises(StructuredOutputError, match=r"^structured_outputs\.whitespace_pattern"):
        backend_class("xgrammar").check(constraint_key(StructuredOutputsParams(json_object=True,
                                                                               whitespace_pattern=" ?")))


def test_constraint_key_is_the_text():
    a = constraint_key(StructuredOutputsParams(json={"type": "object", "properties": {"x": {}}}))
    b = constraint_key(StructuredOutputsParams(json=json.dumps({"type": "object", "properties": {"x": {}}})))
    assert a == b and a.field == "structured_outputs.json"
    assert constraint_key(StructuredOutputsParams(regex="a")) != constraint_key(StructuredOutputsParams(grammar="a"))


def test_registry_resolves_auto_and_refuses_unknown():
    assert resolve("auto") == "xgrammar"  # both installed: the faster per step (BENCHMARKS.md)
    with pytest.raises(ValueError, match="structured_outputs_backend must be one of"):
        resolve("outlines")


# ---- compile cache ------------------------------------------------------------

def test_cache_compiles_each_text_once_off_the_calling_thread():
    threads: list[int] = []
    gate = threading.Event()

    def compile_fn(key: ConstraintKey) -> str:
        threads.append(threading.get_ident())
        gate.wait(5)
        return key.text.upper()

    cache = CompileCache(compile_fn)
    first = cache.get(ConstraintKey("regex", "ab"))
    assert not first.done()  # get never waits for the compile
    again = cache.get(ConstraintKey("regex", "ab"))
    gate.set()
    assert again is first and first.result(5) == "AB"
    assert cache.get(ConstraintKey("regex", "cd")).result(5) == "CD"
    assert (cache.hits, cache.misses) == (1, 2)
    assert threading.get_ident() not in threads and len(threads) == 2
    cache.close()


def test_cache_keeps_failures_and_evicts_the_least_recently_used():
    calls: list[str] = []

    def compile_fn(key: ConstraintKey) -> str:
        calls.append(key.text)
        if key.text == "bad":
            raise StructuredOutputError("structured_outputs.regex: bad")
        return key.text

    cache = CompileCache(compile_fn, capacity=2)
    bad = cache.get(ConstraintKey("regex", "bad"))
    assert isinstance(bad.exception(5), StructuredOutputError)
    assert cache.get(ConstraintKey("regex", "bad")) is bad
    for text in ("a", "b"):
        cache.get(ConstraintKey("regex", text)).result(5)
    assert len(cache) == 2
    cache.get(ConstraintKey("regex", "bad")).exception(5)  # evicted: compiled again
    assert calls == ["bad", "a", "b", "bad"]
    cache.close()


def test_guidance_closes_objects_as_xgrammar_strict_mode_does():
    from kvserve.structured.guidance_backend import closed_objects

    schema = {"type": "object", "properties": {"properties": {"type": "object", "properties": {"x": {}}},
                                               "open": {"type": "object", "properties": {},
                                                        "additionalProperties": True}},
              "enum_holder": {"enum": [{"properties": {}}]}}
    out = closed_objects(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["properties"]["additionalProperties"] is False
    assert out["properties"]["open"]["additionalProperties"] is True
    assert out["enum_holder"] == {"enum": [{"properties": {}}]}  # values, not schemas
    assert "additionalProperties" not in schema  # a copy


def test_validate_counts_the_allowed_prefix_and_leaves_the_matcher(backend):
    """Matcher.validate: how many drafted tokens fit (speculative decoding cuts drafts there)."""
    m, mask = walk(backend, ConstraintKey("regex", "(ab|12)+x"), [TOK[b"ab"]])
    assert m.validate([TOK[b"12"], TOK[b"ab"], TOK[b"c"], TOK[b"x"]]) == 2
    assert m.validate([TOK[b"x"]]) == 1
    assert m.validate([TOK[b"c"]]) == 0 and m.validate([]) == 0
    m.fill_bitmask(mask, 0)  # unmoved: still right after "ab"
    assert allowed(mask, 0) == {TOK[b"ab"], TOK[b"12"], TOK[b"x"], TOK[b"a"], TOK[b"1"]}
    assert m.accept(TOK[b"x"]) and m.accept(EOS) and m.is_terminated()
