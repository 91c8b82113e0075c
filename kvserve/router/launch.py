"""`kvserve router`: an OpenAI-compatible front over several `kvserve serve` replicas.

    kvserve router --replica http://127.0.0.1:8001 --replica http://127.0.0.1:8002 [--policy NAME]
    kvserve router --launch 2 [--policy NAME] -- [MODEL] [engine flags for `kvserve serve`]
    kvserve router --prefill http://127.0.0.1:8001 --decode http://127.0.0.1:8002 [--pd-decision MODE]
    kvserve router --launch-pd 1 2 [--pd-decision MODE] -- [MODEL] [engine flags]

With --launch N the router starts N replicas itself, each on a free port with its own KV
events endpoint and its own share of this process's CPU cores, waits until they answer
/health, and stops them (SIGTERM, then SIGKILL) when it exits for any reason. --launch-pd P D
does the same for P prefill and D decode engines (`--kv-role prefill` with a K/V port of its
own, `--kv-role decode` fetching from those ports only), which share a fresh random K/V transfer
key (a file only this user can read, removed when they stop). With prefill and decode
replicas each request is decoded on a decode replica and its prompt computed there or on a
prefill replica (router/pd.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn

from kvserve.lifetime import die_with_parent, keep_temp_dir, make_temp_dir
from kvserve.router.pd import (
    DEFAULT_LOCAL_BUDGET_MS,
    DEFAULT_MAX_LOCAL_PREFILL_LENGTH,
    DEFAULT_PREFILL_TIMEOUT,
    PD_DECISIONS,
    PDConfig,
)
from kvserve.router.policies import load_policies
from kvserve.router.replicas import DEFAULT_HEALTH_INTERVAL
from kvserve.server.limits import add_http_limit_args, check_http_limit_args, h11_with_header_timeout

DEFAULT_LAUNCH_TIMEOUT = 300.0
STOP_TIMEOUT = 15.0
# Flags the router sets on the replicas it launches (each its own port and events endpoint;
# --launch-pd engines their role and K/V transfer).
OWNED_FLAGS = ("--host", "--port", "--kv-events-endpoint", "--kv-events-replay-endpoint", "--api-key",
               "--kv-role", "--kv-transfer-config")
PD_CONNECTOR = "PDConnector"  # the engines' KV connector for prefill/decode transfer (disagg/)
KV_KEY_FILE = "kv_transfer.key"  # --launch-pd's shared K/V transfer key, in the replicas' log folder


def add_router_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--replica", action="append", default=[], metavar="URL",
                   help="a running `kvserve serve` replica, e.g. http://127.0.0.1:8001 (repeatable)")
    p.add_argument("--launch", type=int, default=0, metavar="N",
                   help="start N `kvserve serve` replicas, splitting this machine's cores between them; "
                        "their engine flags go after `--`")
    p.add_argument("--prefill", action="append", default=[], metavar="URL",
                   help="a running `kvserve serve --kv-role prefill` (or both) engine (repeatable; with --decode)")
    p.add_argument("--decode", action="append", default=[], metavar="URL",
                   help="a running `kvserve serve --kv-role decode` (or both) engine (repeatable; with --prefill); "
                        "a URL given to both serves both")
    p.add_argument("--launch-pd", type=int, nargs=2, default=None, metavar=("P", "D"),
                   help="start P prefill and D decode `kvserve serve` engines, as --launch does")
    p.add_argument("--policy", default="kv_aware", choices=sorted(load_policies()),
                   help="how a replica (with --prefill/--decode: a decode replica) is chosen per request "
                        "(default kv_aware)")
    p.add_argument("--pd-decision", default="conditional", choices=PD_DECISIONS,
                   help="where a prompt is prefilled, on its decode replica (local) or a prefill replica (remote): "
                        "conditional (a cost model, the default), always (remote), never (local), threshold "
                        "(local up to --max-local-prefill-length uncached tokens)")
    p.add_argument("--max-local-prefill-length", type=int, default=DEFAULT_MAX_LOCAL_PREFILL_LENGTH, metavar="N",
                   help="--pd-decision threshold: prefill on the decode replica when at most N prompt tokens "
                        f"are not cached there (default {DEFAULT_MAX_LOCAL_PREFILL_LENGTH})")
    p.add_argument("--pd-local-budget-ms", type=float, default=DEFAULT_LOCAL_BUDGET_MS, metavar="MS",
                   help="--pd-decision conditional: prefill on the decode replica when that takes at most MS "
                        f"milliseconds, a negligible stall of its streams (default {DEFAULT_LOCAL_BUDGET_MS:g})")
    p.add_argument("--pd-prefill-timeout", type=float, default=DEFAULT_PREFILL_TIMEOUT, metavar="SECONDS",
                   help="a prefill replica's time to answer; then the decode replica prefills the prompt "
                        f"(default {DEFAULT_PREFILL_TIMEOUT:g})")
    p.add_argument("--health-interval", type=float, default=DEFAULT_HEALTH_INTERVAL, metavar="SECONDS",
                   help=f"seconds between replica health checks (default {DEFAULT_HEALTH_INTERVAL:g})")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="the replicas' model or tokenizer, when the router cannot read their model path")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route (checked before the body is read), "
                        "/health and /metrics too unless --allow-unauthenticated-metrics")
    p.add_argument("--allow-unauthenticated-metrics", action="store_true",
                   help="with --api-key: leave /health and /metrics open, for load balancers and scrapers")
    p.add_argument("--upstream-api-key", default=None, metavar="KEY",
                   help="the key the router sends the replicas (its probes, and forwarded requests in place of "
                        "the client's key); given to --launch replicas (default: --api-key; with neither, a "
                        "client's Authorization header is forwarded unchanged)")
    add_http_limit_args(p, "the replicas' max-model-len")
    p.add_argument("--launch-timeout", type=float, default=DEFAULT_LAUNCH_TIMEOUT, metavar="SECONDS",
                   help=f"how long --launch waits for a replica to answer /health (default {DEFAULT_LAUNCH_TIMEOUT:g})")
    p.add_argument("engine_args", nargs=argparse.REMAINDER, metavar="-- ENGINE_FLAGS",
                   help="flags for the `kvserve serve` replicas of --launch or --launch-pd")


def upstream_api_key(args: argparse.Namespace) -> str | None:
    """The key the router sends the replicas (and gives those it launches): --upstream-api-key,
    else its own --api-key."""
    return args.upstream_api_key if args.upstream_api_key is not None else args.api_key


def _check_args(args: argparse.Namespace) -> list[str]:
    """Validate the flags; returns the engine flags for launched replicas."""
    extra = list(args.engine_args)
    if extra and extra[0] != "--":
        raise ValueError(f"unexpected argument {extra[0]!r}; engine flags for --launch replicas go after `--`")
    extra = extra[1:]
    if args.launch < 0:
        raise ValueError(f"--launch must be >= 0, got {args.launch}")
    if args.launch_pd is not None and min(args.launch_pd) < 1:
        raise ValueError("--launch-pd P D starts P >= 1 prefill and D >= 1 decode engines, got "
                         f"{args.launch_pd[0]} {args.launch_pd[1]}")
    if bool(args.prefill) != bool(args.decode):
        given, missing = ("--prefill", "--decode") if args.prefill else ("--decode", "--prefill")
        raise ValueError(f"{given} without {missing}: a prefill/decode router needs both, prefill engines "
                         "(--prefill URL) and decode engines (--decode URL), or --launch-pd P D")
    if is_pd(args) and (args.replica or args.launch):
        raise ValueError("--prefill/--decode/--launch-pd cannot be mixed with --replica or --launch: plain "
                         "replicas refuse kv_transfer_params; start every engine with --kv-role prefill, decode "
                         "or both and give it as --prefill URL or --decode URL")
    launching = args.launch or args.launch_pd
    if extra and not launching:
        raise ValueError("engine flags after `--` are for --launch or --launch-pd replicas; without them, give "
                         "them to each `kvserve serve`")
    if not launching and not args.replica and not args.prefill:
        raise ValueError("give --replica URL (repeatable) or --launch N, or for prefill/decode disaggregation "
                         "--prefill URL --decode URL or --launch-pd P D")
    for flag in OWNED_FLAGS:
        if any(a == flag or a.startswith(flag + "=") for a in extra):
            hint = ("; use the router's --upstream-api-key (default: its --api-key)" if flag == "--api-key" else
                    "; --launch-pd P D starts prefill and decode engines" if flag.startswith("--kv-") else "")
            raise ValueError(f"{flag} after `--`: the router sets it on each replica it launches{hint}")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.health_interval <= 0:
        raise ValueError(f"--health-interval must be > 0 seconds, got {args.health_interval}")
    if args.launch_timeout <= 0:
        raise ValueError(f"--launch-timeout must be > 0 seconds, got {args.launch_timeout}")
    check_http_limit_args(args, ("--api-key", "--upstream-api-key"))
    if args.allow_unauthenticated_metrics and args.api_key is None:
        raise ValueError("--allow-unauthenticated-metrics leaves /health and /metrics open when --api-key "
                         "protects the rest; without --api-key every route is open already")
    return extra


def is_pd(args: argparse.Namespace) -> bool:
    """Prefill/decode replicas rather than plain ones."""
    return bool(args.prefill or args.decode or args.launch_pd)


def pd_config(args: argparse.Namespace) -> PDConfig | None:
    """The P/D settings of the flags (ValueError naming a bad one); None for plain replicas."""
    if not is_pd(args):
        return None
    return PDConfig(args.pd_decision, args.max_local_prefill_length, args.pd_local_budget_ms / 1000,
                    args.pd_prefill_timeout)


def pd_roles(prefill: list[str], decode: list[str]) -> dict[str, str]:
    """Each replica URL's role; one given as both --prefill and --decode (an engine started with
    --kv-role both) serves both."""
    roles = {u.rstrip("/"): "prefill" for u in prefill}
    for u in decode:
        u = u.rstrip("/")
        roles[u] = "both" if roles.get(u) == "prefill" else "decode"
    return roles


# ---- launching replicas -------------------------------------------------------------------

@dataclass
class Launched:
    url: str
    proc: subprocess.Popen
    cores: list[int]
    log: Path
    role: str | None = None  # "prefill" or "decode" for --launch-pd engines

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
    router = os.getpid()

    def setup() -> None:  # in the forked child, before exec
        os.sched_setaffinity(0, cores)
        if not die_with_parent(signal.SIGTERM, router):  # a replica stops with the router, even a SIGKILLed one
            os._exit(0)  # the router died before the request: nobody is left to serve for
    return setup


def kv_role_flags(role: str, kv_port: int | None = None, key_file: str | None = None,
                  peers: list[str] | None = None) -> list[str]:
    """The flags that make an engine a prefill engine (a K/V producer serving its K/V on
    `kv_port`) or a decode engine (a K/V consumer, pulling from the producers' ports, `peers`
    only); both prove they belong to this deployment with the key in `key_file` (disagg/auth.py)."""
    extra: dict[str, Any] = {"auth_key_file": key_file} if key_file else {}
    transfer: dict[str, Any] = {"kv_connector": PD_CONNECTOR, "kv_role": "kv_consumer"}
    if role == "prefill":
        transfer = {"kv_connector": PD_CONNECTOR, "kv_role": "kv_producer", "kv_ip": "127.0.0.1", "kv_port": kv_port}
    elif peers is not None:
        extra["peers"] = peers
    if extra:
        transfer["kv_connector_extra_config"] = extra
    return ["--kv-role", role, "--kv-transfer-config", json.dumps(transfer, separators=(",", ":"))]


def replica_command(engine_args: list[str], ports: list[int], role: str | None = None,
                    api_key: str | None = None, kv_key_file: str | None = None,
                    kv_peers: list[str] | None = None) -> list[str]:
    """A launched replica's `kvserve serve` command: the engine flags, then those the router owns.
    `ports`: HTTP, KV events, their replay and, for a prefill engine, its K/V transfer."""
    http, events, replay = ports[:3]
    cmd = [sys.executable, "-m", "kvserve.cli", "serve", *engine_args, "--host", "127.0.0.1",
           "--port", str(http), "--kv-events-endpoint", f"tcp://127.0.0.1:{events}",
           "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay}"]
    if role is not None:
        cmd += kv_role_flags(role, ports[3] if role == "prefill" else None, kv_key_file, kv_peers)
    if api_key:
        cmd += ["--api-key", api_key]
    return cmd


def launch_commands(roles: list[str | None], engine_args: list[str], api_key: str | None = None,
                    kv_key_file: str | None = None) -> list[tuple[str, list[str]]]:
    """(URL, command) of each replica to launch, one per role (None: a plain replica), on free ports.
    Decode engines fetch K/V from the launched prefill engines' ports only."""
    counts = [4 if role == "prefill" else 3 for role in roles]
    ports = iter(free_ports(sum(counts)))
    mine = [[next(ports) for _ in range(k)] for k in counts]
    peers = [f"127.0.0.1:{m[3]}" for role, m in zip(roles, mine) if role == "prefill"]
    return [(f"http://127.0.0.1:{m[0]}", replica_command(engine_args, m, role, api_key, kv_key_file, peers))
            for role, m in zip(roles, mine)]


