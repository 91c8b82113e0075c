"""One rank: its cores, its process groups, its shard of the model, its KV cache and runner.

Executors (distributed/executor.py) create one Worker per rank, in the engine's process
(uni), in a process of its own (mp) or in a Ray actor (ray), and call its methods by
name (`collective_rpc`): every rank runs every call, in the same order.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from kvserve.attention import set_attention_backend
from kvserve.config import EngineConfig
from kvserve.core.sched_output import SchedulerOutput
from kvserve.distributed.parallel import Parallel, init_distributed
from kvserve.models.loader import load_model
from kvserve.quant import quantize_lm_head
from kvserve.kernels import tuning
from kvserve.spec_decode.draft_model import ModelDrafter
from kvserve.worker.kv_connectors import build_worker_roles
from kvserve.worker.decode_stack import DecodeStack
from kvserve.worker.model_runner import ModelRunner, ModelRunnerOutput, set_kv_scales

logger = logging.getLogger(__name__)


def bind_threads(cores: tuple[int, ...] | None, threads: int | None = None) -> None:
    """Pin this process to `cores` (vLLM's VLLM_CPU_OMP_THREADS_BIND: two ranks on one host must
    not fight over the same cores) and run `threads` intra-op threads, by default one per pinned
    core. With neither, torch's own count stands: the cores this process may use, or
    OMP_NUM_THREADS (Ray sets it to the actor's CPUs)."""
    if cores is not None:
        os.sched_setaffinity(0, set(cores))
    n = threads or (len(cores) if cores else None)
    if n is None:
        return
    if cores and n > len(cores):  # OpenMP threads spin while they wait: more than cores stall each other
        logger.warning("%d intra-op threads on %d pinned cores (%s): threads will wait for cores", n, len(cores),
                       ",".join(map(str, cores)))
    torch.set_num_threads(n)


class Worker:
    def __init__(self, config: EngineConfig, num_blocks: int, kv_calibration_ids: list[int] | None,
                 eos_token_id: int | None, init_method: str | None = None) -> None:
        par = config.parallel
        cores = par.cpu_cores
        bind_threads(cores[par.rank] if cores else None, par.cpu_threads)
        torch.manual_seed(config.model.seed)
        if par.world_size > 1:
            parallel = init_distributed(par.rank, par.tensor_parallel_size, par.pipeline_parallel_size, init_method,
                                        par.enable_expert_parallel)
        else:
            parallel = Parallel()
        self.rank = par.rank
        m = config.model
        self.loaded = load_model(m.model, m.dtype, config.device, m.quantization, parallel)
        tuning.tune_linears(self.loaded.model, self.loaded.dtype)
        tuning.tune_kquant_linears(self.loaded.model, self.loaded.dtype)
        self.runner = ModelRunner(self.loaded.model, self.loaded.hf_config, self.loaded.dtype, num_blocks,
                                  config.cache.block_size, config.device, config.cache.kv_cache_dtype,
                                  kv_calibration_ids, parallel, m.attention_backend)
        self.runner.eos_token_id = eos_token_id
        if config.speculative.uses_draft_model:
            self.runner.drafter = self._drafter(config, parallel)
        self.runner.connector_roles = build_worker_roles(config, self.runner)
        if (self.runner.device.type == "cuda" and self.runner.attention_backend.name == "triton"
                and parallel.is_single and not m.enforce_eager):
            if m.max_model_len is None:
                raise ValueError("CUDA graphs size their block tables by max_model_len: the engine resolves it "
                                 "before it starts the ranks (EngineCore)")
            self.runner.enable_cuda_graphs(config.scheduler.max_num_seqs, m.max_model_len)

    def _drafter(self, config: EngineConfig, parallel: Parallel) -> ModelDrafter:
        """The draft model of speculative decoding (spec_decode/draft_model.py): a smaller model
        with its own KV tensors under the target's block ids (draft_model), or the target's weights
        quantized at load sharing the target's KV cache (self_quantized)."""
        spec, m, runner = config.speculative, config.model, self.runner  # checked by the engine (EngineCore)
        if spec.method == "draft_model":
            path, quantization, field = spec.model, spec.quantization, "speculative_config.model"
        else:
            path, quantization, field = m.model, spec.quantization, "speculative_config.quantization"
        try:
            draft = load_model(path, m.dtype, config.device, quantization, parallel)
        except (ValueError, OSError) as e:
            raise ValueError(f"{field}: {e}") from e
        if quantization in ("int4", "int8"):  # rounded at load: the LM head too, or it costs the draft most
            quantize_lm_head(draft.model, quantization, draft.dtype, config.device)
        tuning.tune_linears(draft.model, draft.dtype)
        tuning.tune_kquant_linears(draft.model, draft.dtype)
        set_attention_backend(draft.model, runner.attention_backend)
        shares_kv = spec.method == "self_quantized"
        if shares_kv:
            caches = runner.kv_caches
            if runner.kv_scales is not None:  # fp8 KV: the target's calibrated scales
                set_kv_scales(draft.model, runner.kv_scales)
        else:
            caches = runner.new_kv_caches(draft.hf_config, draft.dtype)
        stack = DecodeStack.build(draft.model, draft.dtype, runner.attention_backend.name, runner.device)
        logger.info("speculative decoding: %s drafts (%s, %s)", spec.method, draft.model_path, draft.quantization)
        return ModelDrafter(draft.model, caches, stack, shares_kv)

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput | None:
        """The step's output on the output rank (last stage, first tensor-parallel rank); None elsewhere."""
        out = self.runner.execute(so)
        return out if self.runner.is_output_rank else None

    def prompt_logits(self, token_ids: list[int]) -> torch.Tensor | None:
        """Float32 logits [T, vocab] of token_ids as one prefill in scratch KV (eval's scoring);
        None on ranks other than the output rank."""
        hidden = self.runner.prefill_scratch(token_ids)
        if hidden is None:
            return None
        logits = self.runner.model.compute_logits(hidden).float()
        return logits if self.runner.is_output_rank else None

    def model_info(self) -> dict[str, object]:
        return {"quantization": self.loaded.quantization, "weight_bytes": self.loaded.weight_bytes,
                "pid": os.getpid(), "threads": torch.get_num_threads()}

    def comm_stats(self, reset: bool = False) -> dict[str, float]:
        """Seconds and calls in this rank's collectives (tensor-parallel group, pipeline hand-offs)."""
        groups = {"tp": self.runner.parallel.tp, "pp": self.runner.parallel.pp}
        out = {f"{k}_{f}": getattr(g, f) for k, g in groups.items() for f in ("seconds", "calls")}
        if reset:
            for g in groups.values():
                g.seconds, g.calls = 0.0, 0
        return out

    # ---- KV blocks of this rank's layers and heads (the KV tiers) ---------------------------

    def call_kv_connector(self, name: str, method: str, *args: Any) -> Any:
        """A method of the connector `name`'s worker role in this rank (configure, and what a
        connector manages through the engine's collective_rpc: flush, persist, clear)."""
        return getattr(self.runner.connector_roles[name], method)(*args)

    def kv_connector_stats(self) -> dict[str, float | int]:
        out: dict[str, float | int] = {}
        for role in self.runner.connector_roles.values():
            out.update(role.stats())
        return out

    def close_kv_connectors(self) -> None:
        for role in self.runner.connector_roles.values():
            role.close()

    def kv_block_shape(self) -> tuple[int, ...]:
        return self.runner.kv_block_shape

    def kv_scales(self) -> torch.Tensor | None:
        return self.runner.kv_scales

