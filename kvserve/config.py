"""EngineConfig, built once at the edge and passed down whole, and FLAGS, the table of its options.

Every engine option is declared once, in FLAGS: its LLM keyword (also its argparse dest), the config
field it lands in, its default and its help. `EngineConfig.from_kwargs` (`LLM(**kwargs)`,
`AsyncEngine.start(**kwargs)`) and `EngineConfig.from_cli_args` (the server, the CLI) are built
from it here, and the CLI flags in kvserve/engine_args.py: adding an option is one entry here plus
the config field it lands in.

The sections are declared in config_sections.py (model, cache, scheduler, parallel, blend,
speculative) and
config_kv.py (tiers, events, transfer); import them from here. No torch and nothing else of kvserve
at import: every layer may import this.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from kvserve.config_kv import MIN_KV_KEY_BYTES, KVEventsConfig, KVTransferConfig, TierConfig
from kvserve.config_sections import (ATTENTION_BACKENDS, BLEND_SEPARATOR, CUDA_DEFAULT_GPU_MEMORY_UTILIZATION, DTYPES,
                                     EXECUTOR_BACKENDS, KV_CACHE_DTYPES, KV_LOAD_FAILURE_POLICIES, KV_ROLES,
                                     KV_TRANSPORTS, POOLING_CHOICES, PREFIX_CACHES, QUANTIZATION_METHODS,
                                     SPECULATIVE_METHODS, STRUCTURED_OUTPUTS_BACKENDS, BlendConfig,
                                     CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig, check_bool,
                                     check_choice, check_fraction, check_int, check_kv_sizing,
                                     parse_cpu_threads_bind, parse_json_object, parse_size, resolve_attention_backend,
                                     triton_interpreting)

__all__ = ["EngineConfig", "Flag", "FLAGS", "FLAGS_BY_NAME", "SECTIONS", "ATTENTION_BACKENDS", "BLEND_SEPARATOR",
           "CUDA_DEFAULT_GPU_MEMORY_UTILIZATION", "DTYPES", "EXECUTOR_BACKENDS", "KV_CACHE_DTYPES",
           "KV_LOAD_FAILURE_POLICIES", "KV_ROLES", "KV_TRANSPORTS", "MIN_KV_KEY_BYTES", "POOLING_CHOICES",
           "PREFIX_CACHES", "QUANTIZATION_METHODS", "SPECULATIVE_METHODS", "BlendConfig", "CacheConfig", "KVEventsConfig", "KVTransferConfig",
           "ModelConfig", "ParallelConfig", "SchedulerConfig", "SpeculativeConfig", "TierConfig", "check_bool", "check_choice", "check_fraction", "check_int",
           "check_kv_sizing", "parse_cpu_threads_bind", "parse_json_object", "parse_size",
           "resolve_attention_backend", "triton_interpreting"]

# EngineConfig's sections, by the name a Flag.target starts with.
SECTIONS: dict[str, type] = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig,
                             "parallel": ParallelConfig, "tiers": TierConfig, "kv_events": KVEventsConfig,
                             "kv_transfer": KVTransferConfig, "blend": BlendConfig,
                             "speculative": SpeculativeConfig}


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
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    device: str = "cpu"
    structured_outputs_backend: str = "auto"  # the grammar library (kvserve/structured/registry.py)
    check_integrity: bool = False  # check the KV cache's invariants after every step (tests)

    def __post_init__(self) -> None:
        for name, cls in SECTIONS.items():
            if not isinstance(getattr(self, name), cls):
                raise ValueError(f"EngineConfig.{name} must be a {cls.__name__}, got {getattr(self, name)!r}")
        if not isinstance(self.device, str) or not self.device:
            raise ValueError(f"device must be a device name such as 'cpu' or 'cuda', got {self.device!r}")
        check_bool("check_integrity", self.check_integrity)
        check_choice("structured_outputs_backend", self.structured_outputs_backend, STRUCTURED_OUTPUTS_BACKENDS)
        resolve_attention_backend(self.model.attention_backend, self.device)  # refuses a pair that cannot run

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """From kvserve.LLM's keyword arguments (the names in FLAGS); an unknown one raises
        ValueError naming it."""
        return config_from_kwargs(kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        """From the flags that engine_args.add_engine_args added to a parser."""
        return config_from_cli_args(args)

    def for_rank(self, rank: int) -> EngineConfig:
        """This config as worker `rank` receives it."""
        return dataclasses.replace(self, parallel=dataclasses.replace(self.parallel, rank=rank))


FIELD_DEFAULT: Any = object()  # a Flag's default when not given: its target field's


def field_default(target: str) -> Any:
    """The default of EngineConfig's field `target` ("section.field" or a top-level field)."""
    section, _, name = target.rpartition(".")
    fld = {f.name: f for f in dataclasses.fields(SECTIONS[section] if section else EngineConfig)}[name]
    return fld.default_factory() if fld.default is dataclasses.MISSING else fld.default


