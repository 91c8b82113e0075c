"""EngineConfig's KV sections: tiers below the device pool (kv_tiers/), KV events for routers
(core/kv_events.py) and prefill/decode transfer (disagg/). Import them from kvserve.config."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Any

from kvserve.config_sections import (KV_LOAD_FAILURE_POLICIES, KV_ROLES, KV_TRANSPORTS, check_bool, check_choice,
                                     check_int)


@dataclass(frozen=True)
class TierConfig:
    """KV tiers below the device pool (kv_tiers/); each one optional, all off by default."""

    cpu_bytes: int = 0  # host RAM tier size; 0 = no host tier
    disk_path: str | None = None
    disk_bytes: int = 50 * 1024**3
    remote_url: str | None = None  # redis://host:port/db, shared by replicas
    # Admission: an entry leaving the host tier goes down only if it was hit this often
    # there (KVBM-style: disk writes are for blocks that get reused).
    disk_min_hits: int = 0
    remote_min_hits: int = 0
    # With a remote store: send every newly computed full block to it after the step (on the
    # writer thread), so other replicas reuse a prompt before this one ever evicts it. Off:
    # blocks reach the store only when evicted from this replica (less traffic, no sharing).
    remote_write_through: bool = True

    def __post_init__(self) -> None:
        check_int("kv_offload_cpu", self.cpu_bytes, 0)
        check_int("kv_offload_disk_size", self.disk_bytes, 1)
        check_int("kv_offload_disk_min_hits", self.disk_min_hits, 0)
        check_int("kv_remote_min_hits", self.remote_min_hits, 0)
        check_bool("kv_remote_write_through", self.remote_write_through)
        if self.remote_url is not None and not re.match(r"^(rediss?|unix)://", self.remote_url):
            raise ValueError(f"kv_remote must be a redis:// or unix:// URL, got {self.remote_url!r}")

    @property
    def writes_through(self) -> bool:
        return self.remote_write_through and self.remote_url is not None

    @property
    def enabled(self) -> bool:
        return bool(self.cpu_bytes or self.disk_path or self.remote_url)


@dataclass(frozen=True)
class KVEventsConfig:
    """Publishing the blocks this engine caches, for routers (core/kv_events.py); off by default."""

    endpoint: str | None = None  # ZMQ PUB address, e.g. tcp://127.0.0.1:5557
    replay_endpoint: str | None = None  # snapshot address; default: endpoint's port + 1

    def __post_init__(self) -> None:
        for name, addr in (("kv_events_endpoint", self.endpoint), ("kv_events_replay_endpoint", self.replay_endpoint)):
            if addr is not None and not re.match(r"^(tcp://[^:]+:\d+|ipc://.+|inproc://.+)$", addr):
                raise ValueError(f"{name} must be a ZMQ address such as tcp://127.0.0.1:5557, got {addr!r}")
        if self.replay_endpoint is not None and self.endpoint is None:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")
        if self.replay_endpoint is not None and self.replay_endpoint == self.endpoint:
            raise ValueError("kv_events_replay_endpoint must differ from kv_events_endpoint")

    @property
    def enabled(self) -> bool:
        return self.endpoint is not None

    @property
    def replay(self) -> str | None:
        """The replay address: the one given, else tcp on the endpoint's port + 1."""
        if self.replay_endpoint is not None or self.endpoint is None:
            return self.replay_endpoint
        m = re.match(r"^tcp://(.+):(\d+)$", self.endpoint)
        if m is None:
            raise ValueError("give kv_events_replay_endpoint when kv_events_endpoint is not tcp://HOST:PORT")
        return f"tcp://{m.group(1)}:{int(m.group(2)) + 1}"


_VLLM_KV_ROLES = {"kv_producer": "prefill", "kv_consumer": "decode", "kv_both": "both"}
_KV_TRANSFER_KEYS = ("kv_connector", "kv_role", "kv_ip", "kv_port", "engine_id", "kv_load_failure_policy",
                     "kv_connector_extra_config")
