"""EngineConfig's sections (model, cache, scheduler, parallelism, blending, speculative decoding), their allowed values and
the parsers and checks they share; the KV sections (tiers, events, transfer) are in config_kv.py.

Import EngineConfig and its sections from kvserve.config. No torch and nothing else of kvserve here:
every layer may import this.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
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
KV_CACHE_DTYPES = ("auto", "fp8", "bfloat16", "float32")
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "triton")  # attention/: cpu_backend.py, torch_backend.py, ...
PREFIX_CACHES = ("hash", "radix")
# --structured-outputs-backend: kvserve/structured/ (auto: the faster on the CPU path, BENCHMARKS.md)
STRUCTURED_OUTPUTS_BACKENDS = ("auto", "xgrammar", "guidance")
POOLING_CHOICES = ("last", "mean")  # --pooling: vLLM's PoolerConfig pooling_type LAST / MEAN
EXECUTOR_BACKENDS = ("uni", "mp", "ray")
KV_ROLES = ("prefill", "decode", "both")  # --kv-role; vLLM's kv_producer / kv_consumer / kv_both
KV_TRANSPORTS = ("auto", "zmq", "shm")  # disagg/transport.py; auto: shm when the peer is this host
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
# Weight quantization methods (quant/methods.py loads each; quant/base.py's METHODS is this list),
# listed here so that checking a config imports no torch.
QUANTIZATION_METHODS = ("awq", "gptq", "int4", "int8", "fp8", "gguf")
# The layouts `kvserve quantize` writes (quant/quantize.py), here for the same reason: its flags.
QUANTIZE_METHODS = ("awq", "gptq", "int8", "fp8", "rtn")


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

def check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")


def check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")


def check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
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
        if self.quantization not in (None, "none", *QUANTIZATION_METHODS):
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} (or none), "
                             f"got {self.quantization!r}")
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        check_choice("pooling", self.pooling, POOLING_CHOICES)
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(f"generation_config must be auto, none or a directory, got {self.generation_config!r}")
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, 1)
        check_int("seed", self.seed, 0)
        check_int("max_logprobs", self.max_logprobs, -1)
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
    # auto: the model dtype, and bfloat16 for a float32 model whose linears run in the float32 CPU
    # kernels (GGUF, int8, AWQ, GPTQ; model_runner.resolve_kv_cache_dtype) | fp8: float8 e4m3 with
    # per-layer scales | bfloat16 (for a float32 model: half the bytes) | float32 (a float32 model's K/V as computed)
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        check_int("block_size", self.block_size, 1)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_memory is not None:
            check_int("kv_cache_memory", self.kv_cache_memory, 1)
        if self.num_kv_blocks is not None:
            check_int("num_kv_blocks", self.num_kv_blocks, 1)
        check_kv_sizing(self.kv_cache_memory, self.gpu_memory_utilization)
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        if self.prefix_cache not in PREFIX_CACHES:
            raise ValueError(f"prefix_cache must be 'hash' or 'radix', got {self.prefix_cache!r}")


def parse_json_object(value: str | dict | None, name: str) -> dict[str, Any] | None:
    """A flag's JSON object ('{"a": 1}'), or the dict itself from LLM(...) keywords."""
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
        check_bool("enable_blending", self.enabled)
        if not isinstance(self.separator, str) or not self.separator.strip():
            raise ValueError(f"blend_separator must be a non-blank string, got {self.separator!r}")
        check_fraction("blend_recompute_ratio", self.recompute_ratio)
        check_int("blend_check_layer", self.check_layer, 0)
        check_int("blend_recompute_chunk_start", self.recompute_chunk_start, 0)
        check_int("blend_max_chunk_tokens", self.max_chunk_tokens, 1)
        if isinstance(self.max_deviation, bool) or not isinstance(self.max_deviation, (int, float)) \
                or not self.max_deviation > 0:
            raise ValueError(f"blend_max_deviation must be a positive number, got {self.max_deviation!r}")


