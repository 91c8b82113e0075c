"""The KV connectors an engine can run, in one table (core/kv_connector.py has the interface).

Each entry says when its connector is on, how the engine builds its scheduler role, and which key
of `SamplingParams.extra_args` its requests carry. The engine knows connectors only through this
table and the interface: a request that carries the key of a connector this engine does not run is
refused with the entry's message; one whose connector runs is checked by its `validate_request`.
Their worker roles, built inside each rank, are listed in worker/kv_connectors.py; the engine
process never imports those.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.config import EngineConfig, resolve_attention_backend
from kvserve.core.kv_connector import KVConnector, MultiConnector


@dataclass(frozen=True)
class ConnectorEntry:
    name: str
    enabled: Callable[[EngineConfig], bool]
    build: Callable[[Any, list[KVConnector]], KVConnector]  # (engine, connectors built before it)
    request_key: str | None = None  # the SamplingParams.extra_args key its requests carry
    off_message: str = ""  # why a request with that key is refused when the connector is off


def _tiers(engine: Any, built: list[KVConnector]) -> KVConnector:
    from kvserve.kv_tiers.manager import TierManager

    ex = engine.executor

    def rpc(method: str, *args: Any) -> Any:  # the tiers' worker role on every rank; the output rank's answer
        return ex.collective_rpc("call_kv_connector", "tiers", method, *args)[ex.output_rank]

    rpc("configure", engine.model_fingerprint)  # the output rank opens the tiers
    return TierManager(engine.config.tiers, engine.model_fingerprint, engine.cache_config.block_size, rpc)


def _kv_transfer(engine: Any, built: list[KVConnector]) -> KVConnector:
    from kvserve.disagg.connector import PDConnector

    ex = engine.executor
    handshake = {"model": Path(engine.model_path).name, "block_size": engine.cache_config.block_size,
                 "kv_dtype": str(engine.kv_dtype).removeprefix("torch."),
                 "block_shape": list(engine.kv_block_shape), "fingerprint": engine.model_fingerprint.hex()}
    connector = PDConnector(engine.config.kv_transfer, handshake, engine.cache_config.block_size)
    # The worker role on the output rank holds the sender: where it listens goes into the params.
    connector.set_worker_info(ex.collective_rpc("call_kv_connector", "kv_transfer", "configure", handshake)[ex.output_rank])
    return connector


def _blend(engine: Any, built: list[KVConnector]) -> KVConnector:
    from kvserve.blend.connector import BlendConnector

    config = engine.config
    if engine.kv.cache is None or not engine.kv.cache.supports_tiers:
        raise ValueError("enable_blending finds chunks by chain hash: it needs prefix caching with "
                         "--prefix-cache hash")
    if resolve_attention_backend(config.model.attention_backend, config.device) == "triton":
        raise ValueError("enable_blending needs the torch or cpu attention backend (triton has no "
                         "query positions)")
    tiers = next((c for c in built if c.name == "tiers"), None)
    return BlendConnector(config.blend, engine.kv, engine.hf_config.num_hidden_layers, tiers)


# In this order: the tiers first, so their worker half reads evicted blocks out before anything
# is written into the step's new blocks; blending last, as it finds chunks in the tiers.
CONNECTORS: tuple[ConnectorEntry, ...] = (
    ConnectorEntry("tiers", lambda c: c.tiers.enabled, _tiers),
    ConnectorEntry("kv_transfer", lambda c: c.kv_transfer.enabled, _kv_transfer, "kv_transfer_params",
                   "kv_transfer_params needs an engine started with --kv-role (prefill/decode "
                   "disaggregation); this one has none"),
    ConnectorEntry("blend", lambda c: c.blend.enabled, _blend, "blend",
                   "blend: this engine was started without --enable-blending"),
)


def build_connectors(engine: Any) -> dict[str, KVConnector]:
    """The scheduler roles of the connectors the engine's config turns on, by name, in order."""
    built: list[KVConnector] = []
    for entry in CONNECTORS:
        if entry.enabled(engine.config):
            c = entry.build(engine, built)
            c.name = entry.name
            built.append(c)
    return {c.name: c for c in built}


def combined(parts: dict[str, KVConnector]) -> MultiConnector | None:
    return MultiConnector(list(parts.values())) if parts else None


def check_request_keys(params: Any, parts: dict[str, KVConnector]) -> None:
    """Refuse a request that asks something of a connector this engine does not run."""
    extra = getattr(params, "extra_args", None) or {}
    for entry in CONNECTORS:
        if entry.request_key is not None and extra.get(entry.request_key) is not None and entry.name not in parts:
            raise ValueError(entry.off_message)
