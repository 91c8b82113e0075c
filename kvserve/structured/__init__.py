"""Structured outputs: grammar-constrained decoding (JSON schema, regex, choice, grammar).

backend.py (the interface), one file per backend (xgrammar, guidance), registry.py (names and
`auto`), cache.py (compiles by constraint text, on a thread pool), manager.py (the engine's
matchers and the step's bitmask)."""

from kvserve.structured.backend import ConstraintKey, StructuredOutputError, constraint_key
from kvserve.structured.manager import GrammarBitmask, StructuredOutputManager
from kvserve.structured.registry import CHOICES, resolve

__all__ = ["CHOICES", "ConstraintKey", "GrammarBitmask", "StructuredOutputError", "StructuredOutputManager",
           "constraint_key", "resolve"]
