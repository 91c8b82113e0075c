"""The llguidance backend (https://github.com/guidance-ai/llguidance): an Earley parser over a lexer,
computing each step's mask on the fly; nothing is compiled ahead but the grammar's checked form."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvserve.structured.backend import ConstraintKey, GrammarBackend, Matcher, StructuredOutputError, Vocab


def _grammar(key: ConstraintKey) -> str:
    """The llguidance grammar text of a constraint, checked without a vocabulary."""
    import llguidance as llg

    try:
        if key.kind in ("json", "json_object"):
            options = {"whitespace_flexible": key.whitespace_pattern is not None,
                       "item_separator": ", ", "key_separator": ": "}
            if key.whitespace_pattern is not None:
                options["whitespace_pattern"] = key.whitespace_pattern
            grammar = llg.LLMatcher.grammar_from_json_schema(closed_objects(key.schema()), defaults=options)
        elif key.kind == "choice":
            grammar = llg.grammar_from("choice", key.text)
        else:  # regex, or a Lark / GBNF grammar
            grammar = llg.grammar_from("regex" if key.kind == "regex" else "grammar", key.text)
    except ValueError as e:
        if isinstance(e, StructuredOutputError):
            raise
        raise StructuredOutputError(f"{key.field}: {e}") from None
    error = llg.LLMatcher.validate_grammar(grammar)
    if error:
        raise StructuredOutputError(f"{key.field}: {_first_line(error)}")
    return grammar


def closed_objects(schema: Any) -> Any:
    """The schema with `additionalProperties: false` wherever an object lists its properties and says
    nothing of others: what xgrammar's strict mode does, so both backends produce the same shapes
    (a small model otherwise invents fields)."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in ("enum", "const", "default", "examples", "required") else closed_objects(v))
           for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _first_line(error: str) -> str:
    lines = [ln.strip() for ln in error.strip().splitlines() if ln.strip()]
    return " ".join(lines[:2]) if lines and lines[0].endswith(":") else (lines[0] if lines else error)


class GuidanceMatcher(Matcher):
    """llguidance stops as soon as only the end can follow; the sequence still ends with the end
    token, sampled under a mask that allows only it (as with xgrammar): terminated once it came."""

    def __init__(self, matcher: Any, eos_token_ids: frozenset[int]) -> None:
        self.m = matcher
        self.eos = eos_token_ids
        self.ended = False

    def accept(self, token: int) -> bool:
        if self.m.is_stopped():
            self.ended = token in self.eos
            return self.ended
        return bool(self.m.consume_token(token))

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self.m, bitmask, row)

    def is_terminated(self) -> bool:
        return self.ended

    def validate(self, tokens: list[int]) -> int:
        # llguidance's consume_token leaves the matcher in error on a refused token: ask it instead.
        # A stopped grammar takes only its end token, which drafting never needs.
        if self.ended or self.m.is_stopped():
            return 0
        return int(self.m.validate_tokens(tokens))

    def rollback(self, num_tokens: int) -> None:
        if self.ended and num_tokens:
            self.ended, num_tokens = False, num_tokens - 1
        self.m.rollback(num_tokens)


class _RawTokenizer:
    """What llguidance's TokenizerWrapper reads from a tokenizer, for a vocabulary given as bytes.
    llguidance tokenizes text the grammar forces, so this tokenizes too: longest match first."""

    def __init__(self, vocab: Vocab) -> None:
        self.tokens = vocab.token_bytes
        self.eos_token_id = vocab.eos_token_ids[0]
        self.bos_token_id = None
        self.special_token_ids = list(vocab.special_token_ids)
        specials = set(self.special_token_ids)
        self.index = {t: i for i, t in enumerate(vocab.token_bytes) if t and i not in specials}
        self.longest = max(map(len, self.index))

    def __call__(self, text: bytes | str) -> list[int]:
        data = text.encode() if isinstance(text, str) else text
        out, pos = [], 0
        while pos < len(data):
            for n in range(min(self.longest, len(data) - pos), 0, -1):
                i = self.index.get(data[pos:pos + n])
                if i is not None:
                    out.append(i)
                    pos += n
                    break
            else:
                raise ValueError(f"byte {data[pos]:#x} has no token in the vocabulary")
        return out


class GuidanceBackend(GrammarBackend):
    name = "guidance"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        super().__init__(vocab_size)
        self.tokenizer = tokenizer  # an llguidance.LLTokenizer
        self.eos = frozenset(tokenizer.eos_tokens)

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, vocab_size: int, eos_token_id: int) -> GuidanceBackend:
        from llguidance.hf import from_tokenizer

        return cls(from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_token_id), vocab_size)

    @classmethod
    def from_vocab(cls, vocab: Vocab) -> GuidanceBackend:
        import llguidance as llg

        tok = llg.LLTokenizer(llg.TokenizerWrapper(_RawTokenizer(vocab)), n_vocab=len(vocab.token_bytes))
        return cls(tok, len(vocab.token_bytes))

    @classmethod
    def check(cls, key: ConstraintKey) -> None:
        _grammar(key)

    def compile(self, key: ConstraintKey) -> Any:
        """The checked grammar, and one matcher built from it: building a matcher is where
        llguidance does its work, so the first one is paid here, off the engine's step."""
        import llguidance as llg

        grammar = _grammar(key)
        m = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if m.is_error():
            raise StructuredOutputError(f"{key.field}: {_first_line(m.get_error())}")
        return grammar

    def matcher(self, compiled: Any) -> Matcher:
        import llguidance as llg

        return GuidanceMatcher(llg.LLMatcher(self.tokenizer, compiled, log_level=0), self.eos)
