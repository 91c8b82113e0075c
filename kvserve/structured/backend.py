"""The grammar backend interface: compile a StructuredOutputsParams once, match it per sequence.

A backend wraps a maintained grammar library (xgrammar, llguidance). It is built once per engine
from the tokenizer's vocabulary, compiles constraints into grammars that any number of matchers
share, and fills rows of a token bitmask: int32 words, bit `t % 32` of word `t // 32` set when
token t may come next (the layout both libraries and vLLM use).
"""

from __future__ import annotations

import abc
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvserve.sampling_params import StructuredOutputsParams


class StructuredOutputError(ValueError):
    """An invalid or unsupported constraint; the message starts with the field (structured_outputs.json, ...)."""


@dataclass(frozen=True)
class ConstraintKey:
    """What a compiled grammar depends on: the constraint's kind, its text, and its whitespace pattern.
    Equal keys share one compile."""

    kind: str  # json | regex | choice | grammar | json_object
    text: str
    whitespace_pattern: str | None = None

    @property
    def field(self) -> str:
        return f"structured_outputs.{self.kind}"

    def choices(self) -> list[str]:
        return json.loads(self.text)

    def schema(self) -> dict[str, Any]:
        """The JSON schema of a json / json_object constraint (json_object: any object)."""
        if self.kind == "json_object":
            return {"type": "object"}
        try:
            value = json.loads(self.text)
        except json.JSONDecodeError as e:
            raise StructuredOutputError(f"{self.field}: not valid JSON: {e}") from None
        if not isinstance(value, (dict, bool)):
            raise StructuredOutputError(f"{self.field}: a JSON schema must be an object, got {type(value).__name__}")
        return value


def constraint_key(params: StructuredOutputsParams) -> ConstraintKey:
    kind = params.kind
    value = getattr(params, kind)
    if kind == "json":
        text = value if isinstance(value, str) else json.dumps(value)  # key order is the generation order
    elif kind == "choice":
        text = json.dumps(list(value))
    elif kind == "json_object":
        text = ""
    else:
        text = value
    return ConstraintKey(kind, text, params.whitespace_pattern)


@dataclass(frozen=True)
class Vocab:
    """A vocabulary given as its tokens' bytes (for vocabularies with no HF tokenizer, as in benchmarks).
    Special tokens have no text and are never allowed inside a grammar."""

    token_bytes: list[bytes]
    eos_token_ids: list[int]
    special_token_ids: list[int]


class Matcher(abc.ABC):
    """One sequence's position in its grammar. Not thread-safe: the engine thread owns it."""

    @abc.abstractmethod
    def accept(self, token: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it (the matcher is then
        unusable: the mask should have made that impossible)."""

    @abc.abstractmethod
    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        """Write the tokens allowed next into bitmask[row]; only the end-of-sequence token once complete."""

    @abc.abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and its end token (EOS) was accepted: nothing may follow. Before
        that, a complete grammar's mask allows only the end token."""

    @abc.abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens accepted tokens."""

    def validate(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar allows from here; the matcher does not move.
        (Drafted tokens of speculative decoding are cut where the grammar would refuse them.)"""
        n = 0
        for t in tokens:
            if not self.accept(t):
                break
            n += 1
        self.rollback(n)
        return n


class GrammarBackend(abc.ABC):
    """Compiles constraints for one vocabulary. `compile` may run on any thread; it is the slow part."""

    name: str

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    @classmethod
    @abc.abstractmethod
    def check(cls, key: ConstraintKey) -> None:
        """Raise StructuredOutputError naming the field if the constraint cannot compile. Cheap and
        needs no vocabulary (it parses, it does not compile), so it runs when a request is validated."""

    @abc.abstractmethod
    def compile(self, key: ConstraintKey) -> Any:
        """The compiled grammar (opaque; matchers share it). Raises StructuredOutputError."""

    @abc.abstractmethod
    def matcher(self, compiled: Any) -> Matcher:
        """A fresh matcher at the start of the grammar."""

    def allocate_bitmask(self, rows: int) -> np.ndarray:
        return np.zeros((rows, (self.vocab_size + 31) // 32), dtype=np.int32)


def choice_regex(choices: list[str]) -> str:
    """A regex matching exactly one of the choices (each taken literally)."""
    import re

    return "(" + "|".join(re.escape(c) for c in choices) + ")"
