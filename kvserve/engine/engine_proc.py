"""The engine core in its own process, driven over ZeroMQ with msgpack messages: the loop and
the start-up of the child. The messages are declared in wire.py (both sides import it); what each
`outputs` message carries is worked out by delta_tracker.py.

The API process must never stall the step loop through the GIL, so EngineCore
runs in a child process (spawned, never forked: torch and zmq state do not
survive a fork). The parent binds two ipc:// sockets; the child connects.

The child never outlives the parent: the kernel signals it when the parent dies (SIGKILL, OOM)
and every loop iteration checks, busy or idle; no send to a parent that stopped reading waits
forever (ParentLink). It then stops as on SIGTERM, saving the KV tiers.

This module imports neither torch nor the engine at import time (run_engine_process imports the
engine in the child).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import zmq

from kvserve.config import BlendConfig, EngineConfig
from kvserve.engine.delta_tracker import DeltaTracker
from kvserve.engine.wire import (ABORT, ADD, CLEAR_CACHE, ERROR, FATAL, OUTPUTS, PING, READY, SHUTDOWN, SNAPSHOT, STATS,
                                 STATS_RESULT, STOPPED, AddMsg, ErrorMsg, FatalMsg, ModelInfo, OutputsMsg,
                                 RequestDeltaWire, SnapshotMsg, StatsResultMsg, StoppedMsg, decode, encode, error_kind,
                                 params_from_wire)
from kvserve.fast_exit import exit_process
from kvserve.lifetime import die_with_parent, remove_stale_temp_dirs


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
                    self._send(ErrorMsg(type=ERROR, request_id=rid, message=why, kind=error_kind(why)))
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
                     blend=blend_info(config.blend, engine.hf_config.num_hidden_layers),
                     speculative_method=config.speculative.method if config.speculative.enabled else None)
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
