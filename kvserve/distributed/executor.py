"""Executors: how EngineCore reaches the ranks that run the model.

EngineCore talks only to an Executor: `execute(scheduler_output)` for a step and
`collective_rpc(method, *args)` for anything else, each a call of that Worker method
(worker/worker.py) on every rank, in the same order on every rank.

- `uni`: one rank, a Worker in the engine's own process (no messages at all).
- `mp`: one process per rank on this host (multiproc.py).
- `ray`: one Ray actor per rank, across the machines of a Ray cluster (ray_executor.py).

A KV block as the KV tiers see it spans every rank: its layers are split across pipeline
stages and its KV heads across tensor-parallel ranks, so read_kv_blocks / write_kv_blocks
gather and scatter the pieces here, and the tiers never learn the layout.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import Any

import torch

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

    # ---- KV blocks across ranks (the KV tiers' view of the cache) ------------------------

    @property
    def kv_block_shape(self) -> tuple[int, ...]:
        """[layers, 2, block_size, kv_heads, head_dim] of one whole block."""
        return self._whole_block_shape(self.collective_rpc("kv_block_shape"))

    def _whole_block_shape(self, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
        """One whole block's shape from every rank's piece of it."""
        layers = sum(shapes[s * self.tp_size][0] for s in range(self.pp_size))
        heads = sum(shapes[t][3] for t in range(self.tp_size))
        first = shapes[0]
        return (layers, first[1], first[2], heads, first[4])

    def kv_scales(self) -> torch.Tensor | None:
        """fp8 KV scales [layers, 2] of the whole model (None without an fp8 cache)."""
        scales = self.collective_rpc("kv_scales")
        if scales[0] is None:
            return None
        return torch.cat([scales[s * self.tp_size] for s in range(self.pp_size)])

    def read_kv_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """[n, layers, 2, block_size, kv_heads, head_dim], assembled from every rank's piece."""
        parts = self.collective_rpc("read_kv_blocks", block_ids)
        stages = [torch.cat(parts[s * self.tp_size:(s + 1) * self.tp_size], dim=4) for s in range(self.pp_size)]
        return torch.cat(stages, dim=1)

    def write_kv_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Cut `data` (as read_kv_blocks returns it) into each rank's layers and heads, and write them.
        Data of another shape is refused before any rank writes a byte."""
        shapes = self.collective_rpc("kv_block_shape")
        want = (len(block_ids), *self._whole_block_shape(shapes))
        if tuple(data.shape) != want:
            raise ValueError(f"KV block data is {list(data.shape)}; {len(block_ids)} blocks of this cache are "
                             f"{list(want)}")
        pieces, layer = [], 0
        for s in range(self.pp_size):
            n_layers = shapes[s * self.tp_size][0]
            stage = data[:, layer:layer + n_layers]
            layer += n_layers
            head = 0
            for t in range(self.tp_size):
                heads = shapes[s * self.tp_size + t][3]
                pieces.append(stage[:, :, :, :, head:head + heads].contiguous())
                head += heads
        self.scatter_rpc("write_kv_blocks", [(block_ids, p) for p in pieces])

    def scatter_rpc(self, method: str, per_rank_args: list[tuple]) -> list[Any]:
        """Worker.method(*per_rank_args[rank]) on each rank."""
        raise NotImplementedError(f"{type(self).__name__} has no scatter_rpc")


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

    def scatter_rpc(self, method: str, per_rank_args: list[tuple]) -> list[Any]:
        return [getattr(self.worker, method)(*per_rank_args[0])]

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(so)

    def execute_async(self, so: SchedulerOutput) -> Future:
        fut: Future = Future()
        fut.set_result(self.execute(so))
        return fut