def launch_roles(args: argparse.Namespace) -> list[str | None]:
    """The role of each replica the flags launch: --launch N plain ones, --launch-pd P D P prefill
    then D decode engines."""
    if args.launch_pd is not None:
        prefill, decode = args.launch_pd
        return ["prefill"] * prefill + ["decode"] * decode
    return [None] * args.launch


class ReplicaLauncher:
    def __init__(self, roles: list[str | None], engine_args: list[str], api_key: str | None = None) -> None:
        self.roles, self.engine_args, self.api_key = roles, engine_args, api_key
        self.log_dir = Path(make_temp_dir("kvserve-router-"))
        self.replicas: list[Launched] = []

    def start(self) -> list[Launched]:
        key_file = self._write_kv_key() if any(self.roles) else None
        commands = launch_commands(self.roles, self.engine_args, self.api_key, key_file)
        for i, ((url, cmd), cores, role) in enumerate(zip(commands, split_cores(len(self.roles)), self.roles)):
            env = dict(os.environ, OMP_NUM_THREADS=str(len(cores)), PYTHONUNBUFFERED="1")
            log = self.log_dir / f"{role or 'replica'}-{i}.log"
            with open(log, "wb") as f:
                proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        env=env, preexec_fn=_child_setup(cores))
            self.replicas.append(Launched(url, proc, cores, log, role))
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

    def _write_kv_key(self) -> str:
        """A fresh random key for this deployment's K/V transfers, readable by this user only (a
        file, not a flag: other users see command lines)."""
        path = self.log_dir / KV_KEY_FILE
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
            f.write(secrets.token_hex(32))
        return str(path)

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        stop_processes([r.proc for r in self.replicas], timeout)
        with contextlib.suppress(FileNotFoundError):  # kept logs must not keep the key
            (self.log_dir / KV_KEY_FILE).unlink()


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