_KV_EXTRA_KEYS = ("transport", "lease_s", "fetch_timeout_s", "auth_key", "auth_key_file", "peers")
MIN_KV_KEY_BYTES = 16  # a deployment's shared K/V transfer key: anything shorter can be guessed


@dataclass(frozen=True)
class KVTransferConfig:
    """Prefill/decode disaggregation (disagg/): this engine's role, and `--kv-transfer-config`,
    a JSON object in the shape of vLLM's (kv_connector, kv_role, kv_ip, kv_port, engine_id,
    kv_load_failure_policy, kv_connector_extra_config: {transport, lease_s, fetch_timeout_s,
    auth_key_file | auth_key, peers}). Off unless a role is given, by --kv-role or by the JSON's
    kv_role. An engine with a role needs the deployment's shared key (disagg/auth.py) to start."""

    role: str | None = None  # --kv-role
    transfer_config: dict[str, Any] | None = None  # --kv-transfer-config, parsed
    load_failure_policy: str | None = None  # --kv-load-failure-policy (default recompute)

    def __post_init__(self) -> None:
        if self.role is not None:
            check_choice("kv_role", self.role, KV_ROLES)
        cfg = self.transfer_config or {}
        if not isinstance(cfg, dict):
            raise ValueError(f"kv_transfer_config must be a JSON object, got {cfg!r}")
        unknown = sorted(set(cfg) - set(_KV_TRANSFER_KEYS))
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown key {unknown[0]!r}; known: {', '.join(_KV_TRANSFER_KEYS)}")
        if cfg.get("kv_connector", "PDConnector") != "PDConnector":
            raise ValueError(f"kv_transfer_config.kv_connector must be 'PDConnector', got {cfg['kv_connector']!r}")
        if "kv_role" in cfg:
            role = _VLLM_KV_ROLES.get(cfg["kv_role"], cfg["kv_role"])
            check_choice("kv_transfer_config.kv_role", role, KV_ROLES)
            if self.role is not None and role != self.role:
                raise ValueError(f"kv_role {self.role!r} and kv_transfer_config.kv_role {cfg['kv_role']!r} disagree")
        if not isinstance(cfg.get("kv_ip", ""), str):
            raise ValueError(f"kv_transfer_config.kv_ip must be a host name or address, got {cfg['kv_ip']!r}")
        port = cfg.get("kv_port", 0)
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"kv_transfer_config.kv_port must be in [0, 65535], got {port!r}")
        policy = cfg.get("kv_load_failure_policy")
        if policy is not None:
            check_choice("kv_transfer_config.kv_load_failure_policy", policy, KV_LOAD_FAILURE_POLICIES)
        if self.load_failure_policy is not None:
            check_choice("kv_load_failure_policy", self.load_failure_policy, KV_LOAD_FAILURE_POLICIES)
            if policy is not None and policy != self.load_failure_policy:
                raise ValueError(f"kv_load_failure_policy {self.load_failure_policy!r} and "
                                 f"kv_transfer_config.kv_load_failure_policy {policy!r} disagree")
        extra = cfg.get("kv_connector_extra_config", {})
        if not isinstance(extra, dict):
            raise ValueError("kv_transfer_config.kv_connector_extra_config must be a JSON object")
        unknown = sorted(set(extra) - set(_KV_EXTRA_KEYS))
        if unknown:
            raise ValueError(f"kv_transfer_config.kv_connector_extra_config: unknown key {unknown[0]!r}; "
                             f"known: {', '.join(_KV_EXTRA_KEYS)}")
        check_choice("kv_transfer_config.kv_connector_extra_config.transport", self.transport, KV_TRANSPORTS)
        _check_auth(extra)
        for name in ("lease_s", "fetch_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"kv_transfer_config.kv_connector_extra_config.{name} must be a positive "
                                 f"number of seconds, got {v!r}")

    @property
    def kv_role(self) -> str | None:
        """prefill | decode | both, or None: no transfer."""
        cfg = self.transfer_config or {}
        return self.role or _VLLM_KV_ROLES.get(cfg.get("kv_role"), cfg.get("kv_role"))

    @property
    def enabled(self) -> bool:
        return self.kv_role is not None

    @property
    def produces(self) -> bool:
        """Computes prompts whose K/V another engine decodes from."""
        return self.kv_role in ("prefill", "both")

    @property
    def consumes(self) -> bool:
        """Decodes from K/V another engine computed."""
        return self.kv_role in ("decode", "both")

    @property
    def host(self) -> str:
        """The address the prefill side serves its K/V on, and tells decode engines."""
        return (self.transfer_config or {}).get("kv_ip", "127.0.0.1")

    @property
    def port(self) -> int:
        """0: a free port, picked at start."""
        return (self.transfer_config or {}).get("kv_port", 0)

    @property
    def engine_id(self) -> str | None:
        return (self.transfer_config or {}).get("engine_id")

    @property
    def policy(self) -> str:
        return self.load_failure_policy or (self.transfer_config or {}).get("kv_load_failure_policy", "recompute")

    def _extra(self, key: str, default: Any) -> Any:
        return (self.transfer_config or {}).get("kv_connector_extra_config", {}).get(key, default)

    @property
    def transport(self) -> str:
        return self._extra("transport", "auto")

    @property
    def lease_s(self) -> float:
        """How long a prefill engine keeps K/V that no decode engine has fetched."""
        return self._extra("lease_s", 60.0)

    @property
    def fetch_timeout_s(self) -> float:
        """How long a decode engine waits for a prefill engine's K/V before giving up."""
        return self._extra("fetch_timeout_s", 30.0)

    @property
    def peers(self) -> tuple[str, ...] | None:
        """The prefill engines ("host" or "host:port", as their kv_ip and kv_port) a decode engine
        may fetch from; None: any that signed the request's kv_transfer_params."""
        peers = self._extra("peers", None)
        return None if peers is None else tuple(peers)

    def auth_key(self) -> bytes | None:
        """The deployment's shared key (read from auth_key_file once per process), or None."""
        key = self._extra("auth_key", None)
        if key is not None:
            return key.encode()
        path = self._extra("auth_key_file", None)
        return None if path is None else _read_key_file(path)


