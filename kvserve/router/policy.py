"""The router's policy interface and registry.

A policy sees a request (its JSON body, session key, prompt text and, when it asks for them,
prompt token ids) and the healthy replicas with their load and, when they publish KV events,
their block mirrors; it returns the replica to try and why (the reason is a /metrics label).
Policies keep their own state (a ring, a radix tree) and are told when a replica leaves.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvserve.core.kv_events import KVEventSubscriber


@dataclass
class ReplicaView:
    """What a policy may read about one replica (the router owns and updates it)."""

    url: str
    healthy: bool = True
    in_flight: int = 0  # requests routed here and not finished
    # prompt tokens left to compute (less what the policy expected cached) of requests here still
    # waiting for their first byte
    pending_prefill_tokens: int = 0
    decode_streams: int = 0  # requests here past their first byte, still generating
    kv_events: KVEventSubscriber | None = None  # its block mirror, when it publishes KV events
    block_size: int | None = None

    @property
    def load(self) -> float:
        """Work queued here in prefill-token units: what least_load and kv_aware weigh."""
        return self.pending_prefill_tokens + DECODE_STREAM_COST * self.decode_streams


# A decode stream's cost in prefill tokens per scheduling horizon: a running stream takes
# one token of every step's budget, and ~a block of prompt per step keeps pace with it.
DECODE_STREAM_COST = 16


@dataclass
class RouteRequest:
    kind: str  # "chat" | "completion"
    body: dict[str, Any]
    session_key: str | None = None  # the X-Session-ID header, else the body's "user"
    text: str = ""  # the prompt as text (chat: the rendered template), for text-based policies
    token_ids: list[int] | None = None  # filled in when the policy's needs_tokens is set
    num_prompt_tokens: int = 0
    cache_salt: str | None = None


@dataclass
class Decision:
    replica: ReplicaView
    reason: str  # a short label: "round_robin", "least_load", "session", "cache_hit", "balance", ...
    cached_tokens: int = 0  # the policy's estimate of the prompt tokens the replica has cached
    extra: dict[str, Any] = field(default_factory=dict)


class Policy(ABC):
    """Chooses a replica. `choose` gets the healthy replicas (never empty), minus any the
    request already failed on; it must not block (no I/O)."""

    name: ClassVar[str]
    needs_tokens: ClassVar[bool] = False  # the router fills RouteRequest.token_ids first

    @abstractmethod
    def choose(self, req: RouteRequest, replicas: list[ReplicaView]) -> Decision: ...

    def on_routed(self, req: RouteRequest, decision: Decision) -> None:
        """The request went to decision.replica and its reply started (text policies learn here)."""

    def on_replica_removed(self, url: str) -> None:
        """The replica left (unhealthy or gone): forget what was learned about it."""


POLICIES: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    POLICIES[cls.name] = cls
    return cls
