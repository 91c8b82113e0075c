"""What one HTTP request has produced so far: its choices (prompt i's sample j is choice i * n + j),
and the usage of all its prompts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.blend.chunks import BLENDED, RECOMPUTED
from kvserve.engine.wire import CompletionDelta, RequestDelta
from kvserve.server import protocol as P


@dataclass
class Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class Accum:
    """What one HTTP request has produced so far, over its prompts (i) and samples (n)."""

    n: int
    choices: dict[int, Choice] = field(default_factory=dict)
    prompt_tokens: dict[int, int] = field(default_factory=dict)
    cached_tokens: dict[int, int] = field(default_factory=dict)
    cached_by_tier: dict[int, dict[str, int]] = field(default_factory=dict)
    prompt_logprobs: dict[int, list] = field(default_factory=dict)
    kv_transfer_params: dict[str, Any] | None = None
    draft_tokens: dict[int, tuple[int, int]] = field(default_factory=dict)  # per prompt: (drafted, accepted)

    def add(self, prompt_idx: int, d: RequestDelta) -> list[tuple[int, CompletionDelta]]:
        if d.kv_transfer_params is not None:
            self.kv_transfer_params = d.kv_transfer_params
        if d.num_prompt_tokens:  # the abort delta carries zeros
            self.prompt_tokens[prompt_idx] = d.num_prompt_tokens
            self.cached_tokens[prompt_idx] = d.num_cached_tokens
            self.cached_by_tier[prompt_idx] = d.cached_tokens_by_tier
        if d.prompt_logprobs is not None:
            self.prompt_logprobs[prompt_idx] = d.prompt_logprobs
        if d.draft_tokens is not None:
            self.draft_tokens[prompt_idx] = d.draft_tokens
        out = []
        for c in d.outputs:
            idx = prompt_idx * self.n + c.index
            ch = self.choices.setdefault(idx, Choice())
            ch.text += c.text
            ch.token_ids += c.token_ids
            ch.logprobs += c.logprobs or []
            ch.finish_reason = c.finish_reason or ch.finish_reason
            ch.stop_reason = c.stop_reason if c.stop_reason is not None else ch.stop_reason
            out.append((idx, c))
        return out

    def usage(self) -> P.Usage:
        prompt = sum(self.prompt_tokens.values())
        completion = sum(len(c.token_ids) for c in self.choices.values())
        by_tier: dict[str, int] = {}
        for split in self.cached_by_tier.values():
            for tier, n in split.items():
                by_tier[tier] = by_tier.get(tier, 0) + n
        blended, recomputed = by_tier.pop(BLENDED, 0), by_tier.pop(RECOMPUTED, 0)
        details = P.PromptTokensDetails(cached_tokens=sum(self.cached_tokens.values()), cached_tokens_by_tier=by_tier,
                                        blended_tokens=blended, recomputed_tokens=recomputed)
        spec = None
        if self.draft_tokens:  # OpenAI's predicted-output counts: drafts kept, and drafts rejected
            drafted = sum(d for d, _ in self.draft_tokens.values())
            accepted = sum(a for _, a in self.draft_tokens.values())
            spec = P.CompletionTokensDetails(accepted_prediction_tokens=accepted,
                                             rejected_prediction_tokens=drafted - accepted)
        return P.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                       prompt_tokens_details=details, completion_tokens_details=spec)
