"""The `ray` executor: one Ray actor per rank, across the machines of a Ray cluster.

The ranks live in one placement group (a bundle of one CPU per rank, packed onto as few
nodes as fit, spread over more when a node is full). Each actor builds its rank's Worker on
its own node; the ranks meet in torch.distributed at a TCP address on rank 0's node, and from
then on exchange activations among themselves (gloo), never through Ray. Ray carries only
the engine's calls (`collective_rpc`, a step's SchedulerOutput) and their results.

A Ray actor runs its calls in the order they were submitted, so, as with `mp`, a pipeline can
hold several steps at once. Faults: a rank whose actor dies (killed, its node lost, OOM) or
whose call raises fails the call with a WorkerError naming the rank; the other actors are
killed, since their peers' collectives could never complete.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import socket
import struct
import time
from concurrent.futures import Future
from typing import Any

import torch

from kvserve.config import EngineConfig
from kvserve.core.sched_output import SchedulerOutput
from kvserve.distributed.executor import Executor, WorkerError

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
PLACEMENT_TIMEOUT_S = 60.0
CPUS_PER_RANK = 1  # the bundle of each rank; its actor runs that many torch threads
_POLL_S = 0.1
_SIOCGIFADDR = 0x8915


def _import_ray():
    try:
        import ray
    except ImportError as e:
        raise ImportError("distributed_executor_backend 'ray' needs Ray: pip install 'kvserve[ray]'") from e
    return ray


# Executors of this process on a Ray instance that this module started: the last one stops it.
_local_ray_users = 0


def _connect(ray) -> bool:
    """Join the Ray cluster this process can see; start a local one if there is none.
    True when the Ray in use is one we started (so the last executor on it stops it)."""
    global _local_ray_users
    if ray.is_initialized():
        owned = _local_ray_users > 0
    else:
        owned = _init_ray(ray)
    _local_ray_users += owned
    return owned


def _init_ray(ray) -> bool:
    # Ray's usage statistics would phone home; the engine talks to the cluster's addresses only.
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    quiet = {"logging_level": logging.WARNING, "configure_logging": True}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(**quiet)  # Ray reads the address from the environment; no local fallback
        return False
    try:
        ray.init(address="auto", **quiet)  # the address `ray start --head` left on this machine
        return False
    except ConnectionError:  # no cluster running here: a local one, for this process only
        ray.init(include_dashboard=False, **quiet)
        return True


def _interface_of(ip: str) -> str | None:
    """The network interface holding `ip` (Linux). gloo otherwise binds to whatever the host
    name resolves to, often a loopback address the other machines cannot reach."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == ip:
                return name
    return None


