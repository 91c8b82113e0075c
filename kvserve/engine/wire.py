"""The wire schema between the API process (AsyncEngine) and the engine process (engine_proc.py).

The parent binds two ipc:// sockets; the child connects:

    parent PUSH --input-->  child PULL    add / abort / stats / shutdown
    parent PULL <--output-- child PUSH    ready / outputs / error / stats_result / fatal

Every message is a msgpack map with a "type" field; the TypedDicts below are the whole schema.
After each engine step the child sends ONE `outputs` message holding a delta per request that
changed: new text, new token ids and new logprob entries since the last message, so the wire cost
per step is independent of how long the completions have grown. RequestDelta / CompletionDelta are
those deltas as the parent hands them to callers.

Both sides import this module; it imports neither torch nor the engine.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, TypedDict

import msgpack

from kvserve.outputs import Logprob, PositionLogprobs, RequestMetrics
from kvserve.sampling_params import SamplingParams


# ---- message schema -------------------------------------------------------

# parent -> child
ADD, ABORT, STATS, CLEAR_CACHE, PING, SHUTDOWN = "add", "abort", "stats", "clear_cache", "ping", "shutdown"
# child -> parent
READY, OUTPUTS, ERROR, STATS_RESULT, FATAL = "ready", "outputs", "error", "stats_result", "fatal"
SNAPSHOT, STOPPED = "snapshot", "stopped"


class AddMsg(TypedDict):
    type: Literal["add"]
    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]  # SamplingParams init fields, see params_to_wire
    priority: int
    cache_salt: str | None
    arrival_time: float | None


class AbortMsg(TypedDict):
    type: Literal["abort"]
    request_id: str


class StatsMsg(TypedDict):
    type: Literal["stats", "clear_cache", "ping"]  # clear_cache answers with what it removed, ping with {}
    query_id: int


class ShutdownMsg(TypedDict):
    type: Literal["shutdown"]


@dataclass(frozen=True)
class ModelInfo:
    """What the engine process loaded; sent as the READY message ({"type": "ready", **fields})."""

    model: str | None  # as requested (None: the embedded default model)
    model_path: str  # resolved path of the loaded weights
    max_model_len: int
    vocab_size: int
    block_size: int
    num_kv_blocks: int
    eos_token_id: int | None
    pid: int
    max_logprobs: int = 20  # the most (prompt) logprobs a request may ask for
    # With --kv-events-endpoint: endpoint, replay_endpoint, model_fingerprint, hash_scheme (GET /kv_events)
    kv_events: dict[str, Any] | None = None
    # The model's sampling defaults for requests that omit a field (--generation-config), e.g.
    # {"temperature": 0.6}; models/generation_config.py reads them
    generation_defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
    # With --enable-blending: the BlendConfig's fields and num_layers, what the server marks and checks
    # chunks by; None: off
    blend: dict[str, Any] | None = None
    # --speculative-config's method (ngram, draft_model, self_quantized); None: no drafts
    speculative_method: str | None = None


# One logprob position on the wire: [[token_id, logprob, rank, decoded_token], ...],
# the sampled (or actual) token first, as in PositionLogprobs.
WireLogprobs = list[list[Any]]


class CompletionDeltaWire(TypedDict):
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[WireLogprobs] | None
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: int | str | None


class RequestDeltaWire(TypedDict):
    request_id: str
    completions: list[CompletionDeltaWire]
    finished: bool
    num_prompt_tokens: int
    num_cached_tokens: int
    cached_tokens_by_tier: dict[str, int]
    prompt_logprobs: list[WireLogprobs | None] | None  # sent once, with the first token
    metrics: dict[str, float | None] | None
    kv_transfer_params: dict[str, Any] | None  # on the finished delta (RequestOutput's)
    embedding: list[float] | None  # an embedding request's vector, on its finished delta
    draft_tokens: list[int] | None  # [drafted, accepted] so far (speculative decoding), or None


class OutputsMsg(TypedDict):
    type: Literal["outputs"]
    deltas: list[RequestDeltaWire]


class ErrorMsg(TypedDict):
    type: Literal["error"]
    request_id: str
    message: str
    kind: Literal["invalid", "kv_load"]  # refused on arrival (a ValueError) | its remote K/V failed


def error_kind(why: str) -> Literal["invalid", "kv_load"]:
    """The kind of a request that failed in the engine after it was accepted: a grammar that did
    not compile is the request's own fault (kvserve/structured/; a 400 naming the field), anything
    else failed loading its K/V (a 502)."""
    return "invalid" if why.startswith("structured_outputs") else "kv_load"


class StatsResultMsg(TypedDict):
    type: Literal["stats_result"]
    query_id: int
    stats: dict[str, float | int | str]


class SnapshotMsg(TypedDict):
    """EngineCore.stats() sent unasked while busy (every engine_proc.SNAPSHOT_INTERVAL_S) and with each STATS_RESULT."""

    type: Literal["snapshot"]
    time: float
    stats: dict[str, float | int | str]


class StoppedMsg(TypedDict):
    """The child was stopped by a signal sent to it (not by SHUTDOWN); it saves and exits 0."""

    type: Literal["stopped"]
    signal: int


class FatalMsg(TypedDict):
    type: Literal["fatal"]
    message: str
    traceback: str


def encode(msg: dict[str, Any]) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def decode(buf: bytes) -> dict[str, Any]:
    return msgpack.unpackb(buf, raw=False, strict_map_key=False)


def params_to_wire(params: SamplingParams) -> dict[str, Any]:
    d = {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.init}
    if params.structured_outputs is not None:
        d["structured_outputs"] = params.structured_outputs.to_dict()
    return d


def params_from_wire(d: dict[str, Any]) -> SamplingParams:
    return SamplingParams(**d)


def logprobs_to_wire(pos: PositionLogprobs) -> WireLogprobs:
    return [[tid, lp.logprob, lp.rank, lp.decoded_token] for tid, lp in pos.items()]


def logprobs_from_wire(pos: WireLogprobs) -> PositionLogprobs:
    return {int(tid): Logprob(lp, rank, text) for tid, lp, rank, text in pos}


# ---- the deltas the parent hands to callers --------------------------------


@dataclass
class CompletionDelta:
    """What one completion gained in one engine step."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: int | str | None

    @classmethod
    def from_wire(cls, d: CompletionDeltaWire) -> CompletionDelta:
        lps = None if d["logprobs"] is None else [logprobs_from_wire(p) for p in d["logprobs"]]
        return cls(d["index"], d["text"], list(d["token_ids"]), lps, d["cumulative_logprob"],
                   d["finish_reason"], d["stop_reason"])


