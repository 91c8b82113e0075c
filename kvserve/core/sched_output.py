"""What one scheduler step tells the model runner (and the KV connector's worker half)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvserve.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the model runner has not seen, or one resumed after preemption."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    """A request the model runner already holds: only what changed."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    # Generated tokens this step computes (a decode's input): ranks that did not sample them
    # (tensor-parallel peers, earlier pipeline stages) take them from here.
    new_token_ids: list[int] = field(default_factory=list)
    # The request's blocks before new_block_ids: fewer than the runner holds when speculative
    # decoding gave back the slots of rejected drafts since the last step (KVCacheManager.free_tail).
    num_kept_blocks: int = 0


@dataclass
class SchedulerOutput:
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    # Requests the model runner should forget (finished or aborted since the last step).
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # The KV connector's plan for this step (kv_connector.py), opaque to everyone but its
    # worker half, which carries it out around the forward. None without a connector.
    kv_connector_meta: Any = None
    # Speculative decoding (kvserve/spec_decode/): request -> the tokens drafted after its last one. Its
    # num_scheduled_tokens counts them; the runner verifies them and samples the token after.
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Structured outputs (kvserve/structured/manager.py GrammarBitmask): the allowed tokens of the
    # constrained requests that sample this step; the sampler masks the rest. None: no constraint.
    grammar: Any = None

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())
