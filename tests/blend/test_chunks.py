"""Marking a prompt's chunks: separators or listed texts -> token spans, and the engine's checks."""

from __future__ import annotations

import pytest

from kvserve.blend.chunks import (check_blend_spec, listed_char_spans, make_spec, separator_char_spans,
                                  token_spans)
from kvserve.config import BlendConfig
from tests.conftest import make_tokenizer

SEP = " # # "
ON = BlendConfig(enabled=True, max_chunk_tokens=50)


def test_separator_marks_the_pieces_between_separators():
    text = f"sys{SEP}doc one{SEP}doc two{SEP}question?"
    spans = separator_char_spans(text, SEP)
    assert [text[a:b] for a, b in spans] == ["doc one", "doc two"]
    assert separator_char_spans("no separator here", SEP) == []


@pytest.mark.parametrize("text, match", [
    (f"question{SEP}", "marks no chunk"),
    (f"{SEP}", "marks no chunk"),
    (f"sys{SEP}  {SEP}question", "chunk 0 .* is empty"),
    (f"sys{SEP}a{SEP}{SEP}question", "chunk 1 .* is empty"),
])
def test_separator_errors(text, match):
    with pytest.raises(ValueError, match=match):
        separator_char_spans(text, SEP)


def test_listed_chunks_are_found_in_order():
    text = "intro A text. then B text. end A text."
    spans = listed_char_spans(text, ["B text.", "A text."])
    assert [text[a:b] for a, b in spans] == ["B text.", "A text."]
    assert spans[1][0] > spans[0][0]  # the second "A text.", after B
    for chunks, match in ((["missing"], r"blend.chunks\[0\] does not occur"), ([""], r"blend.chunks\[0\] is empty"),
                          (["A text.", "intro"], r"blend.chunks\[1\] does not occur in the prompt after"),
                          ([], "non-empty list"), ("A text.", "non-empty list")):
        with pytest.raises(ValueError, match=match):
            listed_char_spans(text, chunks)


def test_token_spans_follow_the_text_and_keep_the_tokens():
    tok = make_tokenizer()
    text = f"The quick brown fox.{SEP}Paged attention stores keys.{SEP}Prefix caching reuses.{SEP}Why?"
    ids = tok(text)["input_ids"]
    spec = make_spec(tok, text, ids, SEP)
    chunks = [tok.decode(ids[a:b]).strip() for a, b in spec["chunks"]]
    assert chunks == ["Paged attention stores keys.", "Prefix caching reuses."]
    # the same chunks listed give the same spans; a token-id prompt has no text to find them in
    assert make_spec(tok, text, ids, SEP, {"chunks": ["Paged attention stores keys.", "Prefix caching reuses."],
                                           "recompute_ratio": 0.3}) == {**spec, "recompute_ratio": 0.3}
    assert make_spec(tok, None, ids, SEP) is None
    with pytest.raises(ValueError, match="need the prompt as text"):
        make_spec(tok, None, ids, SEP, {"chunks": ["x"]})
    with pytest.raises(ValueError, match="tokens are the prompt's"):
        token_spans(tok, text, ids[:-1], [(0, 3)])


def test_engine_checks_the_spec():
    check_blend_spec(None, BlendConfig(), 10, 4)  # no blend, nothing to check
    check_blend_spec({"chunks": [[0, 3], [3, 9]], "recompute_ratio": 0.5, "check_layer": 3}, ON, 10, 4)
    with pytest.raises(ValueError, match="without --enable-blending"):
        check_blend_spec({"chunks": [[0, 3]]}, BlendConfig(), 10, 4)
    bad = [({"chunks": []}, "non-empty list"), ({"chunks": [[3, 2]]}, r"chunks\[0\]"),
           ({"chunks": [[0, 5], [4, 8]]}, r"chunks\[1\] .* after the chunk before"),
           ({"chunks": [[0, 11]]}, "within the prompt's 10 tokens"), ({"chunks": [["a", 2]]}, r"chunks\[0\] must be"),
           ({"chunks": [[0, 3]], "recompute_ratio": 1.5}, "recompute_ratio"),
           ({"chunks": [[0, 3]], "check_layer": 4}, "check_layer"), ({"chunks": [[0, 3]], "x": 1}, "unknown key 'x'")]
    for spec, match in bad:
        with pytest.raises(ValueError, match=match):
            check_blend_spec(spec, ON, 10, 4)
    with pytest.raises(ValueError, match=r"blend.chunks\[0\] is 60 tokens, more than blend_max_chunk_tokens=50"):
        check_blend_spec({"chunks": [[0, 60]]}, ON, 100, 4)
