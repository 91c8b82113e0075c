"""AsyncEngine: EngineCore in a child process, driven from asyncio over ZeroMQ.

    engine = await AsyncEngine.start(EngineConfig.from_kwargs(model=..., dtype="float32"))
    async for delta in engine.generate(prompt_token_ids, SamplingParams(max_tokens=32)):
        print(delta.outputs[0].text, end="")
    await engine.shutdown()

One background task reads the output socket and routes each RequestDelta to
the asyncio.Queue of its request. Sends never wait: the input socket has no
high-water mark, so a send from a `finally` (abort on break / cancel) cannot
block or be cancelled half-way. The reader also watches the child: if it dies,
every open generate() raises EngineDeadError instead of hanging.

Leaving `async for` with break drops the generator; asyncio then closes it and
the ABORT goes out at once. Code that keeps a reference to the generator
should close it (`contextlib.aclosing`) to free the KV blocks promptly.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import logging
import multiprocessing
import shutil
import signal
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import zmq
import zmq.asyncio

from kvserve.config import EngineConfig
from kvserve.engine.engine_proc import run_engine_process
from kvserve.engine.wire import (ABORT, ADD, CLEAR_CACHE, ERROR, FATAL, OUTPUTS, PING, READY, SHUTDOWN, SNAPSHOT, STATS,
                                 STATS_RESULT, STOPPED, AbortMsg, AddMsg, ModelInfo, RequestDelta, ShutdownMsg,
                                 StatsMsg, decode, encode, params_to_wire)
from kvserve.lifetime import make_temp_dir
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

LIVENESS_INTERVAL_S = 0.5
# How long stats() waits for the engine's own answer before taking its latest snapshot: the
# engine answers between steps, and routes that show its state must answer in bounded time.
STATS_TIMEOUT_S = 2.0
# How long shutdown() waits for the engine process to save the KV tiers (EngineCore.close: the
# queued writes, then the blocks still in memory, each bounded by FLUSH_BUDGET_S) and exit,
# before it is terminated.
STOP_BUDGET_S = 30.0


class EngineDeadError(RuntimeError):
    """The engine process is gone; no request on it can finish."""


class KVLoadError(RuntimeError):
    """The request's K/V could not be fetched from a prefill engine (--kv-load-failure-policy fail)."""


class EngineBusyError(RuntimeError):
    """The engine did not answer in time and there is no snapshot of its state yet."""


def load_tokenizer(model: str | None) -> Any:
    """The tokenizer of `model` (None: the embedded default model), as the engine process builds it,
    without any weights: the API process tokenizes and detokenizes with it beside the engine.
    Imported when called: it loads torch, which the API process does after spawning the engine."""
    from kvserve.models.loader import load_tokenizer as load

    return load(model)


