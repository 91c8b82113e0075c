"""Defaults sized by the machine (engine/defaults.py): the KV pool from the memory there is and the
step budget from a timed prefill, as pure rules with injected facts, plus the flag that copies
vLLM's command line and one real start."""

from __future__ import annotations

import pytest

from kvserve.engine import defaults
from kvserve.engine.defaults import (BUDGET_CAP, BUDGET_FLOOR, CUDA_BUDGET, KV_AUTO_CAP, KV_AUTO_FLOOR, KV_FALLBACK,
                                     GiB, MemoryFacts, MiB, kv_pool_bytes, step_budget)

# ---- the step budget -------------------------------------------------------------------------------


@pytest.mark.parametrize("seconds_per_token,tokens", [
    (10e-3, BUDGET_FLOOR),  # a 1B model on 2 cores: 50 tokens fit 0.5 s, the floor holds
    (1.3e-3, 256),  # SmolLM2-135M on 2 cores: 384 fit, the power of two below
    (0.5 / 1024, 1024),  # exactly a power of two
    (0.2e-3, 2048),  # 2,500 fit
    (1e-6, BUDGET_CAP),  # a big machine: the cap
])
def test_budget_follows_the_measured_prefill(seconds_per_token, tokens):
    budget = step_budget(None, False, seconds_per_token)
    assert budget.tokens == tokens and budget.seconds_per_token == seconds_per_token
    assert "0.5 s goal" in budget.reason


def test_slow_machine_gets_a_smaller_budget_than_a_fast_one():
    slow, fast = step_budget(None, False, 4e-3), step_budget(None, False, 0.05e-3)
    assert BUDGET_FLOOR == slow.tokens < fast.tokens <= BUDGET_CAP


@pytest.mark.parametrize("cuda,seconds", [(False, 10e-3), (False, 1e-6), (True, None), (False, None)])
def test_the_users_budget_always_wins(cuda, seconds):
    assert step_budget(5, cuda, seconds).tokens == 5
    assert step_budget(100_000, cuda, seconds).tokens == 100_000


def test_cuda_and_unmeasured_defaults():
    assert step_budget(None, True, None).tokens == CUDA_BUDGET == 2048
    assert step_budget(None, True, 1.0).tokens == CUDA_BUDGET  # no measurement on CUDA
    for bad in (None, 0.0, float("nan"), -1.0):
        assert step_budget(None, False, bad).tokens == defaults.CPU_UNMEASURED_BUDGET


class FakeExecutor:
    """Each step takes the next duration of `times` on a fake clock; records what it was sent."""

    def __init__(self, times: list[float]) -> None:
        self.times, self.now, self.steps = list(times), 0.0, []

    def execute(self, so):
        self.steps.append(so)
        if so.num_scheduled_tokens:
            self.now += self.times.pop(0)


def _timed(monkeypatch, times: list[float], n: int = 256) -> tuple[float, FakeExecutor]:
    ex = FakeExecutor(times)
    monkeypatch.setattr(defaults.time, "perf_counter", lambda: ex.now)
    return defaults.time_prefill(ex, n, vocab_size=100, block_size=16), ex


def test_time_prefill_warms_up_then_keeps_the_fastest_run(monkeypatch):
    # warm-up 5 s (ignored), a run slowed by another process, then the machine's speed
    spt, ex = _timed(monkeypatch, [5.0, 0.4, 0.064])
    assert spt == pytest.approx(0.064 / 256)
    probes = [so for so in ex.steps if so.num_scheduled_tokens]
    assert [sum(so.num_scheduled_tokens.values()) for so in probes] == [defaults.PROBE_WARMUP_TOKENS, 256, 256]
    new = probes[1].new_reqs[0]
    assert new.block_ids == list(range(16)) and new.sampling_params.greedy and new.num_computed_tokens == 0
    assert all(0 <= t < 100 for t in new.prompt_token_ids)
    # every probe is forgotten by the runner right after it ran
    forgotten = [so.finished_req_ids for so in ex.steps if not so.num_scheduled_tokens]
    assert forgotten == [{so.new_reqs[0].req_id} for so in probes]


def test_time_prefill_skips_the_second_run_when_even_twice_the_speed_is_the_floor(monkeypatch):
    spt, ex = _timed(monkeypatch, [1.0, 2.56])  # 10 ms/token: 5 ms would still give the floor
    assert spt == pytest.approx(0.01) and len([s for s in ex.steps if s.num_scheduled_tokens]) == 2


def test_time_prefill_fits_a_small_probe(monkeypatch):
    spt, ex = _timed(monkeypatch, [0.1, 0.02, 0.01], n=20)
    assert spt == pytest.approx(0.01 / 20)
    assert ex.steps[0].new_reqs[0].prompt_token_ids == ex.steps[2].new_reqs[0].prompt_token_ids[:20]
    assert ex.steps[2].new_reqs[0].block_ids == [0, 1]


