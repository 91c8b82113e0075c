"""Frozen configuration dataclasses. Derived values are properties.

EngineConfig is built once at the edge (CLI flags, `LLM(**kwargs)`, the server) and passed
down whole; the flags that fill it are declared in kvserve/engine_args.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import re
from dataclasses import dataclass, field
from typing import Any

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "t": 1000**4,
          "tb": 1000**4, "tib": 1024**4}


def parse_size(value: int | str, field: str = "size") -> int:
    """Parse '2GiB', '512MB', '1e9' or an int into a number of bytes."""
    if isinstance(value, bool):
        raise ValueError(f"{field} must be a size such as '2GiB', got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*", value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"{field} must be a size such as '2GiB' or '512MiB', got {value!r}")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    else:
        raise ValueError(f"{field} must be a size such as '2GiB', got {type(value).__name__}")
    if n <= 0:
        raise ValueError(f"{field} must be positive, got {value!r}")
    return n


# Allowed values, shared by the validation below and the flags' choices (engine_args.py).
DTYPES = ("auto", "bfloat16", "float32", "float16")
KV_CACHE_DTYPES = ("auto", "fp8")
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")  # attention/: cpu_backend.py, torch_backend.py, ...
PREFIX_CACHES = ("hash", "radix")
POOLING_CHOICES = ("last", "mean")  # --pooling: vLLM's PoolerConfig pooling_type LAST / MEAN
EXECUTOR_BACKENDS = ("uni", "mp", "ray")
KV_ROLES = ("prefill", "decode", "both")  # --kv-role; vLLM's kv_producer / kv_consumer / kv_both
KV_TRANSPORTS = ("auto", "zmq", "shm")  # disagg/transport.py; auto: shm when the peer is this host
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")


def triton_interpreting() -> bool:
    """Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1): on a CPU, for tests."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_attention_backend(name: str, device: Any) -> str:
    """--attention-backend on `device` (a name or a torch.device): auto is `cpu` (the C kernels)
    on a CPU and `torch` on other devices (`triton` has not been measured on a GPU yet); `cpu`
    on another device, and `triton` on a CPU outside Triton's interpreter, are refused."""
    kind = str(device).split(":")[0]
    if name == "auto":
        return "cpu" if kind == "cpu" else "torch"
    if name == "cpu" and kind != "cpu":
        raise ValueError(f"attention_backend cpu runs on the CPU only, not on device {str(device)!r}; "
                         "use torch or auto")
    if name == "triton" and kind == "cpu" and not triton_interpreting():
        raise ValueError("attention_backend triton runs on a CUDA device; on a CPU only in Triton's interpreter "
                         "(TRITON_INTERPRET=1, for tests)")
    return name

def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


@dataclass(frozen=True)
class ModelConfig:
    """What to load and in which dtype. `model=None` is the embedded default model."""

    model: str | None = None
    dtype: str = "auto"  # auto | bfloat16 | float32 | float16
    max_model_len: int | None = None
    seed: int = 0
    # None: from the checkpoint (quantization_config, or a GGUF file); "none": load dequantized
    quantization: str | None = None
    # The model's sampling defaults for requests that omit a field (models/generation_config.py):
    # auto (generation_config.json or GGUF general.sampling.*), none, or a directory
    generation_config: str = "auto"
    # auto: cpu (the C kernels) on a CPU, torch elsewhere (resolve_attention_backend)
    attention_backend: str = "auto"
    # the most logprobs / prompt_logprobs a request may ask for (vLLM's max_logprobs); -1: the vocabulary
    max_logprobs: int = 20
    # vLLM's enforce_eager: no CUDA graphs for decode steps (they run on CUDA with the triton backend)
    enforce_eager: bool = False
    # How an embedding request pools the final hidden states (pooling_params.py): last or mean
    pooling: str = "last"

    def __post_init__(self) -> None:
        from kvserve.quant.base import check_method

        check_method(self.quantization)
        _check_choice("dtype", self.dtype, DTYPES)
        _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _check_choice("pooling", self.pooling, POOLING_CHOICES)
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(f"generation_config must be auto, none or a directory, got {self.generation_config!r}")
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 1)
        _check_int("seed", self.seed, 0)
        _check_int("max_logprobs", self.max_logprobs, -1)
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager must be true or false, got {self.enforce_eager!r}")


