"""The xgrammar backend (https://github.com/mlc-ai/xgrammar): grammars compiled ahead into per-state
token masks, so a step's mask is mostly a lookup."""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from kvserve.structured.backend import (ConstraintKey, GrammarBackend, Matcher, StructuredOutputError, Vocab,
                                        choice_regex)

# JSON-schema keywords xgrammar (0.2.9) accepts and ignores: a schema using one is refused, naming
# it, rather than producing output that does not validate. Checked one by one against schemas whose
# invalid instance xgrammar let through (uniqueItems, not, contains, dependentRequired); the rest
# are the same families (conditionals, dependencies, contains counts), unverified, refused to be safe.
UNSUPPORTED_KEYWORDS = frozenset({
    "uniqueItems", "not", "contains", "minContains", "maxContains", "dependentRequired", "dependentSchemas",
    "dependencies", "if", "then", "else", "unevaluatedItems"})
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties")


def unsupported_keyword(schema: object, path: str = "") -> str | None:
    """The first keyword of UNSUPPORTED_KEYWORDS in schema and its subschemas, with its JSON pointer."""
    if not isinstance(schema, dict):
        return None
    for key, value in schema.items():
        if key in UNSUPPORTED_KEYWORDS:
            return f"{path}/{key}"
        subs: list[tuple[str, object]] = []
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            subs = [(f"{path}/{key}/{k}", v) for k, v in value.items()]
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            subs = [(f"{path}/{key}/{i}", v) for i, v in enumerate(value)]
        elif key in _SCHEMA_VALUES:
            subs = [(f"{path}/{key}", value)]
        for sub_path, sub in subs:
            found = unsupported_keyword(sub, sub_path)
            if found is not None:
                return found
    return None


# xgrammar's C++ errors start with "[time] /path/file.cc:line: " (and "Check failed: ... is false: ").
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: .*? is false: )?")


def _grammar(key: ConstraintKey) -> Any:
    """Parse the constraint (no vocabulary needed). JSON is compact, as with the guidance backend:
    a small model given free whitespace may emit newlines until max_tokens."""
    import xgrammar as xgr

    if key.whitespace_pattern is not None:
        raise StructuredOutputError("structured_outputs.whitespace_pattern: not supported by the xgrammar "
                                    "backend (the guidance backend supports it)")
    if key.kind == "json":
        found = unsupported_keyword(key.schema())
        if found is not None:
            raise StructuredOutputError(f"structured_outputs.json: the JSON-schema keyword {found.rsplit('/', 1)[1]!r} "
                                        f"(at {found}) is not supported by the xgrammar backend")
    try:
        if key.kind in ("json", "json_object"):
            return xgr.Grammar.from_json_schema(key.text if key.kind == "json" else '{"type": "object"}',
                                                any_whitespace=False, strict_mode=True)
        if key.kind == "regex":
            return xgr.Grammar.from_regex(key.text)
        if key.kind == "choice":
            return xgr.Grammar.from_regex(choice_regex(key.choices()))
        return xgr.Grammar.from_ebnf(key.text)
    except (RuntimeError, ValueError, TypeError) as e:
        if isinstance(e, StructuredOutputError):
            raise
        msg = _CPP_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
        raise StructuredOutputError(f"{key.field}: {msg}") from None


class XGrammarMatcher(Matcher):
    def __init__(self, matcher: Any, clear: list[tuple[int, int]]) -> None:
        self.m = matcher
        self.clear = clear

    def accept(self, token: int) -> bool:
        return bool(self.m.accept_token(token))

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        self.m.fill_next_token_bitmask(bitmask, row)
        for word, keep in self.clear:  # special tokens xgrammar would take as text
            bitmask[row, word] &= keep

    def is_terminated(self) -> bool:
        return bool(self.m.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        self.m.rollback(num_tokens)


class XGrammarBackend(GrammarBackend):
    name = "xgrammar"

    def __init__(self, info: Any, vocab_size: int, special_ids: list[int], max_threads: int = 1) -> None:
        import xgrammar as xgr

        super().__init__(vocab_size)
        self.compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
        # (word, bits to keep) clearing special tokens: xgrammar reads e.g. <|im_start|> as its text.
        words: dict[int, int] = {}
        for t in special_ids:
            words[t // 32] = words.get(t // 32, 0) | (1 << (t % 32))
        self.clear = [(w, int(np.array(~bits & 0xFFFFFFFF, dtype=np.uint32).view(np.int32))) for w, bits in words.items()]

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, vocab_size: int, eos_token_id: int) -> XGrammarBackend:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=[eos_token_id])
        specials = [t for t in getattr(tokenizer, "all_special_ids", []) if t != eos_token_id and t < vocab_size]
        return cls(info, vocab_size, specials)

    @classmethod
    def from_vocab(cls, vocab: Vocab) -> XGrammarBackend:
        import xgrammar as xgr

        specials = set(vocab.special_token_ids) - set(vocab.eos_token_ids)
        encoded = [b"" if i in specials else t for i, t in enumerate(vocab.token_bytes)]
        info = xgr.TokenizerInfo(encoded, xgr.VocabType.RAW, vocab_size=len(encoded),
                                 stop_token_ids=list(vocab.eos_token_ids))
        return cls(info, len(encoded), sorted(specials))

    @classmethod
    def check(cls, key: ConstraintKey) -> None:
        _grammar(key)

    def compile(self, key: ConstraintKey) -> Any:
        return self.compiler.compile_grammar(_grammar(key))

    def matcher(self, compiled: Any) -> Matcher:
        import xgrammar as xgr

        return XGrammarMatcher(xgr.GrammarMatcher(compiled, max_rollback_tokens=-1), self.clear)
