"""Executors: how EngineCore reaches the ranks that run the model.

EngineCore talks only to an Executor: `execute(scheduler_output)` for a step and
`collective_rpc(method, *args)` for anything else, each a call of that Worker method
(worker/worker.py) on every rank, in the same order on every rank.

- `uni`: one rank, a Worker in the engine's own process (no messages at all).
- `mp`: one process per rank on this host (multiproc.py).
- `ray`: one Ray actor per rank, across the machines of a Ray cluster (ray_executor.py).

No feature has a method here: the KV connectors' worker roles run inside the ranks
(worker/kv_connectors.py) and move whole blocks between them (worker/kv_blocks.py).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import Any

from kvserve.config import EngineConfig
from kvserve.core.sched_output import SchedulerOutput
from kvserve.worker.model_runner import ModelRunnerOutput


class WorkerError(RuntimeError):
    """A rank died or failed; the message names it. The executor is unusable afterwards."""


class Executor(ABC):
    """The ranks of one engine. `create` picks the implementation from the config."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tp_size = config.parallel.tensor_parallel_size
        self.pp_size = config.parallel.pipeline_parallel_size
        # The rank whose execute_model returns the step's output: last stage, first tp rank.
        self.output_rank = (self.pp_size - 1) * self.tp_size

    @staticmethod
    def create(config: EngineConfig, num_blocks: int, kv_calibration_ids: list[int] | None,
               eos_token_id: int | None) -> Executor:
        backend = config.parallel.backend
        args = (config, num_blocks, kv_calibration_ids, eos_token_id)
        if backend == "uni":
            return UniExecutor(*args)
        if backend == "mp":
            from kvserve.distributed.multiproc import MultiprocExecutor

            return MultiprocExecutor(*args)
        from kvserve.distributed.ray_executor import RayExecutor

        return RayExecutor(*args)

    @property
    def max_concurrent_batches(self) -> int:
        """Batches in flight at once: one per pipeline stage, so every stage has work."""
        return self.pp_size

    @abstractmethod
    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Call Worker.method(*args) on every rank; the results in rank order."""

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.execute_async(so).result()

    @abstractmethod
    def execute_async(self, so: SchedulerOutput) -> Future:
        """Start a step on every rank; the future resolves to the output rank's ModelRunnerOutput."""

    def check_health(self) -> None:
        """Raise WorkerError naming a rank that has died."""

    def shutdown(self) -> None:
        """Stop every rank; idempotent."""


class UniExecutor(Executor):
    """One rank in this process: calls go straight to the Worker."""

    def __init__(self, config: EngineConfig, num_blocks: int, kv_calibration_ids: list[int] | None,
                 eos_token_id: int | None) -> None:
        super().__init__(config)
        from kvserve.worker.worker import Worker

        self.worker = Worker(config.for_rank(0), num_blocks, kv_calibration_ids, eos_token_id)

    @property
    def runner(self):
        """The one model runner (offline tools such as eval read the model through it)."""
        return self.worker.runner

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [getattr(self.worker, method)(*args)]

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(so)

    def execute_async(self, so: SchedulerOutput) -> Future:
        fut: Future = Future()
        fut.set_result(self.execute(so))
        return fut