# ---- the KV pool ------------------------------------------------------------------------------------

HUGE = 1 << 50  # what max_num_seqs x max_model_len tokens could use: not binding


def cpu_pool(available: int | None, weights: int = 0, need: int = HUGE, **kw) -> defaults.KVPool:
    return kv_pool_bytes(cuda=False, memory=MemoryFacts(available=available, source="MemAvailable"),
                         weight_bytes=weights, need_bytes=need, **kw)


def test_cpu_default_is_a_share_of_the_ram_left_after_the_weights():
    pool = cpu_pool(10 * GiB, weights=1 * GiB)
    assert pool.bytes == int(9 * GiB * defaults.KV_AUTO_SHARE)
    assert "10.00 GiB RAM available (MemAvailable)" in pool.reason and "1.00 GiB of weights" in pool.reason


def test_cpu_default_floor_cap_and_need():
    small = cpu_pool(300 * MiB, weights=100 * MiB)
    assert small.bytes == KV_AUTO_FLOOR and "floor" in small.reason and "memory may run short" in small.reason
    assert cpu_pool(1024 * GiB).bytes == KV_AUTO_CAP and "the cap" in cpu_pool(1024 * GiB).reason
    need = cpu_pool(10 * GiB, need=64 * MiB)
    assert need.bytes == 64 * MiB and "max_num_seqs x max_model_len" in need.reason
    assert cpu_pool(100 * MiB, need=1 * MiB).bytes == 1 * MiB  # the need wins over the floor too


def test_cpu_ranks_share_the_hosts_ram():
    assert cpu_pool(10 * GiB, world_size=4).bytes == int(10 * GiB * defaults.KV_AUTO_SHARE) // 4
    assert cpu_pool(10 * GiB, gpu_memory_utilization=0.5, world_size=2).bytes == 5 * GiB // 2


def test_cpu_utilization_is_a_share_of_available_ram_for_weights_and_kv():
    pool = cpu_pool(10 * GiB, weights=1 * GiB, gpu_memory_utilization=0.5)
    assert pool.bytes == 4 * GiB and "gpu_memory_utilization=0.5" in pool.reason
    assert cpu_pool(10 * GiB, gpu_memory_utilization=0.95, need=1 * GiB).bytes == 1 * GiB
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=0.1 gives .* weights' .*raise gpu_memory_util"):
        cpu_pool(10 * GiB, weights=2 * GiB, gpu_memory_utilization=0.1)


def test_unreadable_memory_falls_back_to_the_old_fixed_size():
    assert cpu_pool(None).bytes == KV_FALLBACK == 2 * GiB
    assert cpu_pool(None, gpu_memory_utilization=0.9).bytes == KV_FALLBACK


def test_kv_cache_memory_is_taken_as_given():
    pool = cpu_pool(1 * GiB, kv_cache_memory=3 * GiB, world_size=2)
    assert pool.bytes == 3 * GiB and "kv_cache_memory" in pool.reason


def test_conflicting_and_bad_flags_name_the_fields():
    with pytest.raises(ValueError, match="gpu_memory_utilization and kv_cache_memory"):
        cpu_pool(10 * GiB, kv_cache_memory=GiB, gpu_memory_utilization=0.5)
    for bad in (0, 1.01, -0.5, float("nan"), "0.5", True):
        with pytest.raises(ValueError, match=r"gpu_memory_utilization must be a number in \(0, 1\]"):
            cpu_pool(10 * GiB, gpu_memory_utilization=bad)


def test_cuda_follows_vllm():
    total = MemoryFacts(total=80 * GiB, source="cuda:0")
    pool = kv_pool_bytes(cuda=True, memory=total, weight_bytes=16 * GiB, need_bytes=1, world_size=2,
                         gpu_memory_utilization=0.95, headroom=2 * GiB)
    assert pool.bytes == int(80 * GiB * 0.95) - 8 * GiB - 2 * GiB  # weights split over two devices; no need cap
    default = kv_pool_bytes(cuda=True, memory=total, weight_bytes=0, need_bytes=1)
    assert default.bytes == int(80 * GiB * 0.9) and "gpu_memory_utilization=0.9" in default.reason
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.1 gives 8.00 GiB of the device's 80.00 GiB"):
        kv_pool_bytes(cuda=True, memory=total, weight_bytes=7 * GiB, need_bytes=1, gpu_memory_utilization=0.1,
                      headroom=2 * GiB)


def test_activation_headroom_grows_with_the_budget():
    from types import SimpleNamespace

    cfg = SimpleNamespace(hidden_size=4096, intermediate_size=14336, vocab_size=128256)
    small, big = (defaults.activation_headroom(cfg, t, 256) for t in (2048, 8192))
    assert defaults.CUDA_RESERVED < small < big < 4 * GiB


