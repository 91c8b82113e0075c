"""The grammar backends by name, and what `auto` picks."""

from __future__ import annotations

import importlib
import importlib.util

from kvserve.config_sections import STRUCTURED_OUTPUTS_BACKENDS
from kvserve.structured.backend import GrammarBackend

# name -> (module, class, the library it needs)
BACKENDS: dict[str, tuple[str, str, str]] = {
    "xgrammar": ("kvserve.structured.xgrammar_backend", "XGrammarBackend", "xgrammar"),
    "guidance": ("kvserve.structured.guidance_backend", "GuidanceBackend", "llguidance"),
}
# What `auto` tries, first the faster on this project's CPU path (BENCHMARKS.md, scripts/bench_grammar.py).
AUTO_ORDER = ("xgrammar", "guidance")
CHOICES = STRUCTURED_OUTPUTS_BACKENDS
assert set(CHOICES) == {"auto", *BACKENDS}, "config_sections.STRUCTURED_OUTPUTS_BACKENDS lists the backends"


def resolve(name: str) -> str:
    """A backend's name; `auto`: the first of AUTO_ORDER whose library is installed."""
    if name == "auto":
        for candidate in AUTO_ORDER:
            if importlib.util.find_spec(BACKENDS[candidate][2]) is not None:
                return candidate
        raise ValueError("structured outputs need xgrammar or llguidance: pip install xgrammar llguidance")
    if name not in BACKENDS:
        raise ValueError(f"structured_outputs_backend must be one of {', '.join(CHOICES)}, got {name!r}")
    return name


def candidates(name: str) -> list[str]:
    """The backends a constraint may go to, in order: `auto` is every installed one of AUTO_ORDER
    (a constraint the first refuses, such as a JSON-schema keyword xgrammar would ignore, goes to
    the next, as vLLM's auto does); a named backend is itself alone."""
    if name != "auto":
        return [resolve(name)]
    found = [n for n in AUTO_ORDER if importlib.util.find_spec(BACKENDS[n][2]) is not None]
    return found or [resolve("auto")]  # none installed: resolve raises, naming what to install


def backend_class(name: str) -> type[GrammarBackend]:
    module, cls, library = BACKENDS[resolve(name)]
    if importlib.util.find_spec(library) is None:
        raise ValueError(f"structured_outputs_backend {name!r} needs the {library} package: pip install {library}")
    return getattr(importlib.import_module(module), cls)
