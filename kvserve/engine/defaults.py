"""Defaults sized by the machine: the KV pool from the memory there is, the step budget from a
prefill timed at start.

The rules (`kv_pool_bytes`, `step_budget`) are pure functions of the machine's facts, so tests
inject them; the readers below them (`host_memory`, `cuda_memory`, `checkpoint_weight_bytes`,
`time_prefill`) gather those facts. EngineCore applies both once at start and logs one line for
each decision.
"""

from __future__ import annotations

import json
import logging
import math
import re
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvserve.config import CUDA_DEFAULT_GPU_MEMORY_UTILIZATION, EngineConfig, check_kv_sizing
from kvserve.core.sched_output import NewRequestData, SchedulerOutput
from kvserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

MiB, GiB = 1024**2, 1024**3

# ---- the KV pool ---------------------------------------------------------------------------
# No sizing flag, on a CPU: this share of the RAM left once the weights are in. The rest stays for
# activations, the page cache and other processes; engines started one after another each take
# 40% of what the last one left, so together they never claim all of it (1 - 0.6^n < 1).
KV_AUTO_SHARE = 0.4
# Below this a pool holds too few tokens to serve (a 256 MiB float32 pool is ~5,800 tokens of
# SmolLM2-135M, ~2,000 of a 1B model in bf16), whatever the machine says.
KV_AUTO_FLOOR = 256 * MiB
# A CPU computes hundreds of tokens a second: 16 GiB holds 130k tokens of an 8B model in bf16 (30
# contexts of 4k), more than it can keep busy, and zeroing more at start takes seconds.
KV_AUTO_CAP = 16 * GiB
# Neither /proc/meminfo nor a cgroup limit could be read: the fixed size of earlier versions.
KV_FALLBACK = 2 * GiB
# CUDA: the context, cuBLAS workspaces, CUDA graph pools and allocator slack, besides activations.
CUDA_RESERVED = 1 * GiB
# Repacked GGUF blocks carry float32 scales: SmolLM2's Q4_1 / Q8_0 tensors take 1.21x their file
# bytes once loaded. Erring high leaves the KV pool a little smaller, never too large.
GGUF_REPACK_OVERHEAD = 1.25
# Loaded weights this much larger than that estimate are worth a warning when the KV pool was sized
# from the memory left after them.
WEIGHT_ESTIMATE_SLACK = 1.1

# ---- the step budget -------------------------------------------------------------------------
# A mixed step (a prompt's chunk beside the running decodes) should take at most this long: every
# streaming request waits that long for its next token while a long prompt is prefilled.
STEP_GOAL_S = 0.5
BUDGET_FLOOR = 256  # smaller chunks lose prefill throughput (matrix units want rows) for little latency
BUDGET_CAP = 8192  # vLLM's largest serving default; past it a step only queues more prompt
CUDA_BUDGET = 2048  # vLLM's serving default on CUDA; GPU steps take milliseconds, nothing to measure
CPU_UNMEASURED_BUDGET = 512  # no timing possible: the budget measured best on a 2-core CPU
PROBE_TOKENS = 256  # the timed prefill: long enough to run as a prefill does, short enough to start fast
PROBE_WARMUP_TOKENS = 32


def fmt_bytes(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / MiB:.1f} MiB"


@dataclass(frozen=True)
class MemoryFacts:
    """What the machine says, in bytes (None where it could not be read)."""

    available: int | None = None  # CPU: RAM this engine may still take
    total: int | None = None  # CUDA: one device's memory
    source: str = "unknown"  # where the numbers came from, for the log line


@dataclass(frozen=True)
class KVPool:
    bytes: int  # per rank
    reason: str  # why, for the log line and stats()