def _check_auth(extra: dict[str, Any]) -> None:
    where = "kv_transfer_config.kv_connector_extra_config"
    if "auth_key" in extra and "auth_key_file" in extra:
        raise ValueError(f"{where}: give auth_key_file or auth_key, not both")
    key = extra.get("auth_key")
    if key is not None and (not isinstance(key, str) or len(key.encode()) < MIN_KV_KEY_BYTES):
        raise ValueError(f"{where}.auth_key must be a string of at least {MIN_KV_KEY_BYTES} bytes")
    if not isinstance(extra.get("auth_key_file", ""), str):
        raise ValueError(f"{where}.auth_key_file must be a path, got {extra['auth_key_file']!r}")
    peers = extra.get("peers", [])
    if not isinstance(peers, list) or not all(isinstance(p, str) and p for p in peers):
        raise ValueError(f"{where}.peers must be a list of \"host\" or \"host:port\" strings, got {peers!r}")


@functools.lru_cache(maxsize=None)
def _read_key_file(path: str) -> bytes:
    where = "kv_transfer_config.kv_connector_extra_config.auth_key_file"
    try:
        with open(path, "rb") as f:
            key = f.read().strip()
    except OSError as e:
        raise ValueError(f"{where} {path!r}: {e.strerror}") from None
    if len(key) < MIN_KV_KEY_BYTES:
        raise ValueError(f"{where} {path!r} holds {len(key)} bytes; a key needs at least {MIN_KV_KEY_BYTES}")
    return key
