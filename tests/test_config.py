"""EngineConfig and the flag table: every flag reaches the same config from the CLI and from
LLM keywords, bad values name the flag, and the config survives pickling (the engine process
and worker ranks receive it that way)."""

from __future__ import annotations

import argparse
import dataclasses
import pickle

import pytest

from kvserve.config import (FLAGS, FLAGS_BY_NAME, SECTIONS, EngineConfig, Flag, ParallelConfig, SchedulerConfig,
                            parse_cpu_threads_bind)
from kvserve.engine_args import add_engine_args

# A non-default value of every flag, as an LLM keyword value (the CLI gets str(value)).
EXAMPLES = {
    "model": "/models/tiny.gguf", "dtype": "float32", "quantization": "gguf", "kv_cache_dtype": "fp8",
    "attention_backend": "torch", "enforce_eager": True, "structured_outputs_backend": "guidance",
    "max_model_len": 512, "max_num_seqs": 8, "max_num_batched_tokens": 64, "short_prompt_share": 0.25, "block_size": 32,
    "kv_cache_memory": "3GiB", "gpu_memory_utilization": 0.5, "num_kv_blocks": 100, "enable_prefix_caching": False,
    "prefix_cache": "radix",
    "seed": 7, "max_logprobs": -1, "device": "cuda", "check_integrity": True, "generation_config": "none",
    "pooling": "mean",
    "tensor_parallel_size": 2, "pipeline_parallel_size": 2, "enable_expert_parallel": True,
    "distributed_executor_backend": "ray", "cpu_threads_bind": "0-3", "cpu_threads": 3,
    "kv_offload_cpu": "8GiB", "kv_offload_disk": "/tmp/kv", "kv_offload_disk_size": "10GiB",
    "kv_offload_disk_min_hits": 2, "kv_remote": "redis://127.0.0.1:6379", "kv_remote_min_hits": 3,
    "kv_remote_write_through": False,
    "kv_events_endpoint": "tcp://127.0.0.1:5557", "kv_events_replay_endpoint": "tcp://127.0.0.1:6000",
    "kv_role": "decode", "kv_transfer_config": '{"kv_port": 5000}', "kv_load_failure_policy": "fail",
    "enable_blending": True, "blend_separator": " ## ", "blend_recompute_ratio": 0.3, "blend_check_layer": 2,
    "blend_recompute_chunk_start": 4, "blend_max_deviation": 0.8, "blend_max_chunk_tokens": 1024,
    "speculative_config": '{"method": "ngram", "num_speculative_tokens": 3}',
}
# Flags that only make sense with another one.
NEEDS = {"kv_events_replay_endpoint": {"kv_events_endpoint": "tcp://127.0.0.1:5557"}}
# Config fields no flag sets: the engine fills them in (or, for rank, the executor).
DERIVED = {"scheduler.max_model_len", "parallel.rank"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return p


def argv_of(flag: Flag, value: object) -> list[str]:
    if flag.boolean is not None:
        assert isinstance(value, bool)
        return [flag.option] if value else ["--no-" + flag.option[2:]]
    return [flag.option, str(value)]


def both_ways(kwargs: dict[str, object]) -> tuple[EngineConfig, EngineConfig]:
    argv = [a for name, v in kwargs.items() if FLAGS_BY_NAME[name].cli for a in argv_of(FLAGS_BY_NAME[name], v)]
    from_cli = EngineConfig.from_cli_args(parser().parse_args(argv))
    cli_only = {k: v for k, v in kwargs.items() if FLAGS_BY_NAME[k].cli}
    return EngineConfig.from_kwargs(**cli_only), from_cli


def target_value(config: EngineConfig, flag: Flag) -> object:
    obj: object = config
    for part in flag.target.split("."):
        obj = getattr(obj, part)
    return obj


def test_every_flag_has_an_example_and_a_unique_spelling():
    assert set(EXAMPLES) == set(FLAGS_BY_NAME), "add a non-default example for each new flag"
    spellings = [s for f in FLAGS if f.cli for s in (f.option, *f.aliases)]
    assert len(spellings) == len(set(spellings))


def test_every_config_field_is_declared_exactly_once():
    targets = [f.target for f in FLAGS]
    assert len(targets) == len(set(targets)), "two flags land in one field"
    fields = {f"{name}.{fld.name}" for name, cls in SECTIONS.items() for fld in dataclasses.fields(cls)}
    top = {fld.name for fld in dataclasses.fields(EngineConfig) if fld.name not in SECTIONS}
    assert set(targets) == (fields | top) - DERIVED


# Flags whose default differs from their field's on purpose (each says why beside its entry in FLAGS):
# name -> the flag's default, which its convert turns into the field's default.
DEFAULT_EXCEPTIONS = {"kv_offload_cpu": None}  # no host tier; _size_or_zero makes it the field's 0


def test_every_flag_takes_its_default_from_its_field():
    """A default lives in one place, the dataclass field; the few exceptions are listed above."""
    defaults = EngineConfig()
    for flag in FLAGS:
        field_value = target_value(defaults, flag)
        if flag.name in DEFAULT_EXCEPTIONS:
            assert flag.default == DEFAULT_EXCEPTIONS[flag.name], flag.name
            assert flag.default != field_value and flag.convert is not None, f"{flag.name}: drop the exception"
            assert flag.convert(flag.default, flag.name) == field_value, flag.name
        else:
            assert flag.default == field_value and type(flag.default) is type(field_value), flag.name


def test_defaults_agree_with_the_dataclasses():
    from_kwargs, from_cli = both_ways({})
    assert from_kwargs == from_cli == EngineConfig()


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_each_flag_round_trips(name):
    flag = FLAGS_BY_NAME[name]
    kwargs = {**NEEDS.get(name, {}), name: EXAMPLES[name]}
    config = EngineConfig.from_kwargs(**kwargs)
    assert target_value(config, flag) != target_value(EngineConfig(), flag), f"{name} changed nothing"
    if flag.cli:
        from_kwargs, from_cli = both_ways(kwargs)
        assert from_cli == from_kwargs == config


def test_all_flags_together_round_trip_and_pickle():
    kwargs = dict(EXAMPLES, cpu_threads_bind="0-1|2-3|4,6|5")  # four ranks: tp 2 x pp 2
    del kwargs["gpu_memory_utilization"]  # sizes the KV cache as kv_cache_memory does: one or the other
    from_kwargs, from_cli = both_ways(kwargs)
    assert from_cli == from_kwargs
    config = EngineConfig.from_kwargs(**kwargs)
    assert config.cache.kv_cache_memory == 3 * 1024**3 and config.tiers.cpu_bytes == 8 * 1024**3
    assert config.tiers.disk_bytes == 10 * 1024**3 and config.model.quantization == "gguf"
    assert config.parallel.world_size == 4 and config.parallel.backend == "ray"
    assert config.parallel.cpu_cores == ((0, 1), (2, 3), (4, 6), (5,))
    assert pickle.loads(pickle.dumps(config)) == config
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.device = "cpu"  # type: ignore[misc]


def test_short_spellings_and_negated_booleans():
    args = parser().parse_args(["-q", "none", "-tp", "2", "-pp", "3", "--no-enable-prefix-caching",
                                "--distributed-executor-backend", "mp", "--kv-cache-memory", "512MiB"])
    config = EngineConfig.from_cli_args(args)
    assert config.model.quantization == "none" and config.cache.enable_prefix_caching is False
    assert (config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size) == (2, 3)
    assert config.parallel.backend == "mp" and config.cache.kv_cache_memory == 512 * 1024**2


def test_bad_choices_are_refused_by_the_parser(capsys):
    for argv in (["--distributed-executor-backend", "foo"], ["--dtype", "int3"], ["-q", "int3"]):
        with pytest.raises(SystemExit):
            parser().parse_args(argv)
    assert "foo" in capsys.readouterr().err


@pytest.mark.parametrize("kwargs,message", [
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be >= 1"),
    ({"pipeline_parallel_size": 1.5}, "pipeline_parallel_size must be an integer"),
    ({"distributed_executor_backend": "foo"}, "distributed_executor_backend must be one of uni, mp, ray"),
    ({"tensor_parallel_size": 2, "distributed_executor_backend": "uni"}, "distributed_executor_backend 'uni'"),
    ({"cpu_threads_bind": "0|1"}, r"cpu_threads_bind has 2 core list\(s\).*world size.* is 1"),
    ({"tensor_parallel_size": 2, "cpu_threads_bind": "0-3"}, "cpu_threads_bind has 1 core list"),
    ({"tensor_parallel_size": 2, "cpu_threads_bind": "0-3|x"}, "cpu_threads_bind: 'x'"),
    ({"cpu_threads_bind": "3-1"}, "cpu_threads_bind: '3-1'"),
    ({"cpu_threads": 0}, "cpu_threads must be >= 1, got 0"),
    ({"cpu_threads": "4"}, "cpu_threads must be an integer"),
    ({"enable_expert_parallel": "yes"}, "enable_expert_parallel must be True or False"),
    ({"kv_cache_memory": "lots"}, "kv_cache_memory must be a size"),
    ({"kv_offload_cpu": "-1GiB"}, "kv_offload_cpu must be a size"),
    ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be >= 1"),
    ({"block_size": "16"}, "block_size must be an integer"),
    ({"kv_remote_write_through": "no"}, "kv_remote_write_through must be True or False"),
    ({"check_integrity": 1}, "check_integrity must be True or False"),
    ({"kv_cache_memroy": "1GiB"}, "unknown engine argument 'kv_cache_memroy'; did you mean 'kv_cache_memory'"),
    ({"gpu_memory_utilization": 0}, r"gpu_memory_utilization must be a number in \(0, 1\], got 0"),
    ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be a number in \(0, 1\]"),
    ({"gpu_memory_utilization": True}, r"gpu_memory_utilization must be a number in \(0, 1\]"),
    ({"gpu_memory_utilization": 0.9, "kv_cache_memory": "1GiB"},
     "gpu_memory_utilization and kv_cache_memory both size the KV cache"),
])
def test_bad_values_name_the_flag(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.from_kwargs(**kwargs)


def test_bad_cli_values_name_the_flag():
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig.from_cli_args(parser().parse_args(["-tp", "0"]))
    with pytest.raises(ValueError, match="cpu_threads_bind has 2"):
        EngineConfig.from_cli_args(parser().parse_args(["--cpu-threads-bind", "0|1"]))
    with pytest.raises(ValueError, match="cpu_threads must be >= 1"):
        EngineConfig.from_cli_args(parser().parse_args(["--cpu-threads", "0"]))


def test_llm_refuses_unknown_keywords_and_mixed_config_before_loading():
    from kvserve import LLM

    with pytest.raises(ValueError, match="unknown engine argument 'bogus'"):
        LLM(bogus=1)
    with pytest.raises(ValueError, match="either config or engine keyword arguments"):
        LLM(config=EngineConfig(), dtype="float32")


def test_parallel_config_ranks_and_backend():
    p = ParallelConfig(tensor_parallel_size=2, cpu_threads_bind="0,2|1,3")
    assert p.world_size == 2 and p.backend == "mp" and p.cpu_cores == ((0, 2), (1, 3))
    assert ParallelConfig().backend == "uni" and ParallelConfig(cpu_threads_bind="auto").cpu_cores is None
    assert parse_cpu_threads_bind(" 0 - 1 ", 1) == ((0, 1),)
    config = EngineConfig(parallel=p)
    worker = config.for_rank(1)
    assert worker.parallel.rank == 1 and config.parallel.rank == 0
    assert dataclasses.replace(worker, parallel=config.parallel) == config
    with pytest.raises(ValueError, match="rank must be < the world size"):
        config.for_rank(2)


def test_scheduler_runs_only_on_a_resolved_config():
    from kvserve.core.kv_manager import KVCacheManager
    from kvserve.core.scheduler import Scheduler

    assert not SchedulerConfig().resolved
    with pytest.raises(ValueError, match="max_num_batched_tokens and max_model_len"):
        Scheduler(SchedulerConfig(), KVCacheManager(8, 4))


def test_kvserve_commands_take_every_flag():
    """The flags appear on serve, generate, chat and bench throughput, and reach the config."""
    from kvserve.cli import build_parser

    extra = ["-tp", "2", "--kv-offload-cpu", "1GiB", "--max-num-seqs", "3"]
    for argv in (["serve"], ["generate", "--prompt", "hi"], ["chat"], ["bench", "throughput"]):
        config = EngineConfig.from_cli_args(build_parser().parse_args([*argv, *extra]))
        assert config == EngineConfig.from_kwargs(tensor_parallel_size=2, kv_offload_cpu="1GiB", max_num_seqs=3)


def test_config_imports_no_torch():
    import subprocess
    import sys

    code = "import sys, kvserve.config, kvserve.engine_args; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_cli_parser_imports_no_torch():
    """`kvserve serve` parses its flags and spawns the engine before anything imports torch (~2.5 s):
    building the whole parser (every subcommand's flags) must not import it."""
    import subprocess
    import sys

    code = ("import sys; from kvserve.cli import build_parser; build_parser(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
