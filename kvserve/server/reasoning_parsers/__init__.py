"""Reasoning parsers, one file per format, selected by `--reasoning-parser NAME` (REASONING_PARSERS).
A new format is a new file with a registered ReasoningParser subclass (base.py), imported below."""

from kvserve.server.reasoning_parsers import deepseek_r1, qwen3  # noqa: F401 - they register
from kvserve.server.reasoning_parsers.base import REASONING_PARSERS, ReasoningParser, ReasoningStream, register

__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningStream", "register"]