# --speculative-config's methods (kvserve/spec_decode/); the keys of its JSON, as vLLM spells them.
SPECULATIVE_METHODS = ("ngram", "draft_model", "self_quantized")
SELF_QUANTIZED_DRAFTS = ("int4", "int8", "gguf")  # self_quantized's "quantization": the draft's weights
_SPECULATIVE_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                     "disable_by_batch_size", "adaptive", "model", "quantization")
_METHOD_KEYS = {"ngram": ("prompt_lookup_min", "prompt_lookup_max"), "draft_model": ("model", "quantization"),
                "self_quantized": ("quantization",)}


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (kvserve/spec_decode/), from --speculative-config's JSON as vLLM spells it:
    {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b};
    {"method": "draft_model", "model": PATH, "num_speculative_tokens": k} (a smaller model with the
    target's tokenizer; "quantization" loads it as --quantization would); {"method": "self_quantized", "quantization": "int4"|"int8"|"gguf",
    "num_speculative_tokens": k} (the target's own weights quantized at load draft for it).
    kvserve's keys: "adaptive" (default true: k per request from its acceptance rate, 0 when drafts do
    not pay) and "disable_by_batch_size" (vLLM's: nobody drafts while this many requests decode;
    default 16). None: off."""

    config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        cfg = self.config
        if cfg is None:
            return
        if not isinstance(cfg, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {cfg!r}")
        unknown = sorted(set(cfg) - set(_SPECULATIVE_KEYS))
        if unknown:
            raise ValueError(f"speculative_config: unknown key {unknown[0]!r}; known: {', '.join(_SPECULATIVE_KEYS)}")
        if cfg.get("method") not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)}, got "
                             f"{cfg.get('method')!r}")
        for key in (k for keys in _METHOD_KEYS.values() for k in keys if k not in _METHOD_KEYS[cfg["method"]]):
            if key in cfg:
                raise ValueError(f"speculative_config.{key} does not apply to method {cfg['method']!r}")
        if cfg["method"] == "draft_model" and (not isinstance(cfg.get("model"), str) or not cfg["model"]):
            raise ValueError("speculative_config.model (the draft model's path) is required for method draft_model")
        if cfg["method"] == "self_quantized":
            check_choice("speculative_config.quantization", self.quantization, SELF_QUANTIZED_DRAFTS)
        elif cfg["method"] == "draft_model" and self.quantization is not None:
            check_choice("speculative_config.quantization", self.quantization, (*QUANTIZATION_METHODS, "none"))
        if "num_speculative_tokens" not in cfg:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        check_int("speculative_config.num_speculative_tokens", cfg["num_speculative_tokens"], 1)
        check_int("speculative_config.prompt_lookup_min", self.prompt_lookup_min, 1)
        check_int("speculative_config.prompt_lookup_max", self.prompt_lookup_max, 1)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) is more than "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        check_int("speculative_config.disable_by_batch_size", self.disable_by_batch_size, 1)
        check_bool("speculative_config.adaptive", self.adaptive)

    @property
    def enabled(self) -> bool:
        return self.config is not None

    @property
    def method(self) -> str | None:
        return None if self.config is None else self.config["method"]

    @property
    def num_speculative_tokens(self) -> int:
        return 0 if self.config is None else self.config["num_speculative_tokens"]

    @property
    def prompt_lookup_max(self) -> int:
        return (self.config or {}).get("prompt_lookup_max", 5)

    @property
    def prompt_lookup_min(self) -> int:
        return (self.config or {}).get("prompt_lookup_min", min(2, self.prompt_lookup_max))

    @property
    def disable_by_batch_size(self) -> int:
        return (self.config or {}).get("disable_by_batch_size", 16)

    @property
    def adaptive(self) -> bool:
        return (self.config or {}).get("adaptive", True)

    @property
    def model(self) -> str | None:
        """draft_model: the draft's path."""
        return (self.config or {}).get("model")

    @property
    def quantization(self) -> str | None:
        """How the draft's weights load: self_quantized's copy of the target's (default int4), or
        a draft_model's --quantization (default: as its checkpoint says)."""
        return (self.config or {}).get("quantization", "int4" if self.method == "self_quantized" else None)

    @property
    def uses_draft_model(self) -> bool:
        """A second model drafts, on the ranks (draft_model, self_quantized); ngram drafts in the engine."""
        return self.method in ("draft_model", "self_quantized")


def check_fraction(name: str, value: object, below_one: bool = False) -> None:
    """A number in [0, 1] (below_one: [0, 1))."""
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0
            or (below_one and value == 1.0)):
        raise ValueError(f"{name} must be a number in [0, {')' if below_one else ']'}, got {value!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler's limits. None fields are filled in by the engine, which knows the model and the
    machine: max_num_batched_tokens (on a CPU from a prefill timed at start, engine/defaults.py) and
    max_model_len (from ModelConfig.max_model_len and the model's max_position_embeddings);
    EngineCore.scheduler_config is that resolved copy."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    # Share of a step's budget (what decodes leave of it) that prompts being prefilled leave to
    # waiting prompts short enough to finish in it: their first token does not wait for all of a
    # long prompt's chunks. 0: a running prompt takes what it can, as before.
    short_prompt_share: float = 0.5

    def __post_init__(self) -> None:
        check_int("max_num_seqs", self.max_num_seqs, 1)
        check_fraction("short_prompt_share", self.short_prompt_share, below_one=True)
        if self.max_num_batched_tokens is not None:
            check_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        if self.max_model_len is not None:
            check_int("max_model_len", self.max_model_len, 1)

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
        check_int("tensor_parallel_size", self.tensor_parallel_size, 1)
        check_int("pipeline_parallel_size", self.pipeline_parallel_size, 1)
        check_bool("enable_expert_parallel", self.enable_expert_parallel)
        if self.distributed_executor_backend is not None:
            check_choice("distributed_executor_backend", self.distributed_executor_backend, EXECUTOR_BACKENDS)
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ValueError(f"distributed_executor_backend 'uni' runs one rank, but the world size "
                             f"(tensor_parallel_size x pipeline_parallel_size) is {self.world_size}; use mp or ray")
        check_int("rank", self.rank, 0)
        if self.rank >= self.world_size:
            raise ValueError(f"rank must be < the world size ({self.world_size}), got {self.rank}")
        parse_cpu_threads_bind(self.cpu_threads_bind, self.world_size)  # raises on a bad list
        if self.cpu_threads is not None:
            check_int("cpu_threads", self.cpu_threads, 1)

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
