"""`kvserve router`: an OpenAI-compatible front over several `kvserve serve` replicas.

    kvserve router --replica http://127.0.0.1:8001 --replica http://127.0.0.1:8002 [--policy NAME]
    kvserve router --launch 2 [--policy NAME] -- [MODEL] [engine flags for `kvserve serve`]

With --launch N the router starts N replicas itself, each on a free port with its own KV
events endpoint and its own share of this process's CPU cores, waits until they answer
/health, and stops them (SIGTERM, then SIGKILL) when it exits for any reason.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn

from kvserve.router.policies import load_policies
from kvserve.router.replicas import DEFAULT_HEALTH_INTERVAL

DEFAULT_LAUNCH_TIMEOUT = 300.0
STOP_TIMEOUT = 15.0
# Flags the router sets on the replicas it launches (each its own port and events endpoint).
OWNED_FLAGS = ("--host", "--port", "--kv-events-endpoint", "--kv-events-replay-endpoint", "--api-key")


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--replica", action="append", default=[], metavar="URL",
                   help="a running `kvserve serve` replica, e.g. http://127.0.0.1:8001 (repeatable)")
    p.add_argument("--launch", type=int, default=0, metavar="N",
                   help="start N `kvserve serve` replicas, splitting this machine's cores between them; "
                        "their engine flags go after `--`")
    p.add_argument("--policy", default="kv_aware", choices=sorted(load_policies()),
                   help="how a replica is chosen per request (default kv_aware)")
    p.add_argument("--health-interval", type=float, default=DEFAULT_HEALTH_INTERVAL, metavar="SECONDS",
                   help=f"seconds between replica health checks (default {DEFAULT_HEALTH_INTERVAL:g})")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="the replicas' model or tokenizer, when the router cannot read their model path")
    p.add_argument("--api-key", default=None,
                   help="key for the router's own probes, and given to --launch replicas; clients' "
                        "Authorization headers are forwarded unchanged")
    p.add_argument("--launch-timeout", type=float, default=DEFAULT_LAUNCH_TIMEOUT, metavar="SECONDS",
                   help=f"how long --launch waits for a replica to answer /health (default {DEFAULT_LAUNCH_TIMEOUT:g})")
    p.add_argument("engine_args", nargs=argparse.REMAINDER, metavar="-- ENGINE_FLAGS",
                   help="flags for the `kvserve serve` replicas of --launch")


def _check_args(args: argparse.Namespace) -> list[str]:
    """Validate the flags; returns the engine flags for launched replicas."""
    extra = list(args.engine_args)
    if extra and extra[0] != "--":
        raise ValueError(f"unexpected argument {extra[0]!r}; engine flags for --launch replicas go after `--`")
    extra = extra[1:]
    if args.launch < 0:
        raise ValueError(f"--launch must be >= 0, got {args.launch}")
    if extra and not args.launch:
        raise ValueError("engine flags after `--` are for --launch replicas; without --launch, give them "
                         "to each `kvserve serve`")
    if not args.launch and not args.replica:
        raise ValueError("give --replica URL (repeatable) or --launch N")
    for flag in OWNED_FLAGS:
        if any(a == flag or a.startswith(flag + "=") for a in extra):
            raise ValueError(f"{flag} after `--`: the router sets it on each replica it launches"
                             + ("; use the router's --api-key" if flag == "--api-key" else ""))
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.health_interval <= 0:
        raise ValueError(f"--health-interval must be > 0 seconds, got {args.health_interval}")
    if args.launch_timeout <= 0:
        raise ValueError(f"--launch-timeout must be > 0 seconds, got {args.launch_timeout}")
    return extra


# ---- launching replicas -------------------------------------------------------------------

@dataclass
class Launched:
    url: str
    proc: subprocess.Popen
    cores: list[int]
    log: Path

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""


def free_ports(n: int) -> list[int]:
    """n distinct free ports (all held open while choosing, so none repeats)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]


def split_cores(n: int) -> list[list[int]]:
    """This process's cores dealt round-robin to n replicas (a core shared if n exceeds them)."""
    cpus = sorted(os.sched_getaffinity(0))
    return [cpus[i::n] or [cpus[i % len(cpus)]] for i in range(n)]


def _child_setup(cores: list[int]) -> Any:
    def setup() -> None:
        os.sched_setaffinity(0, cores)
        with contextlib.suppress(Exception):  # Linux: die with the router even if it is SIGKILLed
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    return setup


