"""The KV connectors' worker roles that run inside a rank (engine/connectors.py lists the scheduler
roles). A rank builds its roles once from the config; `ModelRunner.execute` runs them around each
forward with that rank's runner and returns what they report in `kv_connector_output`, by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvserve.config import EngineConfig
from kvserve.core.kv_connector import KVConnectorWorker


def _whole_blocks(config: EngineConfig, runner: Any) -> Any:
    from kvserve.worker.kv_blocks import WholeBlocks

    par = config.parallel
    return WholeBlocks(runner, par.tensor_parallel_size, par.pipeline_parallel_size, par.rank)


def _tiers(config: EngineConfig, runner: Any) -> KVConnectorWorker:
    from kvserve.kv_tiers.worker import TierWorker

    return TierWorker(config.tiers, _whole_blocks(config, runner))


def _kv_transfer(config: EngineConfig, runner: Any) -> KVConnectorWorker:
    from kvserve.disagg.worker import PDWorker

    return PDWorker(config.kv_transfer, _whole_blocks(config, runner))


def _blend(config: EngineConfig, runner: Any) -> KVConnectorWorker:
    from kvserve.blend.forward import BlendWorker

    return BlendWorker()


# name (the scheduler role's) -> (on for this config?, build it in this rank)
# In this order: the tiers first, so they read evicted blocks out before anything is written.
WORKER_ROLES: dict[str, tuple[Callable[[EngineConfig], bool], Callable[[EngineConfig, Any], KVConnectorWorker]]] = {
    "tiers": (lambda c: c.tiers.enabled, _tiers),
    "kv_transfer": (lambda c: c.kv_transfer.enabled, _kv_transfer),
    "blend": (lambda c: c.blend.enabled, _blend),
}


def build_worker_roles(config: EngineConfig, runner: Any) -> dict[str, KVConnectorWorker]:
    """Every rank builds the same roles in the same order (some exchange shapes as they are built)."""
    return {name: build(config, runner) for name, (enabled, build) in WORKER_ROLES.items() if enabled(config)}
