"""What a model needs to know of its place among the ranks: its tensor-parallel group,
its pipeline stage and whether MoE experts are split across the tensor-parallel ranks.

Global rank = pp_rank * tp_size + tp_rank (vLLM's layout): the ranks of one stage are
neighbours, so on one host a stage's all-reduces stay within adjacent cores.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from kvserve.distributed.comm import Group
from kvserve.distributed.shm import ShmCollectives


@dataclass
class Parallel:
    tp: Group = field(default_factory=Group.single)
    pp: Group = field(default_factory=Group.single)
    # MoE experts split across the tp group (expert parallel) instead of each expert's
    # weights split (tensor parallel inside every expert).
    enable_expert_parallel: bool = False

    @property
    def is_single(self) -> bool:
        return self.tp.size == 1 and self.pp.size == 1

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """The decoder layers [start, end) of this pipeline stage: an even split, the first
        stages taking one more when it does not divide."""
        return layer_range(num_layers, self.pp.rank, self.pp.size)


def layer_range(num_layers: int, stage: int, num_stages: int) -> tuple[int, int]:
    if num_stages > num_layers:
        raise ValueError(f"pipeline_parallel_size={num_stages} exceeds the model's {num_layers} layers")
    return split_range(num_layers, stage, num_stages)


def split_range(n: int, rank: int, size: int) -> tuple[int, int]:
    """Rank's [start, end) of n units split as evenly as possible, the first ranks taking one more."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


@dataclass
class IntermediateTensors:
    """What one pipeline stage hands the next: hidden states and the residual stream."""

    hidden: torch.Tensor
    residual: torch.Tensor


def init_distributed(rank: int, tp_size: int, pp_size: int, init_method: str, enable_expert_parallel: bool = False,
                     timeout_s: float = 60.0, use_shm: bool = True) -> Parallel:
    """Join the world of tp_size * pp_size ranks and build this rank's groups.

    gloo on CPU, NCCL when CUDA is available. Tensor-parallel groups whose ranks all run
    on this host all-reduce through shared memory (shm.py); collectives time out after
    timeout_s, so a dead peer surfaces as an error instead of a hang.
    """
    world = tp_size * pp_size
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    hosts = [None] * world
    dist.all_gather_object(hosts, _host_id())
    tp = pp = None
    # Every rank creates every group, in the same order (torch.distributed's rule).
    for stage in range(pp_size):
        ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
        group = _new_group(ranks, rank, use_shm and backend == "gloo" and len({hosts[r] for r in ranks}) == 1,
                           timeout_s)
        tp = group if rank in ranks else tp
    for t in range(tp_size):
        ranks = list(range(t, world, tp_size))
        group = _new_group(ranks, rank, False, timeout_s)
        pp = group if rank in ranks else pp
    return Parallel(tp=tp, pp=pp, enable_expert_parallel=enable_expert_parallel)


def _new_group(ranks: list[int], rank: int, shm: bool, timeout_s: float) -> Group:
    pg = dist.new_group(ranks, timeout=timedelta(seconds=timeout_s)) if len(ranks) > 1 else None
    if rank not in ranks:
        return Group(ranks, rank, pg)
    segment = None
    if shm and len(ranks) > 1:
        path = [ShmCollectives.create_file(len(ranks)) if rank == ranks[0] else None]
        dist.broadcast_object_list(path, src=ranks[0], group=pg)
        segment = ShmCollectives(path[0], ranks.index(rank), len(ranks), timeout_s)
        dist.barrier(group=pg)
        if rank == ranks[0]:
            segment.unlink()  # every rank has it mapped; the memory goes with the last of them
    return Group(ranks, rank, pg, segment)


def _host_id() -> str:
    """Ranks with the same id share /dev/shm."""
    boot = ""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        pass
    return f"{socket.gethostname()}|{boot}"


def check_parallel(hf_config, cfg) -> None:
    """Refuse, naming the flag, a tensor / pipeline / expert-parallel size the model cannot be split by
    (before any rank starts). cfg: a ParallelConfig."""
    tp, pp = cfg.tensor_parallel_size, cfg.pipeline_parallel_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    # Attention splits by whole key/value heads (each with its query heads), unevenly if it must:
    # SmolLM2-135M's 3 KV heads go 2 + 1 over two ranks.
    if kv_heads < tp:
        raise ValueError(f"tensor_parallel_size={tp} exceeds the model's {kv_heads} key/value heads "
                         "(num_key_value_heads): every rank needs at least one")
    for name, n in (("intermediate_size", getattr(hf_config, "intermediate_size", None)),
                    ("moe_intermediate_size", None if cfg.enable_expert_parallel
                     else getattr(hf_config, "moe_intermediate_size", None))):
        if n is not None and n % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {name} ({n})")
    experts = getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", None)
    if cfg.enable_expert_parallel:
        if not experts:
            raise ValueError("enable_expert_parallel needs a mixture-of-experts model; this one has no experts")
        if experts % tp:
            raise ValueError(f"enable_expert_parallel splits the {experts} experts over tensor_parallel_size={tp} "
                             "ranks, which does not divide them")
    layers = hf_config.num_hidden_layers
    if layers % pp:
        raise ValueError(f"pipeline_parallel_size={pp} does not divide the model's {layers} layers")