@dataclass
class RequestDelta:
    """One request's news from one engine step; `outputs` holds only the completions that changed."""

    request_id: str
    outputs: list[CompletionDelta]
    finished: bool
    num_prompt_tokens: int
    num_cached_tokens: int
    prompt_logprobs: list[PositionLogprobs | None] | None
    metrics: RequestMetrics | None
    cached_tokens_by_tier: dict[str, int] = dataclasses.field(default_factory=dict)
    kv_transfer_params: dict[str, Any] | None = None
    embedding: list[float] | None = None  # an embedding request's vector (pooling_params.py)
    draft_tokens: tuple[int, int] | None = None  # (drafted, accepted) so far; None: no speculative decoding

    @classmethod
    def from_wire(cls, d: RequestDeltaWire) -> RequestDelta:
        plp = d["prompt_logprobs"]
        if plp is not None:
            plp = [None if p is None else logprobs_from_wire(p) for p in plp]
        metrics = RequestMetrics(**d["metrics"]) if d["metrics"] is not None else None
        return cls(d["request_id"], [CompletionDelta.from_wire(c) for c in d["completions"]],
                   d["finished"], d["num_prompt_tokens"], d["num_cached_tokens"], plp, metrics,
                   d["cached_tokens_by_tier"], d["kv_transfer_params"], d["embedding"],
                   None if d["draft_tokens"] is None else tuple(d["draft_tokens"]))