@dataclass(frozen=True)
class Flag:
    """One engine option. The CLI spelling is `--` + name with dashes (vLLM's spelling)."""

    name: str  # the LLM keyword and the argparse dest
    target: str  # where the value lands: "section.field" of EngineConfig, or a top-level field
    help: str
    group: str = "engine"  # a key of engine_args.GROUP_TITLES
    type: Callable[[str], Any] | None = None  # parses the CLI string (kwargs arrive typed)
    convert: Callable[[Any, str], Any] | None = None  # (value, flag name) -> field value, both paths
    choices: tuple[str, ...] | None = None
    aliases: tuple[str, ...] = ()  # more CLI spellings, e.g. -tp
    boolean: Literal["store_true", "optional"] | None = None  # optional: --x / --no-x
    metavar: str | None = None
    cli: bool = True  # False: an LLM keyword only
    # The value when the flag is not given: the target field's default unless given here (give it
    # only where the flag's default must differ from the field's, with a comment saying why).
    default: Any = FIELD_DEFAULT

    def __post_init__(self) -> None:
        if self.default is FIELD_DEFAULT:
            object.__setattr__(self, "default", field_default(self.target))

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")


def _size_or_none(value: int | str | None, name: str) -> int | None:
    return None if value is None else parse_size(value, name)


def _size_or_zero(value: int | str | None, name: str) -> int:
    return 0 if value is None else parse_size(value, name)