CUDA_DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's


def check_kv_sizing(kv_cache_memory: int | None, gpu_memory_utilization: float | None) -> None:
    """gpu_memory_utilization is a share in (0, 1], and it and kv_cache_memory are not both given:
    each sizes the KV cache, and silently preferring one would surprise whoever set the other."""
    if gpu_memory_utilization is None:
        return
    if isinstance(gpu_memory_utilization, bool) or not isinstance(gpu_memory_utilization, (int, float)) \
            or not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be a number in (0, 1], got {gpu_memory_utilization!r}")
    if kv_cache_memory is not None:
        raise ValueError("gpu_memory_utilization and kv_cache_memory both size the KV cache; give one of them "
                         "(kv_cache_memory: bytes per rank; gpu_memory_utilization: a share of the device's "
                         "memory, or on a CPU of the available RAM, for weights + KV)")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing and prefix caching. With none of kv_cache_memory, gpu_memory_utilization
    and num_kv_blocks, the engine sizes the pool from the memory there is (engine/defaults.py)."""

    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes per rank
    num_kv_blocks: int | None = None  # overrides kv_cache_memory and gpu_memory_utilization
    # Share of memory for weights + KV: the device's on CUDA (default 0.9), the available RAM on a CPU
    gpu_memory_utilization: float | None = None
    enable_prefix_caching: bool = True
    prefix_cache: str = "hash"  # hash | radix
    kv_cache_dtype: str = "auto"  # auto: the model dtype | fp8: float8 e4m3 with per-layer scales

    def __post_init__(self) -> None:
        _check_int("block_size", self.block_size, 1)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {self.kv_cache_dtype!r}")
        if self.kv_cache_memory is not None:
            _check_int("kv_cache_memory", self.kv_cache_memory, 1)
        if self.num_kv_blocks is not None:
            _check_int("num_kv_blocks", self.num_kv_blocks, 1)
        check_kv_sizing(self.kv_cache_memory, self.gpu_memory_utilization)
        _check_bool("enable_prefix_caching", self.enable_prefix_caching)
        if self.prefix_cache not in PREFIX_CACHES:
            raise ValueError(f"prefix_cache must be 'hash' or 'radix', got {self.prefix_cache!r}")


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
        _check_int("kv_offload_cpu", self.cpu_bytes, 0)
        _check_int("kv_offload_disk_size", self.disk_bytes, 1)
        _check_int("kv_offload_disk_min_hits", self.disk_min_hits, 0)
        _check_int("kv_remote_min_hits", self.remote_min_hits, 0)
        _check_bool("kv_remote_write_through", self.remote_write_through)
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
            _check_choice("kv_role", self.role, KV_ROLES)
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
            _check_choice("kv_transfer_config.kv_role", role, KV_ROLES)
            if self.role is not None and role != self.role:
                raise ValueError(f"kv_role {self.role!r} and kv_transfer_config.kv_role {cfg['kv_role']!r} disagree")
        if not isinstance(cfg.get("kv_ip", ""), str):
            raise ValueError(f"kv_transfer_config.kv_ip must be a host name or address, got {cfg['kv_ip']!r}")
        port = cfg.get("kv_port", 0)
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"kv_transfer_config.kv_port must be in [0, 65535], got {port!r}")
        policy = cfg.get("kv_load_failure_policy")
        if policy is not None:
            _check_choice("kv_transfer_config.kv_load_failure_policy", policy, KV_LOAD_FAILURE_POLICIES)
        if self.load_failure_policy is not None:
            _check_choice("kv_load_failure_policy", self.load_failure_policy, KV_LOAD_FAILURE_POLICIES)
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
        _check_choice("kv_transfer_config.kv_connector_extra_config.transport", self.transport, KV_TRANSPORTS)
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


def parse_json_object(value: str | dict | None, name: str) -> dict[str, Any] | None:
    """A flag's JSON object ('{"a": 1}'), or the dict itself from LLM(...) keywords."""
    import json

    if value is None or isinstance(value, dict):
        return value
    try:
        out = json.loads(value)
    except (TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"{name} must be a JSON object: {e}") from None
    if not isinstance(out, dict):
        raise ValueError(f"{name} must be a JSON object, got {value!r}")
    return out


