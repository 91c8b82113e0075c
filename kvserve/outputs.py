"""Outputs returned to callers, with vLLM-compatible field names."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One position: token id -> Logprob (the sampled or actual token first, then the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None  # 'stop' | 'length' | 'abort'
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # num_cached_tokens split by where the K/V came from: "device", "cpu", "disk", "remote"
    num_cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    # Prefill/decode disaggregation (disagg/): on a prefill engine's finished output, where a decode
    # engine fetches this prompt's K/V (vLLM's field)
    kv_transfer_params: dict[str, Any] | None = None
    # An embedding request's pooled vector (pooling_params.py), on its finished output
    embedding: list[float] | None = None
    # Speculative decoding (spec_decode/): tokens drafted for this request's sequences so far and
    # those verification kept; None when the engine does not draft
    num_draft_tokens: int | None = None
    num_accepted_draft_tokens: int | None = None


@dataclass
class EmbeddingOutput:
    """vLLM's EmbeddingOutput: one prompt's embedding."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """vLLM's EmbeddingRequestOutput: what LLM.embed returns per prompt (`.outputs.embedding`)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    num_cached_tokens: int = 0

    @classmethod
    def from_output(cls, out: RequestOutput) -> EmbeddingRequestOutput:
        assert out.embedding is not None, f"request {out.request_id} has no embedding"
        return cls(out.request_id, EmbeddingOutput(out.embedding), out.prompt_token_ids, out.finished,
                   out.num_cached_tokens)