class RankActor:
    """One rank inside a Ray actor: builds the Worker on its node, then runs its methods by name."""

    def __init__(self, rank: int, num_cpus: int) -> None:
        self.rank = rank
        self.worker = None
        # Ray sets OMP_NUM_THREADS to the actor's CPUs; torch is told the same explicitly.
        # An explicit cpu_threads_bind still wins: Worker pins the cores it names.
        torch.set_num_threads(num_cpus)

    def node(self) -> dict[str, Any]:
        import ray

        return {"ip": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id(),
                "pid": os.getpid()}

    def free_port(self) -> int:
        """A TCP port free on every address of this node (rank 0 hosts torch.distributed's store)."""
        with socket.socket() as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def start_worker(self, config: EngineConfig, num_blocks: int, kv_calibration_ids: list[int] | None,
                     eos_token_id: int | None, init_method: str) -> None:
        from kvserve.worker.worker import Worker

        if config.parallel.world_size > 1 and "GLOO_SOCKET_IFNAME" not in os.environ:
            iface = _interface_of(self.node()["ip"])
            if iface is not None:
                os.environ["GLOO_SOCKET_IFNAME"] = iface
        self.worker = Worker(config, num_blocks, kv_calibration_ids, eos_token_id, init_method)

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.worker, method)(*args)


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig, num_blocks: int, kv_calibration_ids: list[int] | None,
                 eos_token_id: int | None) -> None:
        super().__init__(config)
        self._ray = ray = _import_ray()
        self.world = config.parallel.world_size
        self._failed: str | None = None
        self._closed = False
        self.actors: list[Any] = []
        self.placement_group = None
        self.nodes: list[dict[str, Any]] = []  # each rank's node: ip, node_id, pid
        self._started_ray = _connect(ray)
        try:
            self.placement_group = self._place()
            self._start_actors()
            self.nodes = self._get([a.node.remote() for a in self.actors], STARTUP_TIMEOUT_S)
            head = self.nodes[0]["ip"]
            port = self._get([self.actors[0].free_port.remote()], STARTUP_TIMEOUT_S)[0]
            init_method = f"tcp://{head}:{port}"
            # Worker constructors join torch.distributed together: start them all, then wait.
            self._get([a.start_worker.remote(config.for_rank(r), num_blocks, kv_calibration_ids, eos_token_id,
                                             init_method) for r, a in enumerate(self.actors)], STARTUP_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        logger.info("ray executor: %d ranks (tp=%d, pp=%d) on node(s) %s", self.world, self.tp_size, self.pp_size,
                    [n["ip"] for n in self.nodes])

    def _place(self):
        """A placement group of one bundle per rank, or a RuntimeError saying what the cluster lacks."""
        ray = self._ray
        from ray.util.placement_group import placement_group, remove_placement_group

        pg = placement_group([{"CPU": CPUS_PER_RANK}] * self.world, strategy="PACK")
        ready, _ = ray.wait([pg.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if ready:
            return pg
        remove_placement_group(pg)
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        total, free = ray.cluster_resources().get("CPU", 0), ray.available_resources().get("CPU", 0)
        raise RuntimeError(
            f"ray executor: could not place {self.world} ranks (tensor_parallel_size x pipeline_parallel_size, "
            f"{CPUS_PER_RANK} CPU each: {self.world * CPUS_PER_RANK} CPUs) within {PLACEMENT_TIMEOUT_S:.0f} s; "
            f"the Ray cluster has {total:.0f} CPUs on {len(nodes)} node(s), {free:.0f} free. "
            "Add nodes (`ray start --address=HEAD_IP:6379`) or lower the parallel sizes")

    def _start_actors(self) -> None:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        remote_cls = self._ray.remote(RankActor)
        for r in range(self.world):
            strategy = PlacementGroupSchedulingStrategy(placement_group=self.placement_group,
                                                        placement_group_bundle_index=r)
            # max_restarts=0: a rank that died lost its shard and its KV; restarting it alone cannot help.
            options = {"num_cpus": CPUS_PER_RANK, "scheduling_strategy": strategy, "max_restarts": 0}
            self.actors.append(remote_cls.options(**options).remote(r, CPUS_PER_RANK))

    # ---- calls ----------------------------------------------------------------------------

    def _submit(self, method: str, per_rank_args: list[tuple]) -> list[Any]:
        self._raise_if_failed()
        return [a.call.remote(method, *args) for a, args in zip(self.actors, per_rank_args)]

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return self.scatter_rpc(method, [args] * self.world)

    def scatter_rpc(self, method: str, per_rank_args: list[tuple]) -> list[Any]:
        return self._get(self._submit(method, per_rank_args))

    def execute_async(self, so: SchedulerOutput) -> Future:
        return _RayFuture(self, self._submit("execute_model", [(so,)] * self.world))

    def _get(self, refs: list[Any], timeout: float | None = None) -> list[Any]:
        """The results of refs (one per rank, in rank order); WorkerError as soon as any rank fails,
        without waiting for the others (who may be blocked in a collective with it)."""
        ray = self._ray
        rank_of = {ref: r for r, ref in enumerate(refs)}
        pending, start = list(refs), time.monotonic()
        while pending:
            self._raise_if_failed()
            ready, pending = ray.wait(pending, num_returns=1, timeout=_POLL_S)
            for ref in ready:
                self._check_ref(ref, rank_of[ref])
            if timeout is not None and time.monotonic() - start > timeout:
                self._fail(f"ranks did not answer within {timeout:.0f} s")
        return ray.get(refs)

    def _check_ref(self, ref: Any, rank: int) -> None:
        from ray.exceptions import RayActorError, RayTaskError

        try:
            self._ray.get(ref)
        except RayActorError as e:
            self._fail(f"worker rank {rank} (Ray actor on {self._where(rank)}) died: {_reason(e)}")
        except RayTaskError as e:
            self._fail(f"worker rank {rank} failed: {e}")

    def _where(self, rank: int) -> str:
        return f"node {self.nodes[rank]['ip']}, pid {self.nodes[rank]['pid']}" if self.nodes else "its node"

    def check_health(self) -> None:
        """Raise WorkerError naming a rank whose actor is dead. A busy rank counts as alive: its
        probe queues behind its calls and is not waited for."""
        self._raise_if_failed()
        probes = [a.__ray_ready__.remote() for a in self.actors]
        ready, _ = self._ray.wait(probes, num_returns=len(probes), timeout=1.0)
        for ref in ready:
            self._check_ref(ref, probes.index(ref))

    def _raise_if_failed(self) -> None:
        if self._failed is not None:
            raise WorkerError(self._failed)
        if self._closed:
            raise WorkerError("the ray executor was shut down")

    def _fail(self, message: str) -> None:
        logger.error("ray executor: %s; stopping the other ranks", message)
        self._failed = message
        self._kill_actors()
        raise WorkerError(message)

    # ---- shutdown --------------------------------------------------------------------------

    def _kill_actors(self) -> None:
        for a in self.actors:
            with contextlib.suppress(Exception):  # already gone, or Ray itself is shutting down
                self._ray.kill(a, no_restart=True)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        ray = self._ray
        if not ray.is_initialized():
            return  # Ray went first (ray.shutdown() at exit); it took the actors with it
        self._kill_actors()
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.placement_group)
        if self._started_ray:
            global _local_ray_users
            _local_ray_users -= 1
            if _local_ray_users == 0:
                ray.shutdown()


def _reason(e: BaseException) -> str:
    """Ray's first line (what happened) and last (why: `ray.kill`, a lost node, the creation
    task's exception), without the actor ids and terminal colours between them."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(e).splitlines()]
    lines = [line for line in lines if line]
    if not lines:
        return type(e).__name__
    return lines[0] if len(lines) == 1 else f"{lines[0]} {lines[-1]}"


class _RayFuture(Future):
    """Resolves to the output rank's result of one execute_model call when asked for it."""

    def __init__(self, executor: RayExecutor, refs: list[Any]) -> None:
        super().__init__()
        self._executor, self._refs = executor, refs

    def result(self, timeout: float | None = None) -> Any:
        if not self.done():
            try:
                self.set_result(self._executor._get(self._refs, timeout)[self._executor.output_rank])
            except BaseException as e:  # noqa: BLE001 - kept on the future, raised below
                self.set_exception(e)
        return super().result(0)
