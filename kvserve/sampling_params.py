"""SamplingParams, vLLM-compatible names; every field is validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# Integers travel to the engine process (msgpack) and into torch generators: 64-bit signed.
_INT_LIMIT = 2**63


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and -_INT_LIMIT <= v < _INT_LIMIT


def _is_num(v: object) -> bool:
    """A finite number: NaN or inf would poison the whole batch's sampling."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


# extra_args key: the output a request expects, as token ids (OpenAI's `prediction`, predicted
# outputs); with --speculative-config ngram its drafts come from it too (spec_decode/proposer.py).
PREDICTION = "prediction"

@dataclass
class StructuredOutputsParams:
    """A constraint on the generated text, as vLLM (v0.12+) spells it: exactly one of `json`
    (a JSON schema, as a dict or its JSON text), `regex`, `choice`, `grammar` (EBNF / GBNF text)
    or `json_object` (any JSON object). `whitespace_pattern` narrows the whitespace a JSON
    constraint allows. Compiled by the backend in kvserve/structured/.

    `reasoning_end` (kvserve's; the server sets it under --reasoning-parser, as vLLM applies a
    structured output after the reasoning): the constraint starts once the output, or the end of
    the prompt, holds this text (e.g. "</think>"); before it the model reasons unconstrained."""

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    whitespace_pattern: str | None = None
    reasoning_end: str | None = None

    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self) -> None:
        set_kinds = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(set_kinds) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, grammar, "
                             f"json_object; got {set_kinds or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (object or string), got {self.json!r}")
        for name in ("regex", "grammar", "whitespace_pattern", "reasoning_end"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise ValueError(f"structured_outputs.{name} must be a string, got {v!r}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
        if self.reasoning_end == "":
            raise ValueError("structured_outputs.reasoning_end must not be empty")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a boolean, got {self.json_object!r}")

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON values (for the wire and for cache keys)."""
        return {f: getattr(self, f) for f in (*self.KINDS, "whitespace_pattern", "reasoning_end")
                if getattr(self, f) is not None}


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 disables
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    # A grammar the output must follow (kvserve/structured/); a dict is converted on construction.
    structured_outputs: StructuredOutputsParams | None = None
    # Arguments for parts of the engine beyond sampling, as vLLM's extra_args: "kv_transfer_params"
    # (disagg/params.py), PREDICTION (spec_decode/proposer.py). Must survive msgpack: plain JSON values.
    extra_args: dict[str, Any] | None = None
    # Normalised copy of `stop` (always a list); filled in __post_init__.
    stop_strings: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self._validate_types()
        self._validate_ranges()
        if isinstance(self.stop, str):
            self.stop_strings = [self.stop]
        else:
            self.stop_strings = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

    def _validate_types(self) -> None:
        for name in ("n", "top_k", "min_tokens"):
            if not _is_int(getattr(self, name)):
                raise ValueError(f"{name} must be a 64-bit integer, got {getattr(self, name)!r}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty"):
            if not _is_num(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)!r}")
        for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not _is_int(v):
                raise ValueError(f"{name} must be a 64-bit integer or None, got {v!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens", "detokenize"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        stop = self.stop
        if stop is not None and not isinstance(stop, str):
            if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) for s in stop):
                raise ValueError(f"stop must be a string or a list of strings, got {stop!r}")
        if isinstance(stop, str) and stop == "" or isinstance(stop, (list, tuple)) and "" in stop:
            raise ValueError("stop must not contain empty strings")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be StructuredOutputsParams, a dict or None, got {so!r}")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict or None, got {self.extra_args!r}")
        ids = self.stop_token_ids
        if ids is not None and (not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids)):
            raise ValueError(f"stop_token_ids must be a list of non-negative integers, got {ids!r}")

    def _validate_ranges(self) -> None:
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be positive, got {self.repetition_penalty}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.seed is not None and self.seed < 0:
            raise ValueError(f"seed must be non-negative, got {self.seed}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and v < 0:  # the most an engine gives is its max_logprobs (EngineCore.validate)
                raise ValueError(f"{name} must be non-negative, got {v}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def uses_penalties(self) -> bool:
        """Whether sampling needs the request's token history."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def stop_holdback(self) -> int:
        """Characters a stream must hold back: a stop string completed later can only
        start within the last len(stop) - 1 characters, and sent text can't be taken back."""
        return max((len(s) for s in self.stop_strings), default=1) - 1
