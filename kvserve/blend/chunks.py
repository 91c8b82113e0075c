"""Which tokens of a prompt are chunks: from its text (a separator, or the chunks listed) to token
spans, and the engine's check of those spans. Pure Python (no torch).

A blended request carries `SamplingParams.extra_args["blend"]`:
`{"chunks": [[start, end], ...], "recompute_ratio": r, "check_layer": l}`, token spans of its prompt,
sorted and disjoint; the two numbers are optional (the engine's flags otherwise). The front ends
(server, offline LLM) make the spans from the text, so the prompt's tokens are exactly those of the
same text served without blending.
"""

from __future__ import annotations

from typing import Any

from kvserve.config import BlendConfig, check_fraction

# A blended span in the usage split (RequestOutput.num_cached_tokens_by_tier): tokens that kept reused
# K/V and tokens recomputed. num_cached_tokens (cached_tokens) counts neither.
BLENDED, RECOMPUTED = "blended", "recomputed"


def blend_spec(params: Any) -> dict[str, Any] | None:
    """A request's blend spec (its SamplingParams.extra_args["blend"]), or None."""
    extra = getattr(params, "extra_args", None) or {}
    return extra.get("blend")


def separator_char_spans(text: str, separator: str) -> list[tuple[int, int]]:
    """Chunks of `text` written as prefix SEP chunk SEP chunk ... SEP suffix: the pieces between two
    separators, as character spans (the separators stay in the text). [] without a separator."""
    if separator not in text:
        return []
    pieces, pos = [], 0
    while True:
        at = text.find(separator, pos)
        if at < 0:
            pieces.append((pos, len(text)))
            break
        pieces.append((pos, at))
        pos = at + len(separator)
    chunks = pieces[1:-1]
    if not chunks:
        raise ValueError(f"prompt: the blend separator {separator!r} marks no chunk; write "
                         f"prefix{separator}chunk{separator}...{separator}question")
    for i, (a, b) in enumerate(chunks):
        if not text[a:b].strip():
            raise ValueError(f"prompt: blend chunk {i} (between separators {i + 1} and {i + 2}) is empty")
    return chunks


def listed_char_spans(text: str, chunks: Any) -> list[tuple[int, int]]:
    """The character spans of `chunks` (strings) in `text`, each found after the one before it."""
    if not isinstance(chunks, list) or not chunks or not all(isinstance(c, str) for c in chunks):
        raise ValueError("blend.chunks must be a non-empty list of strings")
    spans, pos = [], 0
    for i, c in enumerate(chunks):
        if not c.strip():
            raise ValueError(f"blend.chunks[{i}] is empty")
        at = text.find(c, pos)
        if at < 0:
            raise ValueError(f"blend.chunks[{i}] does not occur in the prompt"
                             + (" after the chunk before it" if i else ""))
        spans.append((at, at + len(c)))
        pos = at + len(c)
    return spans


def token_spans(tokenizer: Any, text: str, ids: list[int], char_spans: list[tuple[int, int]],
                field: str = "prompt") -> list[list[int]]:
    """Character spans of `text` as token spans of `ids` (its tokenization, with or without the
    tokenizer's special tokens). A token belongs to the chunk holding its last character, so a
    word's leading space goes with the word."""
    ends = None
    for special in (True, False):
        enc = tokenizer(text, add_special_tokens=special, return_offsets_mapping=True)
        if list(enc["input_ids"]) == list(ids):
            ends = [(a, b) for a, b in enc["offset_mapping"]]
            break
    if ends is None:
        raise ValueError(f"{field}: blend chunks need the prompt as text whose tokens are the prompt's")
    out = []
    for i, (a, b) in enumerate(char_spans):
        inside = [t for t, (s, e) in enumerate(ends) if e > s and a <= e - 1 < b]
        if not inside:
            raise ValueError(f"{field}: blend chunk {i} holds no whole token")
        out.append([inside[0], inside[-1] + 1])
    return out


def check_blend_spec(spec: Any, cfg: BlendConfig, num_prompt_tokens: int, num_layers: int) -> None:
    """Raise ValueError naming the field when this engine cannot blend this request."""
    if spec is None:
        return
    if not cfg.enabled:
        raise ValueError("blend: this engine was started without --enable-blending")
    if not isinstance(spec, dict):
        raise ValueError(f"blend must be an object, got {spec!r}")
    unknown = sorted(set(spec) - {"chunks", "recompute_ratio", "check_layer"})
    if unknown:
        raise ValueError(f"blend: unknown key {unknown[0]!r}")
    chunks = spec.get("chunks")
    if not isinstance(chunks, list) or not chunks:
        raise ValueError("blend.chunks must be a non-empty list of [start, end] token spans")
    prev = 0
    for i, c in enumerate(chunks):
        if (not isinstance(c, (list, tuple)) or len(c) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in c)):
            raise ValueError(f"blend.chunks[{i}] must be a [start, end] token span, got {c!r}")
        start, end = c
        if not prev <= start < end <= num_prompt_tokens:
            raise ValueError(f"blend.chunks[{i}] = {list(c)} must be a non-empty span within the prompt's "
                             f"{num_prompt_tokens} tokens, after the chunk before it")
        if end - start > cfg.max_chunk_tokens:
            raise ValueError(f"blend.chunks[{i}] is {end - start} tokens, more than "
                             f"blend_max_chunk_tokens={cfg.max_chunk_tokens}")
        prev = end
    if spec.get("recompute_ratio") is not None:
        check_fraction("blend.recompute_ratio", spec["recompute_ratio"])
    layer = spec.get("check_layer")
    if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < num_layers):
        raise ValueError(f"blend.check_layer must be an integer in [0, {num_layers}), got {layer!r}")


def make_spec(tokenizer: Any, text: str | None, ids: list[int], separator: str,
              options: dict[str, Any] | None = None, field: str = "prompt") -> dict[str, Any] | None:
    """A prompt's blend spec. `options` (a request's `blend`): `chunks`, the chunks' texts (or
    their token spans), and the optional recompute_ratio / check_layer. Without listed chunks,
    those the text's separators mark; None when there are none (an ordinary request)."""
    options = dict(options or {})
    if not isinstance(options, dict):
        raise ValueError(f"blend must be an object, got {options!r}")
    chunks = options.pop("chunks", None)
    if chunks is not None and isinstance(chunks, list) and chunks and all(isinstance(c, (list, tuple)) for c in chunks):
        return {"chunks": [list(c) for c in chunks], **options}  # token spans already (checked by the engine)
    if text is None:
        if chunks is not None:
            raise ValueError("blend.chunks given as text need the prompt as text")
        return None
    char_spans = listed_char_spans(text, chunks) if chunks is not None else separator_char_spans(text, separator)
    if not char_spans:
        return None
    return {"chunks": token_spans(tokenizer, text, ids, char_spans, field), **options}
