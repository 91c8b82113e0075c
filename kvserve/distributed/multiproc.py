"""The `mp` executor: one process per rank on this host.

The engine sends every call to every rank over ZeroMQ (one PUSH socket per rank, pickled
`(call_id, method, args)`); each rank answers `(call_id, rank, ok, result)` on one PULL
socket. Ranks run calls in order, so a pipeline can hold several steps at once: the
engine sends step N+1 while the last stage still computes step N.

Faults: while waiting, the engine watches every rank's process. One that dies (SIGKILL,
OOM) or raises fails the call with a WorkerError naming the rank, and the others are
stopped; ranks exit by themselves when the engine's process goes away (a parent-death
signal, and a check of the parent's pid while idle), so none is orphaned.
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import traceback
from concurrent.futures import Future
from typing import Any

import zmq

from kvserve.config import EngineConfig
from kvserve.core.sched_output import SchedulerOutput
from kvserve.distributed.executor import Executor, WorkerError
from kvserve.fast_exit import exit_process
from kvserve.lifetime import die_with_parent, make_temp_dir

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
_POLL_MS = 100


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "is still running"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _worker_main(parent: int, config: EngineConfig, num_blocks: int, calibration: list[int] | None,
                 eos: int | None, init_method: str, in_addr: str, out_addr: str) -> None:
    """A rank's process: build the Worker, then run calls until 'shutdown' or the engine (`parent`)
    is gone. Its death SIGKILLs the rank: a rank holds nothing to save, and may be stuck in a
    collective with no Python running to handle a gentler signal."""
    if not die_with_parent(signal.SIGKILL, parent):
        return
    # Ctrl-C and SIGTERM to the process group reach the ranks too; the engine decides when they
    # stop, after it has read the KV it saves at shutdown from them.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    rank = config.parallel.rank
    ctx = zmq.Context()
    inp, out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inp.connect(in_addr)
    out.connect(out_addr)
    out.setsockopt(zmq.LINGER, 2000)
    try:
        from kvserve.worker.worker import Worker

        worker = Worker(config, num_blocks, calibration, eos, init_method)
        out.send(pickle.dumps((-1, rank, True, None)))
    except BaseException as e:  # noqa: BLE001 - the engine must learn why
        out.send(pickle.dumps((-1, rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}")))
        return
    while True:
        if not inp.poll(1000):
            if os.getppid() != parent:
                break
            continue
        call_id, method, args = pickle.loads(inp.recv())
        if method == "shutdown":
            break
        try:
            reply = (call_id, rank, True, getattr(worker, method)(*args))
        except Exception as e:  # noqa: BLE001 - reported to the engine, which fails the call
            reply = (call_id, rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        out.send(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
    inp.close()
    out.close()
    ctx.term()


def with_core_binding(config: EngineConfig) -> EngineConfig:
    """cpu_threads_bind None / 'auto': each rank gets an equal share of the cores this process may
    use (ranks that share cores stall each other's all-reduces); left unpinned with fewer cores
    than ranks."""
    par = config.parallel
    if par.cpu_threads_bind not in (None, "auto"):
        return config
    cores = sorted(os.sched_getaffinity(0))
    per = len(cores) // par.world_size
    if per == 0:
        return config
    groups = [",".join(map(str, cores[r * per:(r + 1) * per])) for r in range(par.world_size)]
    return dataclasses.replace(config, parallel=dataclasses.replace(par, cpu_threads_bind="|".join(groups)))


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, num_blocks: int, kv_calibration_ids: list[int] | None,
                 eos_token_id: int | None) -> None:
        super().__init__(config)
        self.world = config.parallel.world_size
        self._ctx = zmq.Context()
        ipc = make_temp_dir("kvserve-mp-")
        self._ipc_dir = ipc
        self._results = self._ctx.socket(zmq.PULL)
        self._results.bind(f"ipc://{ipc}/results")
        self._calls = []
        for r in range(self.world):
            s = self._ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            s.bind(f"ipc://{ipc}/rank{r}")
            self._calls.append(s)
        self._ids = itertools.count()
        self._replies: dict[int, dict[int, Any]] = {}
        self._lock = threading.Lock()
        self._failed: str | None = None
        init_method = f"tcp://127.0.0.1:{free_port()}"
        config = with_core_binding(config)
        self.procs: list[subprocess.Popen] = []
        for r in range(self.world):
            # A fresh interpreter running this module, not multiprocessing's spawn: that would
            # re-import the user's __main__, and a script without a main guard would start again.
            args = (os.getpid(), config.for_rank(r), num_blocks, kv_calibration_ids, eos_token_id, init_method,
                    f"ipc://{ipc}/rank{r}", f"ipc://{ipc}/results")
            p = subprocess.Popen([sys.executable, "-m", "kvserve.distributed.multiproc"], stdin=subprocess.PIPE)
            p.stdin.write(pickle.dumps(args))
            p.stdin.close()
            self.procs.append(p)
        atexit.register(self.shutdown)  # an LLM never closed still stops its ranks and removes its sockets
        try:
            self._wait(-1, STARTUP_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        logger.info("mp executor: %d ranks (tp=%d, pp=%d), pids %s", self.world, self.tp_size, self.pp_size,
                    [p.pid for p in self.procs])

    # ---- calls ----------------------------------------------------------------------------

    def _send(self, method: str, per_rank_args: list[tuple]) -> int:
        self.check_health()
        call_id = next(self._ids)
        for s, args in zip(self._calls, per_rank_args):
            s.send(pickle.dumps((call_id, method, args), protocol=pickle.HIGHEST_PROTOCOL))
        return call_id

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return self.scatter_rpc(method, [args] * self.world)

    def scatter_rpc(self, method: str, per_rank_args: list[tuple]) -> list[Any]:
        replies = self._wait(self._send(method, per_rank_args))
        return [replies[r] for r in range(self.world)]

    def execute_async(self, so: SchedulerOutput) -> Future:
        call_id = self._send("execute_model", [(so,)] * self.world)
        fut: _CallFuture = _CallFuture(self, call_id)
        return fut

    def _wait(self, call_id: int, timeout: float | None = None) -> dict[int, Any]:
        """Every rank's reply to call_id; WorkerError if a rank fails or dies first."""
        waited = 0.0
        with self._lock:
            while len(self._replies.get(call_id, {})) < self.world:
                if self._results.poll(_POLL_MS):
                    cid, rank, ok, value = pickle.loads(self._results.recv())
                    if not ok:
                        self._fail(f"worker rank {rank} failed: {value}")
                    self._replies.setdefault(cid, {})[rank] = value
                    continue
                self.check_health()
                waited += _POLL_MS / 1000
                if timeout is not None and waited > timeout:
                    self._fail(f"ranks did not answer within {timeout:.0f} s")
            return self._replies.pop(call_id)

    def check_health(self) -> None:
        if self._failed is not None:
            raise WorkerError(self._failed)
        for r, p in enumerate(self.procs):
            if p.poll() is not None:
                self._fail(f"worker rank {r} (pid {p.pid}) {_describe_exit(p.returncode)}")

    def _fail(self, message: str) -> None:
        logger.error("mp executor: %s; stopping the other ranks", message)
        self._failed = message
        self._kill_all()
        raise WorkerError(message)

    # ---- shutdown --------------------------------------------------------------------------

    def _kill_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            p.wait()

    def shutdown(self) -> None:
        if self._ctx.closed:
            return
        atexit.unregister(self.shutdown)
        for s in self._calls:
            try:
                s.send(pickle.dumps((-2, "shutdown", ())), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self._kill_all()
        for s in [*self._calls, self._results]:
            s.close(0)
        self._ctx.term()
        for name in os.listdir(self._ipc_dir):
            try:
                os.unlink(os.path.join(self._ipc_dir, name))
            except OSError:
                pass
        try:
            os.rmdir(self._ipc_dir)
        except OSError:
            pass


class _CallFuture(Future):
    """Resolves to the output rank's reply to one execute_model call when asked for it."""

    def __init__(self, executor: MultiprocExecutor, call_id: int) -> None:
        super().__init__()
        self._executor, self._call_id = executor, call_id

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            try:
                self.set_result(self._executor._wait(self._call_id, timeout)[self._executor.output_rank])
            except BaseException as e:
                self.set_exception(e)
        return super().result(0)



if __name__ == "__main__":  # a rank's process: its arguments arrive pickled on stdin
    _worker_main(*pickle.loads(sys.stdin.buffer.read()))
    exit_process(0)
