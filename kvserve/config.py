"""Frozen configuration dataclasses. Derived values are properties."""

from __future__ import annotations

import re
from dataclasses import dataclass

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


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


@dataclass(frozen=True)
class ModelConfig:
    """What to load and in which dtype. `model=None` is the embedded default model."""

    model: str | None = None
    dtype: str = "auto"  # auto | bfloat16 | float32 | float16
    max_model_len: int | None = None
    seed: int = 0
    # None: from the checkpoint (quantization_config, or a GGUF file); "none": load dequantized
    quantization: str | None = None

    def __post_init__(self) -> None:
        from kvserve.quant.base import check_method

        check_method(self.quantization)
        if self.dtype not in ("auto", "bfloat16", "float32", "float16"):
            raise ValueError(f"dtype must be one of auto, bfloat16, float32, float16; got {self.dtype!r}")
        if self.max_model_len is not None:
            _check_int("max_model_len", self.max_model_len, 1)
        _check_int("seed", self.seed, 0)


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache sizing and prefix caching."""

    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; default chosen by the engine
    num_kv_blocks: int | None = None  # overrides kv_cache_memory
    enable_prefix_caching: bool = True
    prefix_cache: str = "hash"  # hash | radix
    kv_cache_dtype: str = "auto"  # auto: the model dtype | fp8: float8 e4m3 with per-layer scales

    def __post_init__(self) -> None:
        _check_int("block_size", self.block_size, 1)
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError(f"kv_cache_dtype must be 'auto' or 'fp8', got {self.kv_cache_dtype!r}")
        if self.num_kv_blocks is not None:
            _check_int("num_kv_blocks", self.num_kv_blocks, 1)
        if self.prefix_cache not in ("hash", "radix"):
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
    # Also send every newly computed full block to the remote store at once, so other
    # replicas can reuse a prompt before this one ever evicts it.
    remote_write_through: bool = False

    def __post_init__(self) -> None:
        _check_int("kv_offload_cpu", self.cpu_bytes, 0)
        _check_int("kv_offload_disk_size", self.disk_bytes, 1)
        _check_int("kv_offload_disk_min_hits", self.disk_min_hits, 0)
        _check_int("kv_remote_min_hits", self.remote_min_hits, 0)
        if self.remote_url is not None and not re.match(r"^(rediss?|unix)://", self.remote_url):
            raise ValueError(f"kv_remote must be a redis:// or unix:// URL, got {self.remote_url!r}")
        if self.remote_write_through and self.remote_url is None:
            raise ValueError("kv_remote_write_through needs kv_remote")

    @property
    def enabled(self) -> bool:
        return bool(self.cpu_bytes or self.disk_path or self.remote_url)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048

    def __post_init__(self) -> None:
        _check_int("max_num_seqs", self.max_num_seqs, 1)
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_int("max_model_len", self.max_model_len, 1)