class ReplicaLauncher:
    def __init__(self, n: int, engine_args: list[str], api_key: str | None = None) -> None:
        self.n, self.engine_args, self.api_key = n, engine_args, api_key
        self.log_dir = Path(tempfile.mkdtemp(prefix="kvserve-router-"))
        self.replicas: list[Launched] = []

    def start(self) -> list[Launched]:
        ports = free_ports(3 * self.n)
        for i, cores in enumerate(split_cores(self.n)):
            http, ev, replay = ports[3 * i:3 * i + 3]
            cmd = [sys.executable, "-m", "kvserve.cli", "serve", *self.engine_args, "--host", "127.0.0.1",
                   "--port", str(http), "--kv-events-endpoint", f"tcp://127.0.0.1:{ev}",
                   "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}"]
            if self.api_key:
                cmd += ["--api-key", self.api_key]
            env = dict(os.environ, OMP_NUM_THREADS=str(len(cores)), PYTHONUNBUFFERED="1")
            log = self.log_dir / f"replica-{i}.log"
            with open(log, "wb") as f:
                proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env=env, preexec_fn=_child_setup(cores))
            self.replicas.append(Launched(f"http://127.0.0.1:{http}", proc, cores, log))
        return self.replicas

    def wait_ready(self, timeout: float) -> None:
        """Until every replica answers /health; RuntimeError naming the one that did not."""
        deadline = time.monotonic() + timeout
        waiting = list(self.replicas)
        while waiting:
            for r in list(waiting):
                if r.proc.poll() is not None:
                    raise RuntimeError(f"replica {r.url} (pid {r.proc.pid}) exited with {r.proc.returncode} "
                                       f"while starting; the end of {r.log}:\n{r.log_tail()}")
                with contextlib.suppress(OSError):
                    with urllib.request.urlopen(f"{r.url}/health", timeout=5) as resp:
                        if resp.status == 200:
                            waiting.remove(r)
            if waiting and time.monotonic() > deadline:
                r = waiting[0]
                raise RuntimeError(f"replica {r.url} (pid {r.proc.pid}) did not answer /health within "
                                   f"{timeout:g}s (--launch-timeout); the end of {r.log}:\n{r.log_tail()}")
            if waiting:
                time.sleep(0.25)

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        stop_processes([r.proc for r in self.replicas], timeout)


def stop_processes(procs: list[subprocess.Popen], timeout: float = STOP_TIMEOUT) -> None:
    """SIGTERM them all at once (each takes seconds to shut down), SIGKILL what is left after `timeout`."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        with contextlib.suppress(ProcessLookupError):
            p.terminate()
    deadline = time.monotonic() + timeout
    for p in live:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


# ---- the command ----------------------------------------------------------------------------

async def _serve(args: argparse.Namespace, urls: list[str], launched: list[Launched]) -> None:
    from kvserve.router.app import build_app, start_router

    by_url = {r.url: r for r in launched}
    router = await start_router(urls, args.policy, args.health_interval, args.tokenizer, args.api_key,
                                pids={r.url: r.proc.pid for r in launched})
    try:
        app = build_app(router)
        for r in router.replicas.replicas:
            own = by_url.get(r.url)
            where = f"pid {own.proc.pid}, cores {','.join(map(str, own.cores))}, log {own.log}" if own else "external"
            events = "kv events on" if r.view.kv_events is not None else "kv events off"
            state = "healthy" if r.view.healthy else f"UNHEALTHY ({r.excluded or r.last_error})"
            print(f"kvserve router: replica {r.url} ({where}; {events}; {state})", flush=True)
        print(f"kvserve router: policy {args.policy}, serving at http://{args.host}:{args.port}/v1", flush=True)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning",
                                timeout_graceful_shutdown=5)
        await uvicorn.Server(config).serve()
    finally:
        await router.close()


def _raise_exit(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def cmd_router(args: argparse.Namespace) -> int:
    engine_args = _check_args(args)  # ValueError -> exit code 2 in cli.main
    # uvicorn re-raises a captured SIGTERM after its graceful stop; as an exception it lets
    # the `finally` below stop the replicas this router launched.
    signal.signal(signal.SIGTERM, _raise_exit)
    launcher = ReplicaLauncher(args.launch, engine_args, args.api_key) if args.launch else None
    code: int | None = None  # stays None when an exception (a start-up error) leaves this function
    try:
        launched: list[Launched] = []
        if launcher is not None:
            launched = launcher.start()
            print(f"kvserve router: starting {args.launch} replicas (logs in {launcher.log_dir})", flush=True)
            launcher.wait_ready(args.launch_timeout)
        asyncio.run(_serve(args, [*args.replica, *(r.url for r in launched)], launched))
        code = 0
    except KeyboardInterrupt:
        code = 0
    except SystemExit as e:  # our SIGTERM handler (a clean stop), or uvicorn failing to bind
        code = 0 if e.code == 128 + signal.SIGTERM else (e.code if isinstance(e.code, int) else 1)
    except RuntimeError as e:
        print(f"kvserve router: error: {e}", file=sys.stderr)
        code = 1
    finally:
        if launcher is not None:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the stop short
            launcher.stop()
            if code == 0:  # the replicas' logs matter only when something went wrong
                shutil.rmtree(launcher.log_dir, ignore_errors=True)
    return code
