"""The KV connectors' worker roles that run inside a rank (engine/connectors.py lists the scheduler
roles). A rank builds its roles once from the config; `ModelRunner.execute` runs them around each
forward with that rank's runner and returns what they report in `kv_connector_output`, by name.

The KV tiers' and prefill/decode transfer's worker halves still run in the engine process, moving
whole blocks through the executor; they have no entry here yet.
"""

from __future__ import annotations

from collections.abc import Callable

from kvserve.config import EngineConfig
from kvserve.core.kv_connector import KVConnectorWorker


def _blend() -> KVConnectorWorker:
    from kvserve.blend.forward import BlendWorker

    return BlendWorker()


# name (the scheduler role's) -> (on for this config?, build)
WORKER_ROLES: dict[str, tuple[Callable[[EngineConfig], bool], Callable[[], KVConnectorWorker]]] = {
    "blend": (lambda c: c.blend.enabled, _blend),
}


def build_worker_roles(config: EngineConfig) -> dict[str, KVConnectorWorker]:
    return {name: build() for name, (enabled, build) in WORKER_ROLES.items() if enabled(config)}