def kv_pool_bytes(*, cuda: bool, memory: MemoryFacts, weight_bytes: int, need_bytes: int, world_size: int = 1,
                  kv_cache_memory: int | None = None, gpu_memory_utilization: float | None = None,
                  headroom: int = 0) -> KVPool:
    """Bytes of KV cache per rank. kv_cache_memory is taken as given (per rank). On CUDA every rank
    has a device: total * utilization - its weights - headroom (vLLM's rule, utilization 0.9 by
    default). On a CPU the ranks share the host's RAM: with gpu_memory_utilization, available *
    utilization - weights; without, KV_AUTO_SHARE of (available - weights) within [KV_AUTO_FLOOR,
    KV_AUTO_CAP]; either at most need_bytes (max_num_seqs requests of max_model_len tokens)."""
    check_kv_sizing(kv_cache_memory, gpu_memory_utilization)
    if kv_cache_memory is not None:
        return KVPool(kv_cache_memory, f"kv_cache_memory={fmt_bytes(kv_cache_memory)} per rank")
    if cuda:
        return _cuda_pool(memory, weight_bytes // world_size, headroom, gpu_memory_utilization)
    if memory.available is None:
        return KVPool(KV_FALLBACK, f"available RAM unknown ({memory.source}): the fixed {fmt_bytes(KV_FALLBACK)} "
                                   "per rank")
    avail = memory.available
    if gpu_memory_utilization is not None:
        total = int(avail * gpu_memory_utilization) - weight_bytes
        if total <= 0:
            raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization:g} gives "
                             f"{fmt_bytes(avail * gpu_memory_utilization)} of the {fmt_bytes(avail)} of RAM available, "
                             f"not more than the weights' {fmt_bytes(weight_bytes)}: raise gpu_memory_utilization "
                             "or set kv_cache_memory")
        why = (f"gpu_memory_utilization={gpu_memory_utilization:g} of {fmt_bytes(avail)} available RAM "
               f"({memory.source}) minus {fmt_bytes(weight_bytes)} of weights")
        if need_bytes < total:  # RAM is shared with everything else on the host: take no more than can be used
            total, why = need_bytes, why + ", capped at what max_num_seqs x max_model_len tokens can use"
        return KVPool(total // world_size, why)
    room = max(avail - weight_bytes, 0)
    share = int(room * KV_AUTO_SHARE)
    total = min(max(share, KV_AUTO_FLOOR), KV_AUTO_CAP)
    rule = ("the floor" if share < KV_AUTO_FLOOR else "the cap" if share > KV_AUTO_CAP
            else f"{KV_AUTO_SHARE:.0%} of it")
    if need_bytes < total:
        total, rule = need_bytes, "what max_num_seqs x max_model_len tokens can use"
    why = (f"{fmt_bytes(avail)} RAM available ({memory.source}), {fmt_bytes(room)} after "
           f"{fmt_bytes(weight_bytes)} of weights; took {rule} "
           f"({KV_AUTO_SHARE:.0%}, floor {fmt_bytes(KV_AUTO_FLOOR)}, cap {fmt_bytes(KV_AUTO_CAP)})")
    if room < KV_AUTO_FLOOR:
        why += "; less RAM is free than the floor: memory may run short"
    return KVPool(total // world_size, why)


def _cuda_pool(memory: MemoryFacts, rank_weights: int, headroom: int, utilization: float | None) -> KVPool:
    util = CUDA_DEFAULT_GPU_MEMORY_UTILIZATION if utilization is None else utilization
    if memory.total is None:
        raise ValueError("gpu_memory_utilization: the CUDA device's memory could not be read; set kv_cache_memory")
    kv = int(memory.total * util) - rank_weights - headroom
    if kv <= 0:
        raise ValueError(f"gpu_memory_utilization={util:g} gives {fmt_bytes(memory.total * util)} of the device's "
                         f"{fmt_bytes(memory.total)}, not more than the weights' {fmt_bytes(rank_weights)} per rank "
                         f"and {fmt_bytes(headroom)} for activations: raise gpu_memory_utilization or set "
                         "kv_cache_memory")
    return KVPool(kv, f"gpu_memory_utilization={util:g} of the device's {fmt_bytes(memory.total)} "
                      f"({memory.source}) minus {fmt_bytes(rank_weights)} of weights per rank and "
                      f"{fmt_bytes(headroom)} for activations")


def activation_headroom(hf_config: Any, tokens: int, max_num_seqs: int) -> int:
    """An upper estimate of a CUDA step's transient memory: per token float32 q/k/v/o, residual and
    norms (8 x hidden) and the MLP's gate, up and product (3 x intermediate); logits and their
    softmax for up to max_num_seqs sampled rows; plus CUDA_RESERVED."""
    hidden = int(hf_config.hidden_size)
    inter = int(getattr(hf_config, "intermediate_size", None) or 4 * hidden)
    per_token = 4 * (8 * hidden + 3 * inter)
    logits = 2 * 4 * min(tokens, max_num_seqs) * int(hf_config.vocab_size)
    return CUDA_RESERVED + tokens * per_token + logits


# ---- reading the machine ---------------------------------------------------------------------

def meminfo_available(text: str) -> int | None:
    """MemAvailable of /proc/meminfo, in bytes."""
    m = re.search(r"^MemAvailable:\s+(\d+)\s*kB", text, re.MULTILINE)
    return int(m.group(1)) * 1024 if m else None


def cgroup_room(limit: str | None, usage: str | None, stat: str | None = None) -> int | None:
    """Bytes a cgroup may still take: limit - (usage - inactive file cache, which the kernel
    reclaims before it kills). None without a limit ('max', or v1's near-2^63 'unlimited')."""
    if not limit or not usage or limit.strip() == "max":
        return None
    try:
        lim, used = int(limit), int(usage)
    except ValueError:
        return None
    if lim >= 1 << 60:
        return None
    m = re.search(r"^(?:total_)?inactive_file\s+(\d+)", stat or "", re.MULTILINE)
    reclaimable = int(m.group(1)) if m else 0
    return max(lim - max(used - reclaimable, 0), 0)


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def host_memory(root: Path = Path("/")) -> MemoryFacts:
    """RAM this process may still take: MemAvailable, or its cgroup's room if that is less (a
    container sees the host's meminfo)."""
    found: list[tuple[int, str]] = []
    meminfo = _read(root / "proc/meminfo")
    if meminfo is not None and (avail := meminfo_available(meminfo)) is not None:
        found.append((avail, "MemAvailable"))
    cg = root / "sys/fs/cgroup"
    for limit, usage, stat, name in (("memory.max", "memory.current", "memory.stat", "cgroup memory.max"),
                                     ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes",
                                      "memory/memory.stat", "cgroup v1 limit")):
        room = cgroup_room(_read(cg / limit), _read(cg / usage), _read(cg / stat))
        if room is not None:
            found.append((room, name))
            break
    if not found:
        return MemoryFacts(source="neither /proc/meminfo nor a cgroup limit readable")
    avail, source = min(found)
    return MemoryFacts(available=avail, source=source)


def cuda_memory(device: str) -> MemoryFacts:
    """Total memory of the CUDA device the engine runs on (every rank is taken to have the same)."""
    dev = torch.device(device)
    return MemoryFacts(total=torch.cuda.get_device_properties(dev.index or 0).total_memory,
                       source=f"cuda:{dev.index or 0}")


_SAFETENSORS_FLOATS = {"F64", "F32", "F16", "BF16"}


def checkpoint_weight_bytes(path: Path, gguf_reader: Any, dtype: torch.dtype, quantization: str | None) -> int:
    """Resident bytes of the weights, estimated from the checkpoint before loading it (the KV pool is
    allocated when the ranks start, so its size must be known first): float tensors take dtype's
    size; GGUF blocks kvserve keeps compressed take their bytes plus the repacking overhead."""
    item = torch.empty((), dtype=dtype).element_size()
    if gguf_reader is not None:
        from kvserve.quant.gguf import REPACKABLE

        keep = quantization != "none"
        return sum(int(int(t.n_bytes) * GGUF_REPACK_OVERHEAD) if keep and int(t.tensor_type) in REPACKABLE
                   else int(t.n_elements) * item for t in gguf_reader.tensors)
    from kvserve.models.loader import _safetensors_files

    total = 0
    for f in _safetensors_files(path):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            # Packed integer or fp8 weights stay as they are; float ones are cast to dtype.
            total += math.prod(info["shape"]) * item if info["dtype"] in _SAFETENSORS_FLOATS else end - start
    return total


# ---- the step budget ---------------------------------------------------------------------------

@dataclass(frozen=True)
class StepBudget:
    tokens: int
    reason: str
    seconds_per_token: float | None = None  # the measurement, when there was one


def step_budget(requested: int | None, cuda: bool, seconds_per_token: float | None) -> StepBudget:
    """max_num_batched_tokens: the user's value; on CUDA CUDA_BUDGET; on a CPU the largest power of
    two of tokens whose prefill takes at most STEP_GOAL_S at the measured seconds per token, within
    [BUDGET_FLOOR, BUDGET_CAP]."""
    if requested is not None:
        return StepBudget(requested, "max_num_batched_tokens as given")
    if cuda:
        return StepBudget(CUDA_BUDGET, "the fixed default on CUDA")
    if seconds_per_token is None or not math.isfinite(seconds_per_token) or seconds_per_token <= 0:
        return StepBudget(CPU_UNMEASURED_BUDGET, "no prefill could be timed: the fixed CPU default")
    fits = STEP_GOAL_S / seconds_per_token
    pow2 = 1 << int(math.log2(fits)) if fits >= 1 else 0
    tokens = min(max(pow2, BUDGET_FLOOR), BUDGET_CAP)
    return StepBudget(tokens, f"a prefill took {seconds_per_token * 1e3:.2f} ms/token, so {fits:.0f} tokens fit the "
                              f"{STEP_GOAL_S:g} s goal of a mixed step; power of two below, within "
                              f"[{BUDGET_FLOOR}, {BUDGET_CAP}]", seconds_per_token)


def time_prefill(executor: Any, num_tokens: int, vocab_size: int, block_size: int, reps: int = 2) -> float:
    """Seconds per token of a num_tokens prefill through the real step path, on every rank: a
    throwaway greedy request on the pool's first blocks (free at start; whatever it writes there is
    overwritten before it is read). One short warm-up first (kernel builds, first allocations),
    then the best of `reps`: other processes only ever slow a run down, so the fastest is the
    machine's. A second run is skipped when even twice the speed would give the floor."""
    ids = [(7 + 31 * i) % vocab_size for i in range(num_tokens)]
    blocks = list(range(-(-num_tokens // block_size)))
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def run(n: int, rid: str) -> float:
        so = SchedulerOutput(new_reqs=[NewRequestData(rid, ids[:n], [], params, blocks, 0)],
                             num_scheduled_tokens={rid: n})
        start = time.perf_counter()
        executor.execute(so)
        elapsed = time.perf_counter() - start
        executor.execute(SchedulerOutput(finished_req_ids={rid}))  # the runner forgets it
        return elapsed

    run(min(PROBE_WARMUP_TOKENS, num_tokens), "budget-probe-warmup")
    best = run(num_tokens, "budget-probe-0") / num_tokens
    for i in range(1, reps):
        if step_budget(None, False, best / 2).tokens == BUDGET_FLOOR:
            break
        best = min(best, run(num_tokens, f"budget-probe-{i}") / num_tokens)
    return best


# ---- what EngineCore calls -----------------------------------------------------------------------

def engine_kv_pool(config: EngineConfig, hf_config: Any, ckpt: Any, dtype: torch.dtype, max_model_len: int,
                   block_bytes: int) -> tuple[KVPool, int | None]:
    """The KV bytes per rank for this engine, and the weights' estimate it assumed (None when
    kv_cache_memory sized the pool). block_bytes: one block on the largest rank."""
    cache, sched, par = config.cache, config.scheduler, config.parallel
    cuda = torch.device(config.device).type == "cuda"
    memory, weights, headroom = MemoryFacts(), None, 0
    if cache.kv_cache_memory is None:
        memory = cuda_memory(config.device) if cuda else host_memory()
        weights = checkpoint_weight_bytes(ckpt.path, ckpt.gguf_reader, dtype, config.model.quantization)
        if cuda:  # the budget on CUDA is fixed, so its activations are known before the ranks start
            tokens = step_budget(sched.max_num_batched_tokens, True, None).tokens
            headroom = activation_headroom(hf_config, tokens, sched.max_num_seqs)
    need = sched.max_num_seqs * -(-max_model_len // cache.block_size) * block_bytes * par.world_size
    pool = kv_pool_bytes(cuda=cuda, memory=memory, weight_bytes=weights or 0, need_bytes=need,
                         world_size=par.world_size, kv_cache_memory=cache.kv_cache_memory,
                         gpu_memory_utilization=cache.gpu_memory_utilization, headroom=headroom)
    return pool, weights


def check_weight_estimate(actual: int, estimate: int | None) -> None:
    if estimate is not None and actual > estimate * WEIGHT_ESTIMATE_SLACK:
        logger.warning("the weights take %s, more than the %s estimated from the checkpoint when the KV cache was "
                       "sized: if memory runs short, lower gpu_memory_utilization or set kv_cache_memory",
                       fmt_bytes(actual), fmt_bytes(estimate))


def engine_step_budget(config: EngineConfig, executor: Any, num_blocks: int, max_model_len: int,
                       vocab_size: int) -> StepBudget:
    """max_num_batched_tokens for this engine: as given, fixed on CUDA, else from a prefill timed
    now that the model is loaded (the probe fits the KV pool and max_model_len)."""
    requested = config.scheduler.max_num_batched_tokens
    cuda = torch.device(config.device).type == "cuda"
    seconds = None
    if requested is None and not cuda:
        block_size = config.cache.block_size
        n = max(1, min(PROBE_TOKENS, max_model_len - 1, num_blocks * block_size))
        seconds = time_prefill(executor, n, vocab_size, block_size)
    return step_budget(requested, cuda, seconds)