async def _serve(args: argparse.Namespace, launched: list[Launched], pd: PDConfig | None) -> None:
    from kvserve.router.app import build_app, start_router

    by_url = {r.url: r for r in launched}
    mine = {role: [r.url for r in launched if r.role == role] for role in ("prefill", "decode")}
    prefill, decode = [*args.prefill, *mine["prefill"]], [*args.decode, *mine["decode"]]
    urls = [*args.replica, *(r.url for r in launched if r.role is None), *prefill, *decode]
    router = await start_router(urls, args.policy, args.health_interval, args.tokenizer,
                                upstream_api_key=upstream_api_key(args), pids={r.url: r.proc.pid for r in launched},
                                roles=pd_roles(prefill, decode) if pd else None, pd=pd)
    try:
        app = build_app(router, args.api_key, args.allow_unauthenticated_metrics, args.max_request_bytes)
        for r in router.replicas.replicas:
            own = by_url.get(r.url)
            where = f"pid {own.proc.pid}, cores {','.join(map(str, own.cores))}, log {own.log}" if own else "external"
            events = "kv events on" if r.view.kv_events is not None else "kv events off"
            state = "healthy" if r.view.healthy else f"UNHEALTHY ({r.excluded or r.last_error})"
            what = f"{'prefill+decode' if r.role == 'both' else r.role} replica" if pd else "replica"
            print(f"kvserve router: {what} {r.url} ({where}; {events}; {state})", flush=True)
        how = f"policy {args.policy}" + (f", P/D decision {pd.decision}" if pd else "")
        print(f"kvserve router: {how}, serving at http://{args.host}:{args.port}/v1", flush=True)
        if args.api_key is None and args.host not in ("127.0.0.1", "localhost", "::1"):
            print(f"kvserve router: warning: no --api-key, and {args.host} is not loopback: anyone who can reach "
                  "the port can send requests and read /replicas (pids, ports)", flush=True)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5,
                                http=h11_with_header_timeout(args.header_timeout, args.body_timeout))
        await uvicorn.Server(config).serve()
    finally:
        await router.close()


def _raise_exit(signum: int, _frame: Any) -> None:
    raise SystemExit(128 + signum)


def cmd_router(args: argparse.Namespace) -> int:
    engine_args = _check_args(args)  # ValueError -> exit code 2 in cli.main
    pd = pd_config(args)
    # uvicorn re-raises a captured SIGTERM after its graceful stop; as an exception it lets
    # the `finally` below stop the replicas this router launched.
    signal.signal(signal.SIGTERM, _raise_exit)
    roles = launch_roles(args)
    launcher = ReplicaLauncher(roles, engine_args, upstream_api_key(args)) if roles else None
    code: int | None = None  # stays None when an exception (a start-up error) leaves this function
    try:
        launched: list[Launched] = []
        if launcher is not None:
            launched = launcher.start()
            what = (f"{roles.count('prefill')} prefill and {roles.count('decode')} decode engines" if pd
                    else f"{len(roles)} replicas")
            print(f"kvserve router: starting {what} (logs in {launcher.log_dir})", flush=True)
            launcher.wait_ready(args.launch_timeout)
        asyncio.run(_serve(args, launched, pd))
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
            else:  # kept for the user: the next kvserve start must not sweep them as a dead owner's
                keep_temp_dir(str(launcher.log_dir))
    return code