BLEND_SEPARATOR = " # # "  # LMCache's


@dataclass(frozen=True)
class BlendConfig:
    """Non-prefix chunk reuse (blend/, CacheBlend-style); off unless enabled, so ordinary prompts
    that happen to contain the separator are never touched."""

    enabled: bool = False  # --enable-blending
    separator: str = BLEND_SEPARATOR  # splits a prompt's text: prefix SEP chunk SEP chunk ... SEP suffix
    recompute_ratio: float = 0.15  # the share of a blended span's tokens recomputed through every layer
    check_layer: int = 1  # where the tokens whose K/V deviate most from the reused copy are picked
    recompute_chunk_start: int = 0  # also recompute each chunk's first N tokens (EPIC's attention-sink fix)
    max_deviation: float = 0.05  # the quality guard: above this mean relative K/V deviation, full prefill
    max_chunk_tokens: int = 4096  # a longer chunk is refused

    def __post_init__(self) -> None:
        _check_bool("enable_blending", self.enabled)
        if not isinstance(self.separator, str) or not self.separator.strip():
            raise ValueError(f"blend_separator must be a non-blank string, got {self.separator!r}")
        check_recompute_ratio("blend_recompute_ratio", self.recompute_ratio)
        _check_int("blend_check_layer", self.check_layer, 0)
        _check_int("blend_recompute_chunk_start", self.recompute_chunk_start, 0)
        _check_int("blend_max_chunk_tokens", self.max_chunk_tokens, 1)
        if isinstance(self.max_deviation, bool) or not isinstance(self.max_deviation, (int, float)) \
                or not self.max_deviation > 0:
            raise ValueError(f"blend_max_deviation must be a positive number, got {self.max_deviation!r}")