# ---- reading the machine ----------------------------------------------------------------------------

MEMINFO = "MemTotal:       32000000 kB\nMemFree:         1000000 kB\nMemAvailable:   20000000 kB\n"


def test_meminfo_and_cgroup_parsers():
    assert defaults.meminfo_available(MEMINFO) == 20000000 * 1024
    assert defaults.meminfo_available("MemTotal: 1 kB\n") is None
    assert defaults.cgroup_room("max\n", "123\n") is None
    assert defaults.cgroup_room(str(1 << 62), "5") is None  # cgroup v1's "unlimited"
    assert defaults.cgroup_room("1000\n", "600\n") == 400
    assert defaults.cgroup_room("1000", "900", "anon 10\ninactive_file 300\n") == 400  # page cache is reclaimed
    assert defaults.cgroup_room("1000", "2000") == 0
    assert defaults.cgroup_room(None, "1") is None and defaults.cgroup_room("garbage", "1") is None


def test_host_memory_takes_the_tighter_of_meminfo_and_the_cgroup(tmp_path):
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/meminfo").write_text(MEMINFO)
    facts = defaults.host_memory(tmp_path)
    assert facts.available == 20000000 * 1024 and facts.source == "MemAvailable"
    cg = tmp_path / "sys/fs/cgroup"
    cg.mkdir(parents=True)
    (cg / "memory.max").write_text(str(8 * GiB))
    (cg / "memory.current").write_text(str(2 * GiB))
    facts = defaults.host_memory(tmp_path)
    assert facts.available == 6 * GiB and facts.source == "cgroup memory.max"
    (tmp_path / "proc/meminfo").unlink()
    (cg / "memory.max").write_text("max\n")
    assert defaults.host_memory(tmp_path).available is None


def test_checkpoint_estimate_matches_the_loaded_weights(tiny_model_factory):
    import torch

    from kvserve.models.loader import load_model, open_checkpoint

    path = tiny_model_factory("llama")
    ckpt = open_checkpoint(str(path))
    for dtype in (torch.float32, torch.bfloat16):
        estimate = defaults.checkpoint_weight_bytes(ckpt.path, None, dtype, None)
        actual = load_model(str(path), str(dtype).removeprefix("torch.")).weight_bytes
        assert actual * 0.9 <= estimate <= actual * 1.1, (dtype, estimate, actual)


# ---- the flag and a real start ------------------------------------------------------------------------

VLLM_DOCS = ["serve", "MODEL", "--tensor-parallel-size", "2", "--max-model-len", "4096",
             "--gpu-memory-utilization", "0.95", "--enable-prefix-caching"]


def test_vllm_docs_command_line_parses(capsys):
    from kvserve.cli import build_parser
    from kvserve.config import EngineConfig

    args = build_parser().parse_args(VLLM_DOCS)
    config = EngineConfig.from_cli_args(args)
    assert args.model_pos == "MODEL" and config.cache.gpu_memory_utilization == 0.95
    assert config.parallel.tensor_parallel_size == 2 and config.model.max_model_len == 4096
    assert config.cache.enable_prefix_caching is True
    assert config == EngineConfig.from_kwargs(tensor_parallel_size=2, max_model_len=4096, gpu_memory_utilization=0.95,
                                              enable_prefix_caching=True)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--gpu-memory-utilization FRACTION" in out and "40% of the RAM available after the weights" in out
    assert "takes at most 0.5 s" in out


def test_real_start_with_gpu_memory_utilization(tiny_model_factory):
    from kvserve import LLM, SamplingParams

    llm = LLM(model=str(tiny_model_factory("llama")), dtype="float32", gpu_memory_utilization=0.5)
    stats = llm.stats()
    assert "gpu_memory_utilization=0.5" in stats["kv_cache_sizing"]
    # the tiny model's pool is capped at what 256 requests of 512 tokens can use, not half the RAM
    assert stats["kv_blocks_total"] <= 256 * 512 // 16
    budget = stats["max_num_batched_tokens"]
    assert BUDGET_FLOOR <= budget <= BUDGET_CAP and budget & (budget - 1) == 0
    assert stats["prefill_seconds_per_token"] > 0 and "ms/token" in stats["step_budget_reason"]
    assert llm.engine.scheduler.config.max_num_batched_tokens == budget
    out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3


def test_a_given_budget_skips_the_measurement(tiny_model_factory):
    from kvserve import LLM

    llm = LLM(model=str(tiny_model_factory("llama")), dtype="float32", num_kv_blocks=32, max_num_batched_tokens=100)
    stats = llm.stats()
    assert stats["max_num_batched_tokens"] == 100 and "prefill_seconds_per_token" not in stats
    assert stats["kv_cache_sizing"] == "num_kv_blocks as given" and stats["kv_blocks_total"] == 32