FLAGS: tuple[Flag, ...] = (
    Flag("model", "model.model", "HF directory or GGUF file (default: embedded SmolLM2-135M-Instruct)"),
    Flag("dtype", "model.dtype",
         "activation dtype (auto: bfloat16 on CUDA; on a CPU the faster of float32 / bfloat16 measured on "
         "the model's shapes at start, cached per CPU: `kvserve env` shows the choice)",
         choices=DTYPES),
    Flag("quantization", "model.quantization",
         "weight quantization (default: what the checkpoint says; none: load dequantized)",
         choices=(*QUANTIZATION_METHODS, "none"), aliases=("-q",)),
    Flag("attention_backend", "model.attention_backend",
         "paged attention kernels (auto: cpu on a CPU, torch elsewhere; cpu: compiled C kernels, torch: torch ops, "
         "triton: Triton kernels, CUDA)",
         choices=ATTENTION_BACKENDS),
    Flag("enforce_eager", "model.enforce_eager",
         "no CUDA graphs: decode steps launch their kernels one by one (graphs run on CUDA with the "
         "triton attention backend)", boolean="store_true"),
    Flag("kv_cache_dtype", "cache.kv_cache_dtype",
         "auto: the model's dtype, and bfloat16 for a float32 model with GGUF/int8/AWQ/GPTQ weights on a CPU; "
         "fp8: KV stored as float8 e4m3 with per-layer scales (about 2x the tokens); bfloat16: KV in 16 bits "
         "for a float32 model (2x the tokens, half the bytes a long context's decode reads); float32: a "
         "float32 model's KV as computed", choices=KV_CACHE_DTYPES),
    Flag("max_model_len", "model.max_model_len",
         "longest prompt + completion in tokens (default: the model's, at most 8192)", type=int),
    Flag("max_num_seqs", "scheduler.max_num_seqs", "most requests running at once", type=int),
    Flag("max_num_batched_tokens", "scheduler.max_num_batched_tokens",
         "token budget of one engine step (default: on a CPU the largest power of two of tokens whose "
         "prefill, timed at start, takes at most 0.5 s, within 256-8192; 2048 on CUDA)", type=int),
    Flag("short_prompt_share", "scheduler.short_prompt_share",
         "share of a step's token budget (after decodes) that prompts being prefilled leave to waiting "
         "prompts short enough to finish in it, so a short prompt's first token does not wait for all "
         "of a long prompt's chunks; 0 turns it off (default 0.5)", type=float, metavar="FRACTION"),
    Flag("block_size", "cache.block_size", "tokens per KV block", type=int),
    Flag("kv_cache_memory", "cache.kv_cache_memory",
         "KV cache size per rank, e.g. 2GiB (default: from free memory, see --gpu-memory-utilization)",
         convert=_size_or_none, metavar="SIZE"),
    Flag("gpu_memory_utilization", "cache.gpu_memory_utilization",
         "share of memory for weights + KV cache, in (0, 1]: on CUDA of the device's (default 0.9, as "
         "vLLM); on a CPU of the available RAM (default, without it and --kv-cache-memory: 40%% of the RAM "
         "available after the weights, at least 256 MiB, at most 16 GiB and what --max-num-seqs x "
         "--max-model-len tokens can use)", type=float, metavar="FRACTION"),
    Flag("num_kv_blocks", "cache.num_kv_blocks",
         "number of KV blocks (overrides --kv-cache-memory and --gpu-memory-utilization)", type=int),
    Flag("enable_prefix_caching", "cache.enable_prefix_caching",
         "reuse the KV cache of shared prompt prefixes", boolean="optional"),
    Flag("prefix_cache", "cache.prefix_cache", "prefix cache structure: hash chain or radix tree",
         choices=PREFIX_CACHES),
    Flag("seed", "model.seed", "random seed of the engine", type=int),
    Flag("max_logprobs", "model.max_logprobs",
         "the most logprobs / prompt_logprobs a request may ask for (-1: the whole vocabulary)", type=int),
    Flag("generation_config", "model.generation_config",
         "sampling defaults for requests that omit a field: auto (the model's generation_config.json, "
         "or a GGUF file's general.sampling.* keys), none (kvserve's own), or a directory holding a "
         "generation_config.json", metavar="auto|none|DIR"),
    Flag("pooling", "model.pooling",
         "how /v1/embeddings and LLM.embed pool the final hidden states (L2-normalized): last (the last "
         "prompt token's, the default: in a causal decoder only it has seen the whole prompt) or mean "
         "(over every prompt token; such requests skip the prefix cache, as each position is needed)",
         choices=POOLING_CHOICES),
    Flag("device", "device", "torch device, e.g. cpu or cuda"),
    Flag("check_integrity", "check_integrity", "check the KV cache's invariants after every step",
         cli=False),
    Flag("structured_outputs_backend", "structured_outputs_backend",
         "grammar library for structured outputs (JSON schema, regex, choice, grammar): xgrammar or guidance "
         "(llguidance); auto: xgrammar, the faster per step on a CPU (BENCHMARKS.md), and guidance for a "
         "constraint xgrammar refuses (a whitespace_pattern, a Lark grammar)",
         choices=STRUCTURED_OUTPUTS_BACKENDS),
    # ---- parallelism
    Flag("tensor_parallel_size", "parallel.tensor_parallel_size",
         "ranks that shard each layer's weights", group="parallel", type=int, aliases=("-tp",)),
    Flag("pipeline_parallel_size", "parallel.pipeline_parallel_size",
         "ranks that each run a range of the layers", group="parallel", type=int, aliases=("-pp",)),
    Flag("enable_expert_parallel", "parallel.enable_expert_parallel",
         "shard MoE experts over the ranks instead of slicing each expert", group="parallel",
         boolean="store_true"),
    Flag("distributed_executor_backend", "parallel.distributed_executor_backend",
         "uni: one process; mp: one process per rank; ray: Ray actors, across machines "
         "(default: uni for one rank, else mp)", group="parallel", choices=EXECUTOR_BACKENDS),
    Flag("cpu_threads_bind", "parallel.cpu_threads_bind",
         "CPU cores of each rank, '|' between ranks, e.g. '0-3|4-7' (default auto: ranks of one host "
         "share its cores equally)",
         group="parallel", metavar="CORES"),
    Flag("cpu_threads", "parallel.cpu_threads",
         "intra-op threads of each rank (default: one per core it may use: its --cpu-threads-bind cores, "
         "else its share of this host's, or OMP_NUM_THREADS); giving it fixes the count (the adaptive thread "
         "policy is off)", group="parallel", type=int, metavar="N"),
    # ---- KV tiers
    # default None, not the field's 0: "no host tier", which _size_or_zero turns into 0 (parse_size refuses a
    # size of 0, so `--kv-offload-cpu 0` stays an error)
    Flag("kv_offload_cpu", "tiers.cpu_bytes", "host RAM tier, e.g. 8GiB", group="tiers",
         convert=_size_or_zero, metavar="SIZE", default=None),
    Flag("kv_offload_disk", "tiers.disk_path", "local disk tier directory", group="tiers", metavar="PATH"),
    Flag("kv_offload_disk_size", "tiers.disk_bytes", "disk tier size", group="tiers",
         convert=parse_size, metavar="SIZE"),
    Flag("kv_offload_disk_min_hits", "tiers.disk_min_hits", "only blocks hit N times in host RAM go down to disk",
         group="tiers", type=int, metavar="N"),
    Flag("kv_remote", "tiers.remote_url", "shared store, e.g. redis://127.0.0.1:6379", group="tiers",
         metavar="URL"),
    Flag("kv_remote_min_hits", "tiers.remote_min_hits", "only blocks hit N times go to the shared store",
         group="tiers", type=int, metavar="N"),
    Flag("kv_remote_write_through", "tiers.remote_write_through",
         "send every new full block to --kv-remote after its step, in the background, so other replicas "
         "reuse it at once (default); --no-kv-remote-write-through: only blocks evicted from this replica "
         "go there (less store traffic, but replicas share only what one has evicted)", group="tiers",
         boolean="optional"),
    # ---- KV events
    Flag("kv_events_endpoint", "kv_events.endpoint",
         "publish every block stored or removed, in every tier, over ZMQ PUB at this address, "
         "e.g. tcp://127.0.0.1:5557", group="kv_events", metavar="ADDR"),
    Flag("kv_events_replay_endpoint", "kv_events.replay_endpoint",
         "where a (re)connecting subscriber gets a snapshot of the current blocks "
         "(default: the endpoint's port + 1)", group="kv_events", metavar="ADDR"),
    # ---- prefill/decode disaggregation
    Flag("kv_role", "kv_transfer.role",
         "prefill: computes prompts and serves their K/V to decode engines; decode: generates from K/V "
         "pulled from a prefill engine (requests name it in kv_transfer_params); both", group="kv_transfer",
         choices=KV_ROLES),
    Flag("kv_transfer_config", "kv_transfer.transfer_config",
         "JSON in vLLM's shape, e.g. '{\"kv_connector\":\"PDConnector\",\"kv_role\":\"kv_producer\",'"
         "'\"kv_ip\":\"127.0.0.1\",\"kv_port\":14579,\"kv_connector_extra_config\":{\"transport\":\"auto\"}}'; "
         "transport zmq (TCP), shm (shared memory, same host) or auto; auth_key_file: the deployment's shared "
         "key (at least 16 bytes; needed with --kv-role; auth_key takes it inline); peers: the prefill engines "
         "a decode engine may fetch from, e.g. [\"10.0.0.5:14579\"]", group="kv_transfer",
         convert=parse_json_object, metavar="JSON"),
    Flag("kv_load_failure_policy", "kv_transfer.load_failure_policy",
         "when K/V cannot be pulled from the prefill engine: recompute (prefill here; default) or fail "
         "(the request fails with an error)", group="kv_transfer", choices=KV_LOAD_FAILURE_POLICIES),
    # ---- non-prefix reuse (blend/)
    Flag("enable_blending", "blend.enabled",
         "reuse the K/V of text chunks anywhere in a prompt: chunks are marked by --blend-separator or "
         "listed in a request's `blend.chunks`", group="blend", boolean="store_true"),
    Flag("blend_separator", "blend.separator",
         "splits a prompt's text into prefix, chunks and suffix (prefix SEP chunk SEP ... SEP suffix)",
         group="blend", metavar="TEXT"),
    Flag("blend_recompute_ratio", "blend.recompute_ratio",
         "share of a blended span's tokens recomputed through every layer (1 = a plain prefill)",
         group="blend", type=float, metavar="R"),
    Flag("blend_check_layer", "blend.check_layer",
         "the layer at which the tokens to recompute are picked", group="blend", type=int, metavar="L"),
    Flag("blend_recompute_chunk_start", "blend.recompute_chunk_start",
         "also recompute each chunk's first N tokens", group="blend", type=int, metavar="N"),
    Flag("blend_max_deviation", "blend.max_deviation",
         "quality guard: a blend whose reused K/V deviate more than this (mean relative) is recomputed "
         "in full", group="blend", type=float, metavar="D"),
    Flag("blend_max_chunk_tokens", "blend.max_chunk_tokens",
         "longest chunk accepted", group="blend", type=int, metavar="N"),
    # ---- speculative decoding (spec_decode/)
    Flag("speculative_config", "speculative.config",
         "JSON in vLLM's shape, e.g. '{\"method\":\"ngram\",\"num_speculative_tokens\":4,"
         "\"prompt_lookup_max\":5,\"prompt_lookup_min\":2}': drafts from the request's own earlier tokens, "
         "verified in one forward (outputs unchanged); method draft_model (\"model\": a smaller model with the "
         "same tokenizer) or self_quantized (\"quantization\": int4|int8|gguf, the model's own weights rounded "
         "at load); kvserve's keys: adaptive (default true: k per request from its acceptance rate), "
         "disable_by_batch_size (default 16)", group="speculative",
         convert=parse_json_object, metavar="JSON"),
)

FLAGS_BY_NAME: dict[str, Flag] = {f.name: f for f in FLAGS}


def config_from_kwargs(kwargs: Mapping[str, Any]) -> EngineConfig:
    """EngineConfig from LLM keyword arguments; flags not given take their defaults."""
    unknown = [k for k in kwargs if k not in FLAGS_BY_NAME]
    if unknown:
        close = difflib.get_close_matches(unknown[0], FLAGS_BY_NAME, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown engine argument {unknown[0]!r}{hint}")
    return _build({f.name: kwargs.get(f.name, f.default) for f in FLAGS})


def config_from_cli_args(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from a namespace parsed with add_engine_args."""
    return _build({f.name: getattr(args, f.name) if f.cli else f.default for f in FLAGS})


def _build(values: Mapping[str, Any]) -> EngineConfig:
    sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    top: dict[str, Any] = {}
    for f in FLAGS:
        value = values[f.name]
        if f.convert is not None:
            value = f.convert(value, f.name)
        section, _, field = f.target.rpartition(".")
        (sections[section] if section else top)[field] = value
    return EngineConfig(**{name: cls(**sections[name]) for name, cls in SECTIONS.items()}, **top)
