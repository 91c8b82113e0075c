"""The engine core in its own process, driven over ZeroMQ with msgpack messages.

The API process must never stall the step loop through the GIL, so EngineCore
runs in a child process (spawned, never forked: torch and zmq state do not
survive a fork). The parent binds two ipc:// sockets; the child connects:

    parent PUSH --input-->  child PULL    add / abort / stats / shutdown
    parent PULL <--output-- child PUSH    ready / outputs / error / stats_result / fatal

Every message is a msgpack map with a "type" field; the TypedDicts below are
the whole schema. After each engine step the child sends ONE `outputs`
message holding a delta per request that changed: new text, new token ids
and new logprob entries since the last message, so the wire cost per step is
independent of how long the completions have grown.

The child never outlives the parent: the kernel signals it when the parent dies (SIGKILL, OOM)
and every loop iteration checks, busy or idle; no send to a parent that stopped reading waits
forever (ParentLink). It then stops as on SIGTERM, saving the KV tiers.

This module imports neither torch nor the engine at import time: the parent
(API process) uses the schema and the delta types from here.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal, TypedDict

import msgpack
import zmq

from kvserve.config import BlendConfig, EngineConfig
from kvserve.fast_exit import exit_process
from kvserve.lifetime import die_with_parent, remove_stale_temp_dirs
from kvserve.outputs import Logprob, PositionLogprobs, RequestMetrics, RequestOutput
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# How long the idle child blocks on its input socket before re-checking that
# its parent is still alive (an orphaned engine would hold memory forever).
IDLE_POLL_MS = 500
# How long a send to the parent waits for room in a full queue before it checks that the parent
# still lives (a dead one never reads again); it waits on only while it does.
SEND_TIMEOUT_MS = 500
# LINGER of the output socket at exit while the parent lives: its last messages (STOPPED, FATAL)
# still reach it. An orphan drops what is queued.
EXIT_LINGER_MS = 5000
# The kernel's signal to this process when its parent exits (die_with_parent): handled as
# SIGTERM is (stop after the step, save the KV tiers, exit), once getppid shows the parent gone.
PARENT_DEATH_SIGNAL = signal.SIGUSR1
# While busy, the child sends a stats snapshot this often, so a route that reads the engine's
# state answers from a recent one when the engine cannot answer a query at once.
SNAPSHOT_INTERVAL_S = 1.0

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


class OutputsMsg(TypedDict):
    type: Literal["outputs"]
    deltas: list[RequestDeltaWire]


class ErrorMsg(TypedDict):
    type: Literal["error"]
    request_id: str
    message: str
    kind: Literal["invalid", "kv_load"]  # refused on arrival (a ValueError) | its remote K/V failed


class StatsResultMsg(TypedDict):
    type: Literal["stats_result"]
    query_id: int
    stats: dict[str, float | int | str]


class SnapshotMsg(TypedDict):
    """EngineCore.stats() sent unasked while busy (every SNAPSHOT_INTERVAL_S) and with each STATS_RESULT."""

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
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params) if f.init}


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

    @classmethod
    def from_wire(cls, d: RequestDeltaWire) -> RequestDelta:
        plp = d["prompt_logprobs"]
        if plp is not None:
            plp = [None if p is None else logprobs_from_wire(p) for p in plp]
        metrics = RequestMetrics(**d["metrics"]) if d["metrics"] is not None else None
        return cls(d["request_id"], [CompletionDelta.from_wire(c) for c in d["completions"]],
                   d["finished"], d["num_prompt_tokens"], d["num_cached_tokens"], plp, metrics,
                   d["cached_tokens_by_tier"], d["kv_transfer_params"], d["embedding"])


# ---- child side: turning cumulative RequestOutputs into deltas -------------


@dataclass
class _Sent:
    text: int = 0  # characters
    tokens: int = 0
    logprobs: int = 0
    finished: bool = False


@dataclass
class _Tracked:
    n: int
    hold: int  # characters held back: they could still become part of a stop string
    completions: dict[int, _Sent]
    prompt_logprobs_sent: bool = False


class DeltaTracker:
    """Remembers what was already sent for each request.

    Text that could be the start of a stop string is held back until decided:
    a stop string that matches later truncates the text, and text already sent
    cannot be taken back. Since a match can only start within the last
    len(stop) - 1 characters of the text before the token that completes it,
    holding back max(len(stop)) - 1 characters is enough.
    """

    def __init__(self) -> None:
        self.requests: dict[str, _Tracked] = {}

    def add(self, request_id: str, params: SamplingParams) -> None:
        hold = params.stop_holdback
        self.requests[request_id] = _Tracked(params.n, hold, {i: _Sent() for i in range(params.n)})

    def delta(self, out: RequestOutput) -> RequestDeltaWire | None:
        tr = self.requests.get(out.request_id)
        if tr is None:
            return None
        comps = [c for c in (self._completion(tr, co) for co in out.outputs) if c is not None]
        plp = None
        if out.prompt_logprobs is not None and not tr.prompt_logprobs_sent and (
                out.finished or any(co.token_ids for co in out.outputs)):
            plp = [None if p is None else logprobs_to_wire(p) for p in out.prompt_logprobs]
            tr.prompt_logprobs_sent = True
        if out.finished:
            del self.requests[out.request_id]
        elif not comps and plp is None:
            return None
        m = out.metrics
        return RequestDeltaWire(request_id=out.request_id, completions=comps, finished=out.finished,
                                num_prompt_tokens=len(out.prompt_token_ids),
                                num_cached_tokens=out.num_cached_tokens,
                                cached_tokens_by_tier=out.num_cached_tokens_by_tier, prompt_logprobs=plp,
                                metrics=dataclasses.asdict(m) if m is not None else None,
                                kv_transfer_params=out.kv_transfer_params, embedding=out.embedding)

    def _completion(self, tr: _Tracked, co) -> CompletionDeltaWire | None:
        sent = tr.completions[co.index]
        if sent.finished:
            return None
        finished = co.finish_reason is not None
        ready = len(co.text) if finished else len(co.text) - tr.hold
        text = co.text[sent.text:ready] if ready > sent.text else ""
        tokens = co.token_ids[sent.tokens:]
        lps = None
        if co.logprobs is not None:
            lps = [logprobs_to_wire(p) for p in co.logprobs[sent.logprobs:]]
            sent.logprobs = len(co.logprobs)
        if not (text or tokens or finished):
            return None
        sent.text, sent.tokens, sent.finished = max(sent.text, ready), len(co.token_ids), finished
        return CompletionDeltaWire(index=co.index, text=text, token_ids=list(tokens), logprobs=lps,
                                   cumulative_logprob=co.cumulative_logprob,
                                   finish_reason=co.finish_reason, stop_reason=co.stop_reason)

    def abort(self, request_id: str) -> RequestDeltaWire | None:
        """The final delta of an aborted request: its unfinished completions end with 'abort'."""
        tr = self.requests.pop(request_id, None)
        if tr is None:
            return None
        comps = [CompletionDeltaWire(index=i, text="", token_ids=[], logprobs=None, cumulative_logprob=None,
                                     finish_reason="abort", stop_reason=None)
                 for i, s in tr.completions.items() if not s.finished]
        return RequestDeltaWire(request_id=request_id, completions=comps, finished=True, num_prompt_tokens=0,
                                num_cached_tokens=0, cached_tokens_by_tier={}, prompt_logprobs=None,
                                metrics=None, kv_transfer_params=None, embedding=None)


# ---- child side: the loop ---------------------------------------------------


class ParentLink:
    """The output socket to the parent process, and whether that process lives.

    No send blocks forever: a full queue (the parent catching up) is waited on in SEND_TIMEOUT_MS
    slices while the parent lives and `give_up()` is false; otherwise the message is dropped.
    """

    def __init__(self, sock: zmq.Socket, parent_pid: int) -> None:
        self.sock = sock
        self.parent_pid = parent_pid
        sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)

    def alive(self) -> bool:
        """The parent has not exited (then this process would have been given another parent)."""
        return os.getppid() == self.parent_pid

    def send(self, msg: dict[str, Any], give_up: Callable[[], bool] = lambda: False) -> bool:
        buf = encode(msg)
        while True:
            try:
                self.sock.send(buf)
                return True
            except zmq.Again:
                if give_up() or not self.alive():
                    return False

    def close(self) -> None:
        self.sock.close(linger=EXIT_LINGER_MS if self.alive() else 0)


class EngineLoop:
    def __init__(self, engine, inp: zmq.Socket, link: ParentLink) -> None:
        self.engine = engine
        self.inp = inp
        self.link = link
        self.tracker = DeltaTracker()
        self.pending: list[RequestDeltaWire] = []  # abort deltas, sent before the next step
        self.flush = False  # an abort left finished ids for the model runner to drop
        self.stopping = False
        self.stop_signal: int | None = None  # set by on_signal
        self.last_snapshot = 0.0

    def on_signal(self, signum: int, _frame: Any) -> None:
        """SIGTERM / SIGINT to this process (alone, or with its group): stop after the current step,
        as SHUTDOWN would; run_engine_process then saves the KV tiers and exits."""
        self.stop_signal = signum
        self.stopping = True

    def on_parent_death(self, _signum: int, _frame: Any) -> None:
        """PARENT_DEATH_SIGNAL: stop as on SIGTERM if the parent is gone (not just one of its threads)."""
        if not self.link.alive():
            self.stopping = True

    def run(self) -> None:
        """Serve until SHUTDOWN, a stop signal, or the parent's death (checked every iteration: a
        busy engine must not generate on for no one)."""
        poller = zmq.Poller()
        poller.register(self.inp, zmq.POLLIN)
        while not self.stopping and self.link.alive():
            busy = self.engine.has_unfinished_requests() or self.flush
            if not busy and not poller.poll(IDLE_POLL_MS):
                continue
            self._drain()
            if self.stopping:
                return
            if self.engine.has_unfinished_requests() or self.flush:
                self.flush = False
                outs = self.engine.step()
                self.pending.extend(d for d in map(self.tracker.delta, outs) if d is not None)
                for rid, why in self.engine.take_errors().items():
                    self.tracker.requests.pop(rid, None)
                    self._send(ErrorMsg(type=ERROR, request_id=rid, message=why, kind="kv_load"))
            if self.pending:
                self._send(OutputsMsg(type=OUTPUTS, deltas=self.pending))
                self.pending = []
            if time.monotonic() - self.last_snapshot >= SNAPSHOT_INTERVAL_S:
                self._send_snapshot()

    def _send(self, msg: dict[str, Any]) -> None:
        """To the parent; a message it can no longer take (it died, or we stop) is dropped."""
        if not self.link.send(msg, give_up=lambda: self.stopping):
            self.stopping = True

    def _stats(self) -> dict[str, Any]:
        return dict(self.engine.stats(), num_requests=len(self.tracker.requests))

    def _send_snapshot(self, stats: dict[str, Any] | None = None) -> None:
        self.last_snapshot = time.monotonic()
        self._send(SnapshotMsg(type=SNAPSHOT, time=time.time(), stats=stats or self._stats()))

    def _drain(self) -> None:
        while True:
            try:
                buf = self.inp.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(decode(buf))

    def _handle(self, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        if kind == ADD:
            self._add(msg)  # type: ignore[arg-type]
        elif kind == ABORT:
            rid = msg["request_id"]
            self.engine.abort_request(rid)
            self.flush = True
            d = self.tracker.abort(rid)
            if d is not None:
                self.pending.append(d)
        elif kind == STATS:
            stats = self._stats()
            self._send(StatsResultMsg(type=STATS_RESULT, query_id=msg["query_id"], stats=stats))
            self._send_snapshot(stats)
        elif kind == PING:  # AsyncEngine.barrier: the answer says every earlier message was read
            self._send(StatsResultMsg(type=STATS_RESULT, query_id=msg["query_id"], stats={}))
        elif kind == CLEAR_CACHE:
            cleared = self.engine.clear_kv_cache()
            self._send(StatsResultMsg(type=STATS_RESULT, query_id=msg["query_id"], stats=cleared))
        elif kind == SHUTDOWN:
            self.stopping = True
        else:
            raise RuntimeError(f"unknown message type {kind!r}")

    def _add(self, msg: AddMsg) -> None:
        rid = msg["request_id"]
        try:
            params = params_from_wire(msg["params"])
            self.engine.add_request(rid, list(msg["prompt_token_ids"]), params,
                                    arrival_time=msg.get("arrival_time"), priority=msg["priority"],
                                    cache_salt=msg["cache_salt"])
        except (ValueError, TypeError) as e:
            self._send(ErrorMsg(type=ERROR, request_id=rid, message=str(e), kind="invalid"))
            return
        self.tracker.add(rid, params)


def build_engine(config: EngineConfig):
    """EngineCore from the config the parent built (it arrived pickled)."""
    from kvserve.engine.core import EngineCore

    return EngineCore(config)


def kv_events_info(engine) -> dict[str, Any] | None:
    pub = engine.kv_events
    if pub is None:
        return None
    return {"endpoint": pub.endpoint, "replay_endpoint": pub.replay_endpoint,
            "model_fingerprint": pub.header["model_fingerprint"], "hash_scheme": pub.header["hash_scheme"]}


def blend_info(cfg: BlendConfig, num_layers: int) -> dict[str, Any] | None:
    return {**asdict(cfg), "num_layers": num_layers} if cfg.enabled else None


def ready_message(engine, config: EngineConfig) -> dict[str, Any]:
    info = ModelInfo(model=config.model.model, model_path=str(engine.model_path),
                     max_model_len=engine.max_model_len, vocab_size=engine.vocab_size,
                     block_size=engine.kv.block_size, num_kv_blocks=engine.kv.num_blocks,
                     eos_token_id=engine.eos_token_id, pid=os.getpid(), max_logprobs=engine.max_logprobs,
                     kv_events=kv_events_info(engine),
                     generation_defaults=engine.generation_defaults,
                     blend=blend_info(config.blend, engine.hf_config.num_hidden_layers))
    return {"type": READY, **asdict(info)}


class _StopSignal(SystemExit):
    pass


def _raise_exit(signum: int, _frame: Any) -> None:
    raise _StopSignal(128 + signum)


def _parent_pid() -> int:
    """The pid of the process that started this one (the API process)."""
    parent = multiprocessing.parent_process()
    return parent.pid if parent is not None else os.getppid()


def run_engine_process(config: EngineConfig, input_addr: str, output_addr: str) -> None:
    """Child process entry point: build the engine, send READY, serve until SHUTDOWN.

    Exits 0 after SHUTDOWN (or when the parent has died), 1 after sending FATAL. SIGTERM or
    SIGINT, to this process alone or to its whole group (Ctrl-C, systemd, `kill -- -PGID`), stops
    it as SHUTDOWN does: after the current step, the KV tiers are saved (EngineCore.close, within
    its budget) and STOPPED tells the parent, which stops too. The parent's death (SIGKILL, OOM),
    busy or idle, is the same stop without the messages (PARENT_DEATH_SIGNAL, and a getppid check
    every iteration): what was queued for the parent is dropped, the KV tiers are saved, and the
    parent's temp directory is removed.
    """
    parent = _parent_pid()
    # Until the loop runs there is nothing to save: a stop signal ends start-up at once.
    signal.signal(signal.SIGTERM, _raise_exit)
    signal.signal(signal.SIGINT, _raise_exit)
    signal.signal(PARENT_DEATH_SIGNAL, lambda s, f: None if os.getppid() == parent else _raise_exit(s, f))
    if not die_with_parent(PARENT_DEATH_SIGNAL, parent):
        exit_process(0)  # it died before it could ask for the signal: nobody wants this engine
    ctx = zmq.Context()
    link = ParentLink(ctx.socket(zmq.PUSH), parent)
    link.sock.connect(output_addr)
    inp = ctx.socket(zmq.PULL)
    inp.setsockopt(zmq.LINGER, 0)
    inp.connect(input_addr)
    code = 0
    engine = None
    try:
        engine = build_engine(config)
        loop = EngineLoop(engine, inp, link)
        signal.signal(signal.SIGTERM, loop.on_signal)
        signal.signal(signal.SIGINT, loop.on_signal)
        signal.signal(PARENT_DEATH_SIGNAL, loop.on_parent_death)
        link.send(ready_message(engine, config))
        loop.run()
        if loop.stop_signal is not None:
            link.send(StoppedMsg(type=STOPPED, signal=loop.stop_signal), give_up=lambda: True)
    except _StopSignal as e:  # during start-up
        code = e.code
    except BaseException as e:  # noqa: BLE001 - anything here must reach the parent
        code = 1
        link.send(FatalMsg(type=FATAL, message=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()),
                  give_up=lambda: True)
    finally:
        orphaned = not link.alive()
        if orphaned:
            logger.warning("kvserve engine: the parent process %d has exited; saving the KV tiers and exiting",
                           parent)
        if engine is not None:
            engine.close()  # queued KV tier writes reach the disk before we go
        inp.close()
        link.close()
        ctx.term()
        if orphaned:
            remove_stale_temp_dirs()  # the parent's, with the sockets it bound
    exit_process(code)  # everything it owns is closed; skip the interpreter's teardown
