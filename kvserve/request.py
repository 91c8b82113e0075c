"""Request: the unit the scheduler and KV manager work on."""

from __future__ import annotations

import enum
import time

from kvserve.pooling_params import pooling_params
from kvserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    WAITING_FOR_REMOTE_KV = 1  # waiting, and not schedulable until its KV connector has loaded its KV
    RUNNING = 2
    PREEMPTED = 3
    # Everything from here on is finished.
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort"}.get(self)


class Request:
    """One sequence being generated.

    `all_token_ids` is prompt + output. `num_computed_tokens` counts the tokens
    whose K/V are in the cache; the scheduler's only job is to close the gap
    `num_tokens - num_computed_tokens`. `block_ids` and `block_hashes` are owned
    by the KV manager.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        max_tokens: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.priority = priority
        self.cache_salt = cache_salt
        # Resolved output limit (sampling_params.max_tokens or what fits in max_model_len).
        self.max_tokens = max_tokens if max_tokens is not None else (sampling_params.max_tokens or 16)
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None

        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # set when first scheduled
        self.num_cached_tokens_by_tier: dict[str, int] = {}  # the same, split by where the K/V came from
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []
        # (first block, salt): blocks from that index on hold K/V a KV connector writes in its own
        # way (KVConnector.block_salt), so the prefix cache keys them apart. None: all plain.
        self.extra_salt: tuple[int, str] | None = None
        # Requests asking for prompt logprobs, or mean-pooled embeddings, need every prompt position computed.
        pooling = pooling_params(sampling_params)
        self.skip_prefix_cache = (sampling_params.prompt_logprobs is not None
                                  or (pooling is not None and pooling.needs_every_position))
        # n > 1: followers share the leader's prompt blocks and wait until it computed them.
        self.leader_id: str | None = None
        self.num_preemptions = 0

        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def block_salt(self, index: int) -> str | None:
        """The salt block `index` is hashed with: cache_salt, joined by `extra_salt` from its block on."""
        if self.extra_salt is None or index < self.extra_salt[0]:
            return self.cache_salt
        return f"{self.cache_salt or ''}\x00{self.extra_salt[1]}"

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, status={self.status.name})")