def check_recompute_ratio(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's limits. None fields are filled in by the engine, which knows the model and the
    machine: max_num_batched_tokens (on a CPU from a prefill timed at start, engine/defaults.py) and
    max_model_len (from ModelConfig.max_model_len and the model's max_position_embeddings);
    EngineCore.scheduler_config is that resolved copy."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        if self.max_num_batched_tokens is not None:
            _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 1)

    @property
    def resolved(self) -> bool:
        return self.max_num_batched_tokens is not None and self.max_model_len is not None


def parse_cpu_threads_bind(value: str | None, world_size: int) -> tuple[tuple[int, ...], ...] | None:
    """'0-3|4-7' -> ((0, 1, 2, 3), (4, 5, 6, 7)): the cores of each rank, '|' between ranks.

    None or 'auto' -> None (no fixed binding: the executor decides). A group is a comma list of
    cores and ranges, e.g. '0,2' or '0-3,8'.
    """
    if value is None or value == "auto":
        return None
    if not isinstance(value, str):
        raise ValueError(f"cpu_threads_bind must be a string such as '0-3|4-7', got {value!r}")
    groups = value.split("|")
    if len(groups) != world_size:
        raise ValueError(f"cpu_threads_bind has {len(groups)} core list(s) ({value!r}) but the world size "
                         f"(tensor_parallel_size x pipeline_parallel_size) is {world_size}: give one per rank, "
                         "separated by '|'")
    return tuple(_parse_core_list(g, value) for g in groups)


def _parse_core_list(group: str, whole: str) -> tuple[int, ...]:
    cores: list[int] = []
    for item in group.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", item)
        if not m or (m.group(2) is not None and int(m.group(2)) < int(m.group(1))):
            raise ValueError(f"cpu_threads_bind: {item.strip()!r} in {whole!r} is not a core or a range "
                             "such as '0,2' or '0-3'")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        cores.extend(range(lo, hi + 1))
    return tuple(cores)


@dataclass(frozen=True)
class ParallelConfig:
    """How many ranks run the model, and how. The engine's copy has rank 0; each worker gets
    its own copy through EngineConfig.for_rank(rank)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False  # MoE experts sharded over the tensor-parallel ranks
    distributed_executor_backend: str | None = None  # uni | mp | ray; None: see `backend`
    cpu_threads_bind: str | None = None  # '0-3|4-7': cores per rank; None or 'auto': not fixed
    # Intra-op threads of each rank; None: one per core the rank may use (see Worker's bind_threads)
    cpu_threads: int | None = None
    rank: int = 0

    def __post_init__(self) -> None:
        _check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        _check_int("pipeline_parallel_size", self.pipeline_parallel_size, 1)
        _check_bool("enable_expert_parallel", self.enable_expert_parallel)
        if self.distributed_executor_backend is not None:
            _check_choice("distributed_executor_backend", self.distributed_executor_backend, EXECUTOR_BACKENDS)
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ValueError(f"distributed_executor_backend 'uni' runs one rank, but the world size "
                             f"(tensor_parallel_size x pipeline_parallel_size) is {self.world_size}; use mp or ray")
        _check_int("rank", self.rank, 0)
        if self.rank >= self.world_size:
            raise ValueError(f"rank must be < the world size ({self.world_size}), got {self.rank}")
        parse_cpu_threads_bind(self.cpu_threads_bind, self.world_size)  # raises on a bad list
        if self.cpu_threads is not None:
            _check_int("cpu_threads", self.cpu_threads, 1)

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def backend(self) -> str:
        """The executor to run: the one asked for, else uni for one rank and mp for several."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.world_size == 1 else "mp"

    @property
    def cpu_cores(self) -> tuple[tuple[int, ...], ...] | None:
        """The cores of each rank from cpu_threads_bind; None when no binding was given."""
        return parse_cpu_threads_bind(self.cpu_threads_bind, self.world_size)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, built once at the edge and passed down whole (it pickles:
    the engine process and every worker rank receive it as it is)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    tiers: TierConfig = field(default_factory=TierConfig)
    kv_events: KVEventsConfig = field(default_factory=KVEventsConfig)
    kv_transfer: KVTransferConfig = field(default_factory=KVTransferConfig)
    blend: BlendConfig = field(default_factory=BlendConfig)
    device: str = "cpu"
    check_integrity: bool = False  # check the KV cache's invariants after every step (tests)

    def __post_init__(self) -> None:
        sections = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                    "parallel": ParallelConfig, "tiers": TierConfig, "kv_events": KVEventsConfig,
                    "kv_transfer": KVTransferConfig, "blend": BlendConfig}
        for name, cls in sections.items():
            if not isinstance(getattr(self, name), cls):
                raise ValueError(f"EngineConfig.{name} must be a {cls.__name__}, got {getattr(self, name)!r}")
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"device must be a device name such as 'cpu' or 'cuda', got {self.device!r}")
        _check_bool("check_integrity", self.check_integrity)
        resolve_attention_backend(self.model.attention_backend, self.device)  # refuses a pair that cannot run

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """From kvserve.LLM's keyword arguments (the names in engine_args.FLAGS); an unknown
        one raises ValueError naming it."""
        from kvserve.engine_args import config_from_kwargs

        return config_from_kwargs(kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        """From the flags that engine_args.add_engine_args added to a parser."""
        from kvserve.engine_args import config_from_cli_args

        return config_from_cli_args(args)

    def for_rank(self, rank: int) -> EngineConfig:
        """This config as worker `rank` receives it."""
        return dataclasses.replace(self, parallel=dataclasses.replace(self.parallel, rank=rank))