class AsyncEngine:
    def __init__(self, proc: multiprocessing.process.BaseProcess, sync_ctx: zmq.Context, inp: zmq.Socket,
                 actx: zmq.asyncio.Context, out: zmq.asyncio.Socket, tmpdir: str) -> None:
        """Use `await AsyncEngine.start(...)`."""
        self._proc = proc
        self._sync_ctx = sync_ctx
        self._inp = inp
        self._actx = actx
        self._out = out
        self._tmpdir = tmpdir
        self._model_info: ModelInfo | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._stats_waiters: dict[int, asyncio.Future] = {}
        self._query_ids = itertools.count()
        self._dead: EngineDeadError | None = None
        self._fatal: str | None = None
        self._closed = False
        self._released = False
        self._reader: asyncio.Task | None = None
        self._stopping: asyncio.Task | None = None
        self._snapshot: tuple[float, dict[str, Any]] | None = None  # (wall time, stats) last sent unasked
        self.stop_signal: int | None = None  # the signal that stopped the engine process on its own
        atexit.register(self._shutdown_sync)

    # ---- start-up ----------------------------------------------------------

    @classmethod
    async def start(cls, config: EngineConfig | None = None, *, startup_timeout: float = 600.0,
                    **engine_kwargs: Any) -> AsyncEngine:
        """Spawn the engine process with `config` (or one built from kvserve.LLM's keyword
        arguments) and wait until it is READY.

        Raises ValueError for bad engine arguments before anything starts, RuntimeError with
        the child's error if it fails or dies during start-up.
        """
        if config is None:
            config = EngineConfig.from_kwargs(**engine_kwargs)
        elif engine_kwargs:
            raise ValueError(f"pass either config or engine keyword arguments, not both (got {sorted(engine_kwargs)})")
        tmpdir = make_temp_dir("kvserve-")  # removed by _shutdown_sync, or at a later start if we are killed
        input_addr, output_addr = f"ipc://{tmpdir}/input", f"ipc://{tmpdir}/output"
        sync_ctx = zmq.Context()
        inp = sync_ctx.socket(zmq.PUSH)
        inp.setsockopt(zmq.SNDHWM, 0)  # never block a send; see the module docstring
        inp.setsockopt(zmq.LINGER, 0)
        inp.bind(input_addr)
        actx = zmq.asyncio.Context()
        out = actx.socket(zmq.PULL)
        out.setsockopt(zmq.LINGER, 0)
        out.bind(output_addr)
        proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_process, args=(config, input_addr, output_addr),
            name="kvserve-engine", daemon=False)  # not daemonic: the engine may start workers of its own
        proc.start()
        self = cls(proc, sync_ctx, inp, actx, out, tmpdir)
        try:
            self._model_info = await self._wait_ready(startup_timeout)
        except BaseException:
            self._shutdown_sync()
            raise
        self._reader = asyncio.get_running_loop().create_task(self._read_loop(), name="kvserve-engine-reader")
        return self

    async def _wait_ready(self, timeout: float) -> ModelInfo:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if await self._out.poll(timeout=int(LIVENESS_INTERVAL_S * 1000)):
                msg = decode(await self._out.recv())
                if msg["type"] == READY:
                    return ModelInfo(**{k: v for k, v in msg.items() if k != "type"})
                if msg["type"] == FATAL:
                    self._proc.join(10)
                    raise RuntimeError(f"engine process failed to start: {msg['message']}\n{msg['traceback']}")
            elif not self._proc.is_alive():
                raise RuntimeError(f"engine process exited with code {self._proc.exitcode} during start-up")
        raise RuntimeError(f"engine process not ready after {timeout} s")

    # ---- public API --------------------------------------------------------

    @property
    def model_info(self) -> ModelInfo:
        assert self._model_info is not None
        return self._model_info

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def is_alive(self) -> bool:
        return self._dead is None and not self._closed and self._proc.is_alive()

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       priority: int = 0, cache_salt: str | None = None) -> AsyncIterator[RequestDelta]:
        """Yield this request's deltas, step by step, until one has finished=True.

        Raises ValueError if the engine rejects the request, EngineDeadError if the
        engine dies. Stopping early (break, cancel, aclose) aborts the request.
        """
        self._check_alive()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        rid = request_id if request_id is not None else uuid.uuid4().hex
        if rid in self._queues:
            raise ValueError(f"request_id {rid!r} is already in use")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        done = False
        try:
            self._send(AddMsg(type=ADD, request_id=rid, prompt_token_ids=list(prompt_token_ids),
                              params=params_to_wire(params), priority=priority, cache_salt=cache_salt,
                              arrival_time=time.time()))
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    done = True  # rejected or engine dead: nothing to abort
                    raise item
                if item.finished:
                    done = True
                yield item
                if done:
                    return
        finally:
            self._queues.pop(rid, None)
            if not done and self.is_alive():
                self._send(AbortMsg(type=ABORT, request_id=rid))

    async def abort(self, request_id: str) -> None:
        """Abort a request; its open generate() gets a last delta with finish_reason 'abort'."""
        self._check_alive()
        self._send(AbortMsg(type=ABORT, request_id=request_id))

    async def stats(self, timeout: float = STATS_TIMEOUT_S) -> dict[str, float | int]:
        """EngineCore.stats() from the engine process, plus num_requests (open requests).

        A busy engine answers between steps; if it has not within `timeout`, this returns the
        snapshot it last sent on its own (at most SNAPSHOT_INTERVAL_S old while it runs), with
        `stats_age_s` saying how old. EngineBusyError if there is none, EngineDeadError if the
        engine is gone.
        """
        try:
            return await self._query(STATS, timeout)
        except asyncio.TimeoutError:
            if self._snapshot is None:
                raise EngineBusyError(f"the engine did not report its state within {timeout} s") from None
            at, stats = self._snapshot
            return dict(stats, stats_age_s=round(max(0.0, time.time() - at), 3))

    async def barrier(self, timeout: float = STATS_TIMEOUT_S) -> None:
        """Return once the engine process has read every message sent before this call: it answers
        a query after them, in order, on the one output socket, so a request it refused already has
        its error queued for its generate(). The engine reads between steps; asyncio.TimeoutError
        if it has not answered within `timeout`, EngineDeadError if it is gone."""
        await self._query(PING, timeout)

    async def clear_kv_cache(self, timeout: float = 10.0) -> dict[str, int]:
        """EngineCore.clear_kv_cache() in the engine process: entries removed per tier.
        EngineBusyError if it has not answered within `timeout` (it still clears, between steps)."""
        try:
            return await self._query(CLEAR_CACHE, timeout)
        except asyncio.TimeoutError:
            raise EngineBusyError(f"the engine did not answer within {timeout} s; it clears its cache "
                                  "when the current step ends") from None

    async def _query(self, kind: str, timeout: float) -> dict[str, Any]:
        self._check_alive()
        qid = next(self._query_ids)
        fut = asyncio.get_running_loop().create_future()
        self._stats_waiters[qid] = fut
        try:
            self._send(StatsMsg(type=kind, query_id=qid))
            return await asyncio.wait_for(fut, timeout)
        finally:
            self._stats_waiters.pop(qid, None)

    async def shutdown(self, timeout: float = STOP_BUDGET_S) -> None:
        """Stop the engine process (SHUTDOWN; after `timeout`, terminate, then kill). Idempotent:
        a second call waits for the first one's stop to finish."""
        if self._stopping is None:
            if self._released:
                return
            self._stopping = asyncio.get_running_loop().create_task(self._shutdown(timeout))
        await asyncio.shield(self._stopping)

    async def _shutdown(self, timeout: float) -> None:
        self._closed = True
        with contextlib.suppress(zmq.ZMQError):
            self._inp.send(encode(ShutdownMsg(type=SHUTDOWN)), zmq.NOBLOCK)
        deadline = time.monotonic() + timeout
        while self._proc.is_alive() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        self._fail_all(EngineDeadError("the engine was shut down"))
        self._shutdown_sync()

    async def __aenter__(self) -> AsyncEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    # ---- internals ---------------------------------------------------------

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self._closed:
            raise EngineDeadError("the engine was shut down")

    def _send(self, msg: dict[str, Any]) -> None:
        try:
            self._inp.send(encode(msg), zmq.NOBLOCK)
        except zmq.ZMQError as e:  # no peer: the child is gone
            raise EngineDeadError(f"cannot reach the engine process: {e}") from None

    async def _read_loop(self) -> None:
        next_check = time.monotonic() + LIVENESS_INTERVAL_S
        try:
            while True:
                if await self._out.poll(timeout=int(LIVENESS_INTERVAL_S * 1000)):
                    self._dispatch(decode(await self._out.recv()))
                if time.monotonic() >= next_check or self._fatal is not None:
                    next_check = time.monotonic() + LIVENESS_INTERVAL_S
                    if not self._proc.is_alive() or self._fatal is not None:
                        await self._drain_remaining()
                        self._mark_dead()
                        return
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug here must not leave callers hanging
            logger.exception("engine output reader failed")
            self._mark_dead(f"engine output reader failed: {e!r}")

    async def _drain_remaining(self) -> None:
        """Deliver what the child sent before it died."""
        while await self._out.poll(timeout=0):
            self._dispatch(decode(await self._out.recv()))

    def _mark_dead(self, reason: str | None = None) -> None:
        if self._dead is not None:
            return
        if reason is None:
            self._proc.join(timeout=1.0)
            if self._fatal is not None:
                reason = f"engine process died after an error: {self._fatal}"
            else:
                reason = f"engine process died (exit code {self._proc.exitcode})"
        if self._closed:
            return
        self._dead = EngineDeadError(reason)
        logger.error("%s", reason)
        self._fail_all(self._dead)

    def _fail_all(self, err: Exception) -> None:
        for q in self._queues.values():
            q.put_nowait(err)
        for fut in self._stats_waiters.values():
            if not fut.done():
                fut.set_exception(err)

    def _dispatch(self, msg: dict[str, Any]) -> None:
        kind = msg["type"]
        if kind == OUTPUTS:
            for d in msg["deltas"]:
                q = self._queues.get(d["request_id"])
                if q is not None:
                    q.put_nowait(RequestDelta.from_wire(d))
        elif kind == ERROR:
            q = self._queues.get(msg["request_id"])
            if q is not None:
                error = KVLoadError if msg.get("kind") == "kv_load" else ValueError
                q.put_nowait(error(msg["message"]))
        elif kind == STATS_RESULT:
            fut = self._stats_waiters.get(msg["query_id"])
            if fut is not None and not fut.done():
                fut.set_result(msg["stats"])
        elif kind == SNAPSHOT:
            self._snapshot = (msg["time"], msg["stats"])
        elif kind == STOPPED:  # it saves its KV tiers and exits; no request on it will finish
            self.stop_signal = msg["signal"]
            self._mark_dead(f"the engine process was stopped by {signal.Signals(msg['signal']).name}")
        elif kind == FATAL:
            self._fatal = msg["message"]
            logger.error("engine process failed:\n%s", msg["traceback"])
        else:
            logger.warning("unexpected message from the engine process: %r", kind)

    def _shutdown_sync(self) -> None:
        """Leave no child process and no socket files behind (also runs at interpreter exit)."""
        self._closed = True
        if self._released:
            return
        self._released = True
        atexit.unregister(self._shutdown_sync)
        if self._proc.is_alive():
            with contextlib.suppress(zmq.ZMQError):
                self._inp.send(encode(ShutdownMsg(type=SHUTDOWN)), zmq.NOBLOCK)
            self._proc.join(5.0)
        if self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(5.0)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5.0)
        self._inp.close(linger=0)
        self._out.close(linger=0)
        self._sync_ctx.term()
        self._actx.term()
        shutil.rmtree(self._tmpdir, ignore_errors=True)
