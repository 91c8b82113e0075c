"""EngineCore: validates requests and runs the step loop.

    scheduler.schedule() -> executor.execute() (every rank) -> scheduler.update() -> outputs
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import itertools
import logging
import time
from collections import deque
from concurrent.futures import Future

import torch

from kvserve import threads
from kvserve.config import CacheConfig, EngineConfig, KVEventsConfig
from kvserve.core.kv_events import KVEventPublisher, KVEventSink
from kvserve.core.kv_manager import KVCacheManager
from kvserve.core.sched_output import SchedulerOutput
from kvserve.core.scheduler import Scheduler
from kvserve.distributed.executor import Executor, WorkerError
from kvserve.distributed.parallel import check_parallel
from kvserve.engine import connectors, defaults
from kvserve.engine.output_processor import OutputProcessor
from kvserve.models.generation_config import generation_defaults
from kvserve.models.loader import Checkpoint, open_checkpoint, resolve_dtype, runs_float32_kernels
from kvserve.outputs import RequestOutput
from kvserve.pooling_params import pooling_params, with_default_pooling
from kvserve.request import Request, RequestStatus
from kvserve.sampling_params import PREDICTION, SamplingParams
from kvserve.spec_decode.proposer import SpecDecodeProposer, check_prediction
from kvserve.structured import StructuredOutputManager
from kvserve.worker.kv_blocks import whole_block_shape
from kvserve.worker.model_runner import ModelRunnerOutput, kv_bytes_per_block, kv_dtype_of, resolve_kv_cache_dtype

logger = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 8192
# The fixed prompt whose K/V set the fp8 KV cache scales (kv_cache_dtype='fp8'): prose, a list,
# code and numbers in a chat turn, like what is served; fixed, so every start of a model (and
# every replica sharing KV tiers) calibrates the same scales.
KV_CALIBRATION_TEXT = (
    "Summarize the following notes for a colleague, then answer the question at the end.\n"
    "1. The quarterly report is due on March 31; figures for Q1 2024 grew 12.5% over Q4 2023.\n"
    "2. def mean(xs: list[float]) -> float:\n       return sum(xs) / len(xs) if xs else 0.0\n"
    "3. Paris, Tokyo and Nairobi host the next three meetings (09:30 UTC, room B-214).\n"
    "Question: why does a paged KV cache waste less memory than one contiguous buffer per request? "
    "Explain it step by step, with an example of 3 requests of 17, 250 and 1,024 tokens."
)
KV_CALIBRATION_MAX_TOKENS = 256


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        model_config, cache_config, device = config.model, config.cache, config.device
        torch.manual_seed(model_config.seed)
        ckpt = open_checkpoint(model_config.model)  # config and tokenizer; the ranks load the weights
        check_parallel(ckpt.config, config.parallel)
        self.config = config
        self.model_config = model_config
        self.hf_config = ckpt.config
        self.tokenizer = ckpt.tokenizer()
        float32_kernels = runs_float32_kernels(ckpt, model_config.quantization)
        self.dtype = resolve_dtype(model_config.dtype, device, ckpt.config, float32_kernels)
        # kv_cache_dtype 'auto' decided once; the ranks get it so (like dtype below)
        self.cache_config = cache_config = dataclasses.replace(cache_config, kv_cache_dtype=resolve_kv_cache_dtype(
            cache_config.kv_cache_dtype, self.dtype, float32_kernels, device))
        self.model_path = str(ckpt.path.resolve())
        self.max_model_len = self._max_model_len(model_config.max_model_len)
        self.vocab_size = self.hf_config.vocab_size
        self.kv_dtype = kv_dtype_of(cache_config.kv_cache_dtype, self.dtype)
        # The KV pool is allocated as the ranks start, so it is sized before they load the weights,
        # from the checkpoint's estimate of them (checked against the loaded size below).
        self.weight_estimate: int | None = None
        self.draft_hf_config = self._check_speculative(config, ckpt)
        num_blocks = self._num_blocks(cache_config, ckpt)
        calibration = self._kv_calibration_ids() if cache_config.kv_cache_dtype == "fp8" else None
        self.eos_token_id = self._eos_token_id()
        # SamplingParams values for what a request leaves out (LLM, and the server via ModelInfo)
        self.generation_defaults = generation_defaults(ckpt.path, model_config.generation_config, ckpt.gguf_reader)
        # Ranks get the dtype (auto is measured once, not once per rank) and max_model_len resolved here.
        resolved = dataclasses.replace(model_config, dtype=str(self.dtype).removeprefix("torch."),
                                       max_model_len=self.max_model_len)
        self.executor = Executor.create(dataclasses.replace(config, model=resolved, cache=cache_config), num_blocks,
                                        calibration, self.eos_token_id)
        self.thread_policy = threads.policy_for(config)  # None: a fixed count (--cpu-threads, ranks elsewhere)
        info = self.executor.collective_rpc("model_info")
        self.quantization = info[0]["quantization"]
        self.weight_bytes = sum(i["weight_bytes"] for i in info)  # every rank's shard
        logger.info("model %s: %s weights, quantization %s, %.1f MB resident on %d rank(s)", self.model_path,
                    str(self.dtype).removeprefix("torch."), self.quantization, self.weight_bytes / 1e6, len(info))
        defaults.check_weight_estimate(self.weight_bytes, self.weight_estimate)
        # The scheduler runs on a resolved copy: the limits that depend on the model and the machine
        # filled in. The ranks never read max_num_batched_tokens, so it may be decided this late.
        self.step_budget = self._step_budget(num_blocks)
        self.scheduler_config = dataclasses.replace(
            config.scheduler, max_num_batched_tokens=self.step_budget.tokens, max_model_len=self.max_model_len)
        self.kv = KVCacheManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
                                 cache_config.prefix_cache)
        # The KV connectors' scheduler roles (engine/connectors.py), as one. `tiers` and `transfer`
        # are parts, for what only they do (clearing and saving the tiers, the P/D handshake).
        self.connector_parts = connectors.build_connectors(self)
        self.tiers = self.connector_parts.get("tiers")
        self.transfer = self.connector_parts.get("kv_transfer")
        self.connector = connectors.combined(self.connector_parts)
        if self.tiers is not None:  # evicted blocks go down to the tiers (through every connector)
            self.kv.attach_connector(self.connector)
            atexit.register(self.close)  # queued tier writes and the disk tier's save happen at exit too
        self.kv_events = self._kv_events(config.kv_events) if config.kv_events.enabled else None
        # Structured outputs' matchers, built with the first constrained request (kvserve/structured/).
        self._structured: StructuredOutputManager | None = None
        # Speculative decoding's drafts and counters (kvserve/spec_decode/proposer.py); None: off.
        self.spec = self._spec_proposer(config)
        self.scheduler = Scheduler(self.scheduler_config, self.kv, self.connector, self._grammar_ready,
                                   self._propose if self.spec is not None else None)
        self.errors: dict[str, str] = {}  # requests that failed in the engine (not on input): id -> why
        self.processor = OutputProcessor(self.tokenizer, speculative=self.spec is not None)
        self.check_integrity = config.check_integrity
        self._ids = itertools.count()
        self._in_flight: deque[tuple[SchedulerOutput, Future]] = deque()  # pipeline parallel's batches

    def _propose(self, req: Request, num_decodes: int) -> list[int]:
        """The scheduler's drafts for a request (kvserve/spec_decode/proposer.py); a constrained
        request's are cut where its grammar would refuse them."""
        drafts = self.spec.propose(req, num_decodes)
        if drafts and req.sampling_params.structured_outputs is not None:
            drafts = self.structured.fit_drafts(req.request_id, drafts)
        return drafts

    def _spec_proposer(self, config: EngineConfig) -> SpecDecodeProposer | None:
        if not config.speculative.enabled:
            return None
        return SpecDecodeProposer(config.speculative, self.max_model_len)

    def _check_speculative(self, config: EngineConfig, ckpt: Checkpoint):
        """What the speculative config asks of the deployment, checked before the ranks start (they
        load a draft model as told). Returns a draft_model's config (its own KV tensors take a share
        of each block's memory); None for other methods."""
        spec = config.speculative
        if not spec.enabled:
            return None
        if config.parallel.pipeline_parallel_size > 1:
            raise ValueError("speculative_config: speculative decoding with pipeline_parallel_size > 1 is not "
                             "supported yet")
        if spec.uses_draft_model and config.parallel.tensor_parallel_size > 1:
            raise ValueError(f"speculative_config.method {spec.method}: a draft model runs on one rank; "
                             "tensor_parallel_size > 1 is not supported with it yet")
        if spec.method == "self_quantized" and spec.quantization == "gguf" and (
                ckpt.gguf_reader is None or config.model.quantization in (None, "gguf")):
            raise ValueError("speculative_config.quantization gguf: the draft is a GGUF file's own blocks drafting "
                             "for the same file loaded dequantized; give a GGUF model with --quantization none")
        if spec.method != "draft_model":
            return None
        try:
            draft = open_checkpoint(spec.model).config
        except (ValueError, OSError) as e:
            raise ValueError(f"speculative_config.model: {e}") from e
        if draft.vocab_size != self.hf_config.vocab_size:
            raise ValueError(f"speculative_config.model: the draft's vocabulary has {draft.vocab_size} tokens, the "
                             f"target's {self.hf_config.vocab_size}; a draft model must share the target's tokenizer")
        draft_len = getattr(draft, "max_position_embeddings", None)
        if draft_len is not None and draft_len < self.max_model_len:
            raise ValueError(f"speculative_config.model: the draft runs up to {draft_len} positions, the target up to "
                             f"max_model_len {self.max_model_len}; lower max_model_len to {draft_len}")
        return draft

    def _max_model_len(self, requested: int | None) -> int:
        limit = getattr(self.hf_config, "max_position_embeddings", None) or DEFAULT_MAX_MODEL_LEN
        if requested is None:
            return min(limit, DEFAULT_MAX_MODEL_LEN)
        if requested > limit:
            raise ValueError(f"max_model_len ({requested}) exceeds the model's max_position_embeddings ({limit})")
        return requested

    def _num_blocks(self, cache: CacheConfig, ckpt: Checkpoint) -> int:
        if cache.num_kv_blocks is not None:
            self.kv_sizing = "num_kv_blocks as given"
            return cache.num_kv_blocks
        par = self.config.parallel
        layers = -(-self.hf_config.num_hidden_layers // par.pipeline_parallel_size)  # the largest stage
        block = kv_bytes_per_block(self.hf_config, cache.block_size, self.kv_dtype, par.tensor_parallel_size, layers)
        if self.draft_hf_config is not None:  # a draft model's own K/V under the same block ids
            block += kv_bytes_per_block(self.draft_hf_config, cache.block_size, self.dtype)
        pool, self.weight_estimate = defaults.engine_kv_pool(self.config, self.hf_config, ckpt, self.dtype,
                                                             self.max_model_len, block)
        n = pool.bytes // block
        if n < 1:
            field = "gpu_memory_utilization" if cache.gpu_memory_utilization is not None else "kv_cache_memory"
            raise ValueError(f"{field}: {pool.bytes} bytes per rank ({pool.reason}) is too small to hold one KV "
                             f"block of {block} bytes")
        self.kv_sizing = pool.reason
        logger.info("KV cache: %d blocks (%d tokens, %s per rank): %s", n, n * cache.block_size,
                    defaults.fmt_bytes(n * block), pool.reason)
        return int(n)

    def _step_budget(self, num_blocks: int) -> defaults.StepBudget:
        budget = defaults.engine_step_budget(self.config, self.executor, num_blocks, self.max_model_len,
                                             self.vocab_size)
        logger.info("step budget: max_num_batched_tokens=%d: %s", budget.tokens, budget.reason)
        return budget

    def _kv_calibration_ids(self) -> list[int]:
        """KV_CALIBRATION_TEXT as a user turn of the chat template (plain text without one)."""
        tok = self.tokenizer
        message = [{"role": "user", "content": KV_CALIBRATION_TEXT}]
        if getattr(tok, "chat_template", None):
            out = tok.apply_chat_template(message, add_generation_prompt=True, tokenize=True)
            ids = list(out["input_ids"] if hasattr(out, "keys") else out)  # transformers 5: a BatchEncoding
        else:
            ids = list(tok(KV_CALIBRATION_TEXT)["input_ids"])
        return [t for t in ids if 0 <= t < self.vocab_size][:min(KV_CALIBRATION_MAX_TOKENS, self.max_model_len)]

    @functools.cached_property
    def model_fingerprint(self) -> bytes:
        """What a KV block depends on besides its tokens (kv_tiers.manager.model_fingerprint)."""
        from kvserve.kv_tiers.manager import model_fingerprint

        weights = f"{self.dtype}|{self.quantization}"  # the same file loaded another way computes other K/V
        return model_fingerprint(self.model_path, weights, self.kv_dtype, self.kv_block_shape, self._kv_scales())

    @functools.cached_property
    def kv_block_shape(self) -> tuple[int, ...]:
        """[layers, 2, block_size, kv_heads, head_dim] of one whole block (every rank's piece)."""
        par = self.config.parallel
        return whole_block_shape(self.executor.collective_rpc("kv_block_shape"), par.tensor_parallel_size,
                                 par.pipeline_parallel_size)

    def _kv_scales(self) -> torch.Tensor | None:
        """fp8 KV scales [layers, 2] of the whole model (None without an fp8 cache)."""
        scales = self.executor.collective_rpc("kv_scales")
        if scales[0] is None:
            return None
        tp, pp = self.config.parallel.tensor_parallel_size, self.config.parallel.pipeline_parallel_size
        return torch.cat([scales[s * tp] for s in range(pp)])

    def _kv_events(self, cfg: KVEventsConfig) -> KVEventPublisher:
        """Publish the blocks of the prefix cache and of every tier for routers."""
        sink = KVEventSink()
        self.kv.attach_events(sink)
        if self.tiers is not None:
            self.tiers.events = sink
        return KVEventPublisher(sink, cfg.endpoint, cfg.replay, self.model_fingerprint.hex(), self.kv.block_size)

    def _eos_token_id(self) -> int | None:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is None:
            eos = getattr(self.hf_config, "eos_token_id", None)
            eos = eos[0] if isinstance(eos, (list, tuple)) and eos else eos
        return eos

    # ---- requests ---------------------------------------------------------

    def new_request_id(self) -> str:
        return str(next(self._ids))

    def add_request(self, request_id: str | None, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, arrival_time: float | None = None, priority: int = 0,
                    cache_salt: str | None = None) -> str:
        """Validate and enqueue; raises ValueError naming the bad field and changes nothing."""
        request_id = request_id if request_id is not None else self.new_request_id()
        if request_id in self.processor.parents:
            raise ValueError(f"request_id {request_id!r} is already in use")
        params = with_default_pooling(params, self.config.model.pooling)
        max_tokens = self.validate(prompt_token_ids, params, priority, cache_salt)
        arrival = arrival_time if arrival_time is not None else time.time()
        children = []
        for i in range(params.n):
            p = params
            if params.n > 1:  # each sample is a child request; seeds differ so samples differ
                seed = None if params.seed is None else params.seed + i
                p = dataclasses.replace(params, n=1, seed=seed,
                                        prompt_logprobs=params.prompt_logprobs if i == 0 else None)
            cid = request_id if params.n == 1 else f"{request_id}#{i}"
            child = Request(cid, prompt_token_ids, p, self.eos_token_id, arrival, priority, cache_salt, max_tokens)
            if self.connector is not None:
                child.extra_salt = self.connector.block_salt(child)
            if i > 0:
                child.leader_id = children[0].request_id
            children.append(child)
        self.processor.add(request_id, prompt, list(prompt_token_ids), params, children)
        for child in children:
            if params.structured_outputs is not None:  # a matcher per sequence, once its grammar compiled
                self.structured.add(child.request_id, params.structured_outputs, prompt_token_ids)
            self.scheduler.add_request(child)
        return request_id

    @property
    def max_logprobs(self) -> int:
        """The most logprobs a request may ask for (--max-logprobs; -1 there is the vocabulary)."""
        k = self.config.model.max_logprobs
        return self.vocab_size if k < 0 else k

    def validate(self, ids: list[int], params: SamplingParams, priority: int = 0,
                 cache_salt: str | None = None) -> int:
        """Raise ValueError naming the field if the request can never run; returns its max_tokens."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError("prompt_token_ids must be a list of integers")
        if not ids:
            raise ValueError("prompt must not be empty")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids contains {bad}, outside the vocabulary [0, {self.vocab_size})")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise ValueError("cache_salt must be a string")
        if pooling_params(params) is not None:
            return self._validate_pooling(len(ids), params)
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > self.max_logprobs:
                raise ValueError(f"{name} must be at most {self.max_logprobs} (the engine's max_logprobs), got {k}")
        n_prompt = len(ids)
        if params.structured_outputs is not None:
            self.structured.check(params.structured_outputs)  # parses; the compile runs off the step
        connectors.check_request_keys(params, self.connector_parts)
        if self.connector is not None:
            self.connector.validate_request(params, n_prompt)
        check_prediction((params.extra_args or {}).get(PREDICTION), self.vocab_size)
        if n_prompt >= self.max_model_len:
            raise ValueError(f"prompt is {n_prompt} tokens, which leaves no room to generate within "
                             f"max_model_len={self.max_model_len}")
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - n_prompt
        if n_prompt + max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({n_prompt} tokens) + max_tokens ({max_tokens}) exceeds "
                             f"max_model_len={self.max_model_len}")
        need = -(-(n_prompt + max_tokens) // self.kv.block_size)
        if need > self.kv.num_blocks:
            raise ValueError(f"prompt + max_tokens need {need} KV blocks but the KV cache has only "
                             f"{self.kv.num_blocks}; raise kv_cache_memory or lower max_tokens")
        return max_tokens

    def _validate_pooling(self, n_prompt: int, params: SamplingParams) -> int:
        """An embedding request runs its prompt once and stops: one sequence, nothing sampled, no
        room to generate needed; returns its max_tokens (0)."""
        if params.n != 1:
            raise ValueError(f"n must be 1 for an embedding request, got {params.n}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(params, name) is not None:
                raise ValueError(f"{name} is not supported for an embedding request")
        other = sorted(set(params.extra_args or {}) - {"pooling"})
        if other:
            raise ValueError(f"{other[0]} is not supported for an embedding request")
        if params.structured_outputs is not None:
            raise ValueError("structured_outputs is not supported for an embedding request")
        if n_prompt > self.max_model_len:
            raise ValueError(f"prompt is {n_prompt} tokens, more than max_model_len={self.max_model_len}")
        need = -(-n_prompt // self.kv.block_size)
        if need > self.kv.num_blocks:
            raise ValueError(f"the prompt needs {need} KV blocks but the KV cache has only {self.kv.num_blocks}")
        return 0

    def abort_request(self, request_id: str) -> None:
        self.scheduler.finish_requests(self.processor.child_ids(request_id), RequestStatus.FINISHED_ABORTED)
        self.processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        """Requests to serve, or a connector that waits for news from the ranks (the KV tiers'
        queued writes, whose events come back with a step)."""
        return self.scheduler.has_unfinished_requests() or self._connector_busy()

    def _connector_busy(self) -> bool:
        return self.connector is not None and self.connector.needs_step({})

    # ---- the step loop ----------------------------------------------------

    def step(self) -> list[RequestOutput]:
        if self.executor.max_concurrent_batches > 1:
            return self._step_pipelined()
        so = self._schedule()
        if not (so.num_scheduled_tokens or so.finished_req_ids or self._connector_work(so)):
            return self._finish_step(so, ModelRunnerOutput())
        start = time.perf_counter()
        ro = self.executor.execute(so)
        if self.spec is not None and len(so.num_scheduled_tokens) == 1:
            self.spec.observe_step(so.total_num_scheduled_tokens, bool(so.draft_token_ids), time.perf_counter() - start)
        if self.thread_policy is not None:  # fewer threads while the cores are shared (kvserve/threads.py)
            n = self.thread_policy.observe(time.perf_counter() - start, so.total_num_scheduled_tokens)
            if n is not None:
                threads.set_threads(n)
        return self._finish_step(so, ro)

    def _step_pipelined(self) -> list[RequestOutput]:
        """Pipeline parallel: keep one batch in flight per stage. A new batch is scheduled while
        earlier ones run (their requests wait for their tokens and are not scheduled again), and
        the oldest is finished once the queue is full or nothing new could be scheduled."""
        if len(self._in_flight) < self.executor.max_concurrent_batches:
            so = self._schedule()
            if so.num_scheduled_tokens or so.finished_req_ids or self._connector_work(so):
                self._in_flight.append((so, self.executor.execute_async(so)))
                if len(self._in_flight) < self.executor.max_concurrent_batches and so.num_scheduled_tokens:
                    return []
        if not self._in_flight:
            return []
        so, future = self._in_flight.popleft()
        return self._finish_step(so, future.result())

    def _connector_work(self, so: SchedulerOutput) -> bool:
        """A connector's worker role has work in this step, or news to report, with no token scheduled."""
        return self.connector is not None and self.connector.needs_step(so.kv_connector_meta)

    def _schedule(self) -> SchedulerOutput:
        if self._structured is not None:
            self._fail(self._structured.poll())  # grammars that failed to compile
        so = self.scheduler.schedule()
        self._fail(self.scheduler.take_failed())  # the connector could not load their KV
        if self._structured is not None:
            self._grammar_step(so)
        if self.connector is not None:
            if not so.num_scheduled_tokens and (self.scheduler.num_loading or self.scheduler.held
                                                or self._connector_busy()):
                self.connector.wait(0.01)  # only requests waiting on their connector: don't spin
        return so

    def _fail(self, failed: dict[str, str]) -> None:
        """End requests that failed in the engine (child id -> why): their parent is aborted and
        reports why through take_errors; the rest of the batch goes on."""
        for rid, why in failed.items():
            parent = self.processor.child_to_parent.get(rid, rid)
            if parent in self.processor.parents:
                self.abort_request(parent)
                self.errors[parent] = why

    # ---- structured outputs ------------------------------------------------

    @property
    def structured(self) -> StructuredOutputManager:
        if self._structured is None:
            self._structured = StructuredOutputManager(self.config.structured_outputs_backend, self.tokenizer,
                                                       self.vocab_size, self.eos_token_id)
        return self._structured

    def _grammar_ready(self, request_id: str) -> bool:
        """The scheduler's readiness predicate: a constrained request waits until its grammar compiled."""
        return self._structured is None or self._structured.is_ready(request_id)

    def _grammar_step(self, so: SchedulerOutput) -> None:
        """Forget finished requests' matchers; put the bitmask of the constrained requests that sample
        this step (their scheduled tokens reach the end of what they hold) into the step."""
        st = self._structured
        for rid in so.finished_req_ids:
            st.release(rid)
        reqs = self.scheduler.requests
        sampling = [rid for rid in so.num_scheduled_tokens  # (drafts: past the end by their number)
                    if (r := reqs.get(rid)) is not None and r.num_computed_tokens >= r.num_tokens]
        so.grammar = st.bitmask(sampling, so.draft_token_ids)
        if not so.num_scheduled_tokens and st.pending:
            st.wait(0.01)  # only requests whose grammar compiles: don't spin

    def _accept_grammar(self, updated: list[Request], before: dict[str, int]) -> dict[str, str]:
        """Advance each constrained sequence's matcher by its new tokens (`before`: its output
        length before the step); a sequence whose grammar ended finishes as stopped. Returns those
        whose token the grammar rejected (id -> why)."""
        if self._structured is None:
            return {}
        tokens = {r.request_id: r.output_token_ids[before.get(r.request_id, r.num_output_tokens - 1):]
                  for r in updated if r.output_token_ids}
        terminated, failed = self._structured.accept(tokens)
        self.scheduler.finish_requests(terminated, RequestStatus.FINISHED_STOPPED)
        return failed

    def take_errors(self) -> dict[str, str]:
        """Requests that failed since the last call (request id -> why); they produce no more outputs."""
        out, self.errors = self.errors, {}
        return out

    def _finish_step(self, so: SchedulerOutput, ro: ModelRunnerOutput) -> list[RequestOutput]:
        if self.connector is not None:
            self.connector.update_connector_output(ro.kv_connector_output)
        kept: dict[str, tuple[int, int]] = {}  # request id -> (drafted, accepted) this step
        if self.spec is not None:
            for rid in so.finished_req_ids:
                self.spec.forget(rid)
            for rid, drafts in so.draft_token_ids.items():
                if rid in ro.sampled:
                    kept[rid] = (len(drafts), len(ro.sampled[rid]) - 1)
                    self.spec.observe(rid, *kept[rid])
        reqs = self.scheduler.requests  # output lengths before the step: the matchers take what is new
        before = ({rid: r.num_output_tokens for rid in ro.sampled if (r := reqs.get(rid)) is not None}
                  if self._structured is not None else {})
        updated = self.scheduler.update(so, ro.sampled) + self._finish_pooled(ro)
        rejected = self._accept_grammar(updated, before)
        outputs, stopped = self.processor.process(updated, ro, kept)
        self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        self._fail(rejected)
        if self.connector is not None:
            for out in outputs:
                if out.finished:
                    out.kv_transfer_params = self.connector.take_output_params(out.request_id)
        if self.check_integrity:
            self.kv.check_integrity(self.scheduler.block_holders())
        return outputs

    def _finish_pooled(self, ro: ModelRunnerOutput) -> list[Request]:
        """Embedding requests end with their prompt: those pooled this step finish here (their
        blocks freed as any finished request's); the output processor takes their vectors."""
        done = [r for rid in ro.pooled
                if (r := self.scheduler.requests.get(rid)) is not None and r.status == RequestStatus.RUNNING]
        self.scheduler.finish_requests([r.request_id for r in done], RequestStatus.FINISHED_STOPPED)
        return done

    @property
    def kv_usage(self) -> float:
        return self.kv.usage

    def stats(self) -> dict[str, float | int | str]:
        block_bytes = kv_bytes_per_block(self.hf_config, self.kv.block_size, self.kv_dtype)
        return {
            "quantization": self.quantization,
            "weight_bytes": self.weight_bytes,
            "max_num_batched_tokens": self.scheduler_config.max_num_batched_tokens,
            "step_budget_reason": self.step_budget.reason,
            **({"prefill_seconds_per_token": self.step_budget.seconds_per_token}
               if self.step_budget.seconds_per_token is not None else {}),
            "kv_cache_sizing": self.kv_sizing,
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "kv_blocks_used": self.kv.num_used_blocks,
            "kv_blocks_total": self.kv.num_blocks,
            "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch."),  # float8_e4m3fn with fp8
            "kv_cache_bytes": self.kv.num_blocks * block_bytes,  # the KV tensors, in the KV dtype
            "kv_capacity_tokens": self.kv.num_blocks * self.kv.block_size,
            "kv_usage": self.kv.usage,
            "prefix_cache_queries": self.kv.prefix_cache_queries,
            "prefix_cache_hits": self.kv.prefix_cache_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            **(self.connector.stats() if self.connector is not None else {}),
            **self._worker_connector_stats(),
            **(self._structured.stats() if self._structured is not None else {}),
            **(self.spec.stats() if self.spec is not None else {}),
        }

    def _worker_connector_stats(self) -> dict[str, float | int]:
        """The counters of the connectors' worker roles, from the output rank (where they move bytes)."""
        if self.connector is None:
            return {}
        try:
            return self.executor.collective_rpc("kv_connector_stats")[self.executor.output_rank]
        except WorkerError:
            return {}

    def clear_kv_cache(self) -> dict[str, int]:
        """Empty the device prefix cache (if no request holds blocks) and every KV tier;
        returns the entries removed per tier."""
        idle = self.kv.cache.num_evictable if self.kv.cache is not None else 0
        out = {"device": idle if self.kv.reset_prefix_cache() else 0}
        if self.tiers is not None:
            out.update(self.tiers.clear())
        return out

    def close(self) -> None:
        """Stop the KV tiers' background threads once their queued writes are done, then the ranks."""
        if self.tiers is not None:
            atexit.unregister(self.close)
            try:
                self.tiers.flush()
                if self.kv.cache is not None:
                    self.tiers.persist(self.kv.cache.cached_blocks())
            except WorkerError as e:  # a rank is gone, and the KV it held with it
                logger.warning("KV tiers: blocks in memory not saved: %s", e)
            self.tiers = None
        if self.connector is not None:
            try:  # the worker roles in the ranks (a P/D sender's socket, fetch threads)
                self.executor.collective_rpc("close_kv_connectors")
            except WorkerError as e:
                logger.warning("KV connectors: a rank is gone before its worker roles closed: %s", e)
        self.transfer = None
        self.connector = None
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None
        if self._structured is not None:
            self._structured.close()
        self.executor.shutdown()
