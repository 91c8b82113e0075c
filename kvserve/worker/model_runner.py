"""Model runner: owns the model, the KV tensors and the per-request sampling state.

Turns a SchedulerOutput into one flat batch (no padding), runs the model,
samples the requests whose scheduled tokens reach their end, and computes
prompt logprobs where asked. Embedding requests (a pooling spec in their params,
pooling_params.py) are never sampled: their hidden rows are pooled chunk by chunk
and the vector is returned once their prompt is done.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from kvserve.attention import FP8, FP8_MAX, Attention, AttentionMetadata, get_backend, set_attention_backend
from kvserve.config import resolve_attention_backend
from kvserve.config_sections import KV_CACHE_DTYPES
from kvserve.core.kv_connector import KVConnectorWorker
from kvserve.core.sched_output import SchedulerOutput
from kvserve.distributed.parallel import IntermediateTensors, Parallel
from kvserve.layers.linear import kv_head_range
from kvserve.layers.moe import FusedMoE
from kvserve.pooling_params import pooling_params
from kvserve.sampling_params import SamplingParams
from kvserve.spec_decode.rejection import verify_greedy, verify_sampled
from kvserve.worker import cuda_graphs
from kvserve.worker.pooler import Pooler
from kvserve.worker.sampler import Sampler, SamplingMetadata, compute_prompt_logprobs, gather_logprobs

# (token ids: actual/sampled first then the top-k, their logprobs, rank of the first)
TokenLogprobs = tuple[list[int], list[float], int]


@dataclass
class ModelRunnerOutput:
    # Each sampling request's new tokens: one, or with drafts (speculative decoding) the accepted
    # drafts and the token after them; and, where asked, each new token's logprobs.
    sampled: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Prompt logprobs computed this step: (first position predicted, one entry per position).
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    # Embedding requests whose prompt ended this step: their pooled vector.
    pooled: dict[str, list[float]] = field(default_factory=dict)
    # What each KV connector's worker role reported for this step, by connector name.
    kv_connector_output: dict[str, Any] = field(default_factory=dict)


@dataclass
class _ReqState:
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None
    pooler: Pooler | None = None  # embedding requests only


# The calibration prompt's max |K| (|V|) lands at most at 448 / KV_SCALE_MARGIN in the fp8 cache
# (between 448/4 and 448/2 after rounding the scale to a power of two): headroom for prompts whose
# K/V run larger than the calibration prompt's before they saturate.
KV_SCALE_MARGIN = 2.0


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, float32_kernels: bool,
                           device: torch.device | str = "cpu") -> str:
    """kv_cache_dtype with 'auto' decided for a model (the engine does this once; its ranks get the
    result): 'bfloat16' for a float32 model on a CPU whose linears run compressed in the float32 kernels
    (`loader.runs_float32_kernels`: GGUF, int8, AWQ, GPTQ weights), whose float32 is the kernels'
    arithmetic, not the weights' precision (~4-8 bits); as llama.cpp and vLLM keep such a model's
    K/V in 16 bits, at half the bytes a long context's decode reads. 'float32' keeps them as
    computed. Otherwise 'auto' stays the model's dtype."""
    if (kv_cache_dtype == "auto" and float32_kernels and model_dtype == torch.float32
            and torch.device(device).type == "cpu"):
        return "bfloat16"
    return kv_cache_dtype


def kv_dtype_of(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV tensors are stored in: the model's ('auto'; see resolve_kv_cache_dtype for
    the engine's choice), float32 ('float32', of a float32 model), float8 e4m3fn ('fp8') or
    bfloat16 ('bfloat16': K/V rounded to 8 significant bits when written, computed in the model's)."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype == "float32":
        if model_dtype != torch.float32:
            raise ValueError(f"kv_cache_dtype='float32' needs a float32 model (dtype), not {model_dtype}")
        return torch.float32
    if kv_cache_dtype == "fp8":
        return FP8
    if kv_cache_dtype == "bfloat16":
        return torch.bfloat16
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")


def fp8_kv_scales(amax: torch.Tensor) -> torch.Tensor:
    """Per-layer scales [L, 2] (K, V) from the calibration max |K|, |V| [L, 2]: the smallest power of
    two s with amax * KV_SCALE_MARGIN / s <= 448 (1 where amax is 0). A power of two makes x / s exact,
    leaving only the fp8 rounding, and gives the same scales on every machine unless amax sits on a
    boundary, so replicas sharing KV tiers agree."""
    if not torch.isfinite(amax).all():
        raise ValueError(f"fp8 KV calibration: max |K|, |V| per layer are not finite: {amax.tolist()}")
    scales = torch.exp2(torch.ceil(torch.log2(amax.double() * KV_SCALE_MARGIN / FP8_MAX))).float()
    return torch.where(amax > 0, scales, torch.ones_like(scales))


def set_kv_scales(model: nn.Module, scales: torch.Tensor) -> None:
    """Give each Attention layer of `model`, in order, its fp8 (k_scale, v_scale) of scales [layers, 2]."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    for m, (k_scale, v_scale) in zip(layers, scales.tolist()):
        m.k_scale, m.v_scale = k_scale, v_scale


def _zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed KV tensor. On the CPU its memory comes from calloc (numpy.zeros), whose pages the
    OS zeroes on first touch: a pool sized from free RAM costs neither start-up time nor resident
    memory until its blocks are used (torch.zeros writes every byte at start). Zeroed, not empty:
    padding slots of a block may be read under a zero attention weight, and 0 * NaN is NaN."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import numpy as np

    nbytes = torch.empty((), dtype=dtype).element_size()
    for n in shape:
        nbytes *= n
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


def kv_bytes_per_block(hf_config, block_size: int, dtype: torch.dtype, tp_size: int = 1,
                       num_layers: int | None = None) -> int:
    """Bytes of K and V for one block on one rank: its num_layers (default: all) layers and the
    largest rank's share of the KV heads, with KV stored in dtype (the KV dtype)."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    elem = torch.empty((), dtype=dtype).element_size()
    layers = hf_config.num_hidden_layers if num_layers is None else num_layers
    kv_heads = -(-(getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads) // tp_size)
    return 2 * layers * block_size * kv_heads * head_dim * elem


class ModelRunner:
    def __init__(self, model: nn.Module, hf_config, dtype: torch.dtype, num_blocks: int,
                 block_size: int, device: torch.device | str = "cpu", kv_cache_dtype: str = "auto",
                 kv_calibration_ids: list[int] | None = None, parallel: Parallel | None = None,
                 attention_backend: str = "auto") -> None:
        """kv_cache_dtype 'fp8' stores K/V as float8 e4m3fn with per-layer scales calibrated here by
        one forward of kv_calibration_ids (required then); 'auto' stores them in the model dtype.

        parallel: this rank's place; its KV cache holds its stage's layers and its share of the
        KV heads. Only the output rank (last stage, first tensor-parallel rank) samples."""
        self.model = model
        self.parallel = parallel or Parallel()
        self.is_output_rank = self.parallel.pp.is_last and self.parallel.tp.is_first
        # KV connectors' worker roles in this rank, by name (worker/kv_connectors.py; the Worker sets them).
        self.connector_roles: dict[str, KVConnectorWorker] = {}
        self.hidden_size = hf_config.hidden_size
        self.device = torch.device(device)
        # One backend instance for all layers, so its scratch buffers are shared.
        self.attention_backend = get_backend(resolve_attention_backend(attention_backend, self.device))
        set_attention_backend(model, self.attention_backend)
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.vocab_size = hf_config.vocab_size
        self.dtype = dtype
        self.kv_dtype = kv_dtype_of(kv_cache_dtype, dtype)
        attn = next((m for m in model.modules() if isinstance(m, Attention)), None)
        if attn is not None:  # the backend's shape-dependent choices (prefill kernel)
            # bfloat16 products in prefill attention only where the prefill's linears already take int8
            # activation codes (tuning.tune_linears ran before): their rounding is the coarser
            # (BENCHMARKS.md: no measurable change in logprobs beside it).
            int8_prefill = any(getattr(m, "prefill_int8", False) for m in model.modules())
            self.attention_backend.tune(attn.num_heads, attn.num_kv_heads, attn.head_dim, dtype, int8_prefill,
                                        self.kv_dtype)
        start, end = self.parallel.layer_range(hf_config.num_hidden_layers)
        # The model's decoder layers, and those of this pipeline stage [start, end) (kv_caches[i - start]).
        self.num_layers, self.layer_range = hf_config.num_hidden_layers, (start, end)
        self.kv_caches = self.new_kv_caches(hf_config, self.kv_dtype)
        # fp8: (k_scale, v_scale) of each Attention layer in model order; the layers hold them too.
        self.decode_stack = None  # built below, once the fp8 KV scales are calibrated
        self.kv_scales: torch.Tensor | None = None
        if self.kv_dtype == FP8:
            if not kv_calibration_ids:
                raise ValueError("kv_cache_dtype='fp8' needs kv_calibration_ids: a prompt to calibrate the KV scales")
            self.kv_scales = self._calibrate_kv_scales(kv_calibration_ids)
        from kvserve.worker.decode_stack import DecodeStack  # small CPU decode steps' layers in one C call
        self.decode_stack = DecodeStack.build(model, dtype, self.attention_backend.name, self.device)
        self.sampler = Sampler()
        self.requests: dict[str, _ReqState] = {}
        self.eos_token_id: int | None = None
        self.graphs: cuda_graphs.DecodeGraphs | None = None  # enable_cuda_graphs
        # Speculative decoding with a draft model (spec_decode/draft_model.py; the Worker sets it):
        # fills the step's placeholder drafts before the target's forward.
        self.drafter = None

    def new_kv_caches(self, hf_config, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Zeroed K and V tensors of this rank's layers and KV heads of a model with hf_config, one
        block per block id of this runner (the target's cache, or a draft model's own)."""
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
        kv_heads = (getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads)
        head_start, head_end = kv_head_range(kv_heads, self.parallel.tp)
        shape = (self.num_blocks, self.block_size, head_end - head_start, head_dim)
        start, end = self.parallel.layer_range(hf_config.num_hidden_layers)
        return [(_zeroed_pool(shape, dtype, self.device), _zeroed_pool(shape, dtype, self.device))
                for _ in range(start, end)]

    @torch.inference_mode()
    def enable_cuda_graphs(self, max_batch: int, max_model_len: int, capture: bool = True) -> bool:
        """Replay decode steps of up to max_batch requests from CUDA graphs (worker/cuda_graphs.py).
        Runs on one rank with the triton backend; capture=False takes the same static-buffer path
        without graphs (tests on a CPU). Whether decodes will take it."""
        if not self.parallel.is_single or self.attention_backend.name != "triton":
            raise ValueError("CUDA graphs need one rank and the triton attention backend")
        moe = any(isinstance(m, FusedMoE) for m in self.model.modules())
        max_blocks = -(-max_model_len // self.block_size)
        self.graphs = cuda_graphs.enable(
            lambda ids, pos, meta: self._forward(ids, pos, self.kv_caches, meta), self.device, max_batch,
            max_blocks, self.block_size, capture, "MoE layers read expert counts on the host" if moe else None)
        return self.graphs is not None

    @torch.inference_mode()
    def _calibrate_kv_scales(self, token_ids: list[int]) -> torch.Tensor:
        """Prefill token_ids into a scratch cache in the model dtype while each Attention layer records
        max |K| and |V|; set and return the layers' fp8 scales [layers, 2]."""
        layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        for m in layers:
            m.kv_amax = torch.zeros(2, device=self.device)
        try:
            self.prefill_scratch(token_ids, self.dtype)
            amax = torch.stack([m.kv_amax for m in layers]).cpu()
        finally:
            for m in layers:
                m.kv_amax = None
        scales = fp8_kv_scales(amax)
        set_kv_scales(self.model, scales)
        return scales

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches, meta: AttentionMetadata
                 ) -> torch.Tensor | None:
        """This stage's part of the forward: take the previous stage's hidden states, hand ours to
        the next; the final hidden states on the last stage, None before it."""
        stack = self.decode_stack
        if stack is not None and stack.runs(input_ids.shape[0], meta, kv_caches):
            return stack.forward(input_ids, positions, meta)  # a single stage: the stack runs no pipeline
        pp = self.parallel.pp
        intermediate = None
        if not pp.is_first:
            t = input_ids.shape[0]
            h, r = (torch.empty(t, self.hidden_size, dtype=self.dtype, device=self.device) for _ in range(2))
            intermediate = IntermediateTensors(*pp.recv([h, r], pp.rank - 1))
        out = self.model(input_ids, positions, kv_caches, meta, intermediate)
        if pp.is_last:
            return out
        pp.send([out.hidden, out.residual], pp.rank + 1)
        return None

    @torch.inference_mode()
    def prefill_scratch(self, token_ids: list[int], kv_dtype: torch.dtype | None = None) -> torch.Tensor | None:
        """Final hidden states [T, hidden] of token_ids run as one prefill from position 0, writing K/V
        into scratch caches of ceil(T / block_size) blocks (kv_dtype, default the KV cache's):
        the runner's KV cache and requests are untouched. Every rank calls it together; ranks before
        the last pipeline stage return None."""
        n, dev = len(token_ids), self.device
        nblocks = -(-n // self.block_size)
        shape = (nblocks, *self.kv_caches[0][0].shape[1:])
        dtype = kv_dtype or self.kv_dtype
        # Every slot attention reads is written first (one fresh prefill), so empty() is enough.
        scratch = [(torch.empty(shape, dtype=dtype, device=dev), torch.empty(shape, dtype=dtype, device=dev))
                   for _ in self.kv_caches]
        meta = AttentionMetadata(
            num_decodes=0, query_start_loc=[0, n], seq_lens=[n], slot_mapping=torch.arange(n, device=dev),
            block_tables=torch.arange(nblocks, device=dev)[None], seq_lens_tensor=torch.tensor([n], device=dev),
            block_size=self.block_size)
        return self._forward(torch.tensor(token_ids, dtype=torch.int64, device=dev), torch.arange(n, device=dev),
                             scratch, meta)

    # ---- KV blocks in and out (the KV tiers, kv_tiers/manager.py) -------------

    @property
    def kv_block_shape(self) -> tuple[int, ...]:
        """One block's K/V as read_kv_blocks returns it: [layers, 2, block_size, kv_heads, head_dim]."""
        k = self.kv_caches[0][0]
        return (len(self.kv_caches), 2, *k.shape[1:])

    @torch.inference_mode()
    def read_kv_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """A host copy of these blocks' K/V, [n, *kv_block_shape]."""
        idx = torch.tensor(block_ids, device=self.device)
        # As bytes, like write_kv_blocks: float8 index kernels are missing on some devices.
        per_layer = [torch.stack((k.view(torch.uint8).index_select(0, idx), v.view(torch.uint8).index_select(0, idx)),
                                 dim=1) for k, v in self.kv_caches]
        return torch.stack(per_layer, dim=1).cpu().view(self.kv_dtype)

    @torch.inference_mode()
    def write_kv_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        """Fill these blocks with K/V laid out as read_kv_blocks returns them."""
        if data.dtype != self.kv_dtype:
            raise ValueError(f"KV block data is {data.dtype}, the KV cache holds {self.kv_dtype}")
        idx = torch.tensor(block_ids, device=self.device)
        # As bytes: index_copy_ has no float8 kernel on the CPU; a byte copy is exact for every dtype.
        data = data.to(self.device).contiguous().view(torch.uint8)
        for layer, (k, v) in enumerate(self.kv_caches):
            k.view(torch.uint8).index_copy_(0, idx, data[:, layer, 0])
            v.view(torch.uint8).index_copy_(0, idx, data[:, layer, 1])

    # ---- state ------------------------------------------------------------

    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
        for d in so.new_reqs:
            old = self.requests.get(d.req_id)  # resumed after preemption: keep its generator
            gen = old.generator if old else self._make_generator(d.sampling_params)
            spec = pooling_params(d.sampling_params)
            self.requests[d.req_id] = _ReqState(
                d.prompt_token_ids + d.output_token_ids, len(d.prompt_token_ids), d.sampling_params,
                list(d.block_ids), d.num_computed_tokens, gen, Pooler(spec) if spec is not None else None)
        for c in so.cached_reqs:
            st = self.requests[c.req_id]
            del st.block_ids[c.num_kept_blocks:]
            st.block_ids.extend(c.new_block_ids)
            st.num_computed_tokens = c.num_computed_tokens
            if c.new_token_ids:  # sampled on the output rank; the scheduler's copy is the truth
                del st.token_ids[c.num_computed_tokens:]
                st.token_ids.extend(c.new_token_ids)
        for rid, drafts in so.draft_token_ids.items():  # fed after the last token; taken out once verified
            self.requests[rid].token_ids.extend(drafts)

    def _make_generator(self, params: SamplingParams) -> torch.Generator | None:
        if params.seed is None or params.greedy:
            return None
        return torch.Generator(device=self.device).manual_seed(params.seed)

    # ---- one step ---------------------------------------------------------

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        metas = so.kv_connector_meta or {}
        for name, role in self.connector_roles.items():  # before anything of the step is written
            role.before_forward(metas.get(name), self)
        out = self._execute(so) if so.num_scheduled_tokens else ModelRunnerOutput()
        for name, role in self.connector_roles.items():
            role.after_forward(metas.get(name), self)
            out.kv_connector_output[name] = role.take_output()
        return out

    def _execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        drafts = so.draft_token_ids
        # Decodes (one query token, or a last token and its drafts) first: the attention backend batches them.
        order = sorted(so.num_scheduled_tokens, key=lambda r: so.num_scheduled_tokens[r] != 1 and r not in drafts)
        # A draft model fills the drafts' placeholders (and keeps its own K/V up with the step).
        draft_probs = self.drafter.draft(self, so, order) if self.drafter is not None else {}
        meta, input_ids, positions, req_rows = self._prepare(order, so.num_scheduled_tokens, drafts)
        if self.graphs is not None and self.graphs.runs(meta):
            hidden = self.graphs.run(input_ids, positions, meta)
        else:
            hidden = self._forward(input_ids, positions, self.kv_caches, meta)

        out = ModelRunnerOutput()
        if hidden is not None and self.is_output_rank:
            self._pool(order, so.num_scheduled_tokens, req_rows, hidden, out)
        sample_ids, sample_rows, plp = self._rows_to_compute(order, so.num_scheduled_tokens, req_rows, drafts)
        rows = sample_rows + [r for _, rs, _ in plp for r in rs]
        if rows and hidden is not None:
            every = len(rows) == hidden.shape[0] and rows == list(range(len(rows)))  # a decode step: no gather
            logits = self.model.compute_logits(hidden if every else hidden[self._to_device(torch.tensor(rows))])
            if self.is_output_rank:  # the logits' all-gather needed every tensor-parallel rank
                plain = [r for r in sample_ids if r not in drafts]
                spec = [r for r in sample_ids if r in drafts]
                n_plain = len(plain)
                n_spec = sum(len(drafts[r]) + 1 for r in spec)
                self._sample(plain, logits[:n_plain], out, so.grammar)
                self._verify(spec, drafts, draft_probs, logits[n_plain:n_plain + n_spec], out, so.grammar)
                self._prompt_logprobs(plp, logits[len(sample_rows):], out)
        self._advance(order, so.num_scheduled_tokens)
        for rid, toks in out.sampled.items():
            st, k = self.requests[rid], len(drafts.get(rid, ()))
            if k:  # the drafts give way to what verification kept; the rejected ones' K/V are stale
                del st.token_ids[-k:]
                st.num_computed_tokens -= k - (len(toks) - 1)
            st.token_ids.extend(toks)
        return out

    def _advance(self, order: list[str], num_sched: dict[str, int]) -> None:
        for rid in order:
            self.requests[rid].num_computed_tokens += num_sched[rid]

    def _prepare(self, order: list[str], num_sched: dict[str, int], drafts: dict[str, list[int]],
                 starts: dict[str, int] | None = None):
        """The step's flat batch: attention metadata, input ids, positions, and each request's
        first row (and the end) [len(order) + 1]. A request verifying k drafts is k + 1 decode rows
        of one sequence (each token's K/V is written before any row attends), so the decode
        kernels and the C decode stack run it. starts: the first position fed per request
        (default its num_computed_tokens; a draft model feeds its own)."""
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        req_rows = [0]
        num_decodes = 0
        bs = self.block_size
        for rid in order:
            st, n = self.requests[rid], num_sched[rid]
            start = st.num_computed_tokens if starts is None else starts[rid]
            ids.extend(st.token_ids[start:start + n])
            pos.extend(range(start, start + n))
            blocks = st.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + n))
            rows = [1] * n if rid in drafts else [n]
            for i, q in enumerate(rows):
                qsl.append(qsl[-1] + q)
                seq_lens.append(start + i + q)
                tables.append(blocks)
                num_decodes += q == 1
            req_rows.append(len(ids))
        # plain lists into tensors: one call each (a decode step is a few tokens; its preparation is
        # per-step overhead that every token pays)
        width = max(len(t) for t in tables)
        table_t = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int64)
        meta = AttentionMetadata(
            num_decodes=num_decodes, query_start_loc=qsl, seq_lens=seq_lens,
            slot_mapping=self._to_device(torch.tensor(slots, dtype=torch.int64)),
            block_tables=self._to_device(table_t),
            seq_lens_tensor=self._to_device(torch.tensor(seq_lens, dtype=torch.int64)), block_size=bs,
            query_start_tensor=self._to_device(torch.tensor(qsl, dtype=torch.int32)))
        return (meta, self._to_device(torch.tensor(ids, dtype=torch.int64)),
                self._to_device(torch.tensor(pos, dtype=torch.int64)), req_rows)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor on the runner's device; to a GPU from pinned memory, without waiting."""
        if self.device.type != "cuda":
            return t.to(self.device)
        return t.pin_memory().to(self.device, non_blocking=True)

    def _rows_to_compute(self, order, num_sched, req_rows: list[int], drafts: dict[str, list[int]]):
        """Hidden rows to turn into logits: each request that reaches its end samples from its
        last row, the plain ones first, then those with k drafts from their last k + 1 rows;
        requests asking for prompt logprobs also need their prompt rows."""
        sample_ids: list[str] = []
        sample_rows: list[int] = []
        spec_rows: list[int] = []
        plp: list[tuple[str, list[int], list[int]]] = []  # (req, rows, target token ids)
        for i, rid in enumerate(order):
            st, n = self.requests[rid], num_sched[rid]
            start, end = st.num_computed_tokens, st.num_computed_tokens + n
            if end == len(st.token_ids) and st.pooler is None:
                last = req_rows[i + 1] - 1
                k = len(drafts.get(rid, ()))
                if k:
                    spec_rows.extend(range(last - k, last + 1))
                else:
                    sample_rows.append(last)
                sample_ids.append(rid)
            if st.params.prompt_logprobs is not None and start < st.num_prompt_tokens - 1:
                last = min(end, st.num_prompt_tokens - 1)  # position p predicts token p + 1
                rows = list(range(req_rows[i], req_rows[i] + last - start))
                plp.append((rid, rows, st.token_ids[start + 1:last + 1]))
        return sample_ids, sample_rows + spec_rows, plp

    def _pool(self, order: list[str], num_sched: dict[str, int], req_rows: list[int], hidden: torch.Tensor,
              out: ModelRunnerOutput) -> None:
        """Embedding requests add this step's hidden rows to their pooler; one whose prompt ends
        here returns its vector."""
        for i, rid in enumerate(order):
            st = self.requests[rid]
            if st.pooler is None:
                continue
            st.pooler.add(hidden[req_rows[i]:req_rows[i + 1]])
            if st.num_computed_tokens + num_sched[rid] == len(st.token_ids):
                out.pooled[rid] = st.pooler.result()

    def _sample(self, rids: list[str], logits: torch.Tensor, out: ModelRunnerOutput, grammar=None) -> None:
        """grammar: the step's GrammarBitmask (kvserve/structured/manager.py), or None."""
        if not rids:
            return
        states = [self.requests[r] for r in rids]
        banned = [self._banned(st) for st in states]
        gens = {i: st.generator for i, st in enumerate(states) if st.generator is not None}
        # Token histories only feed penalties: don't copy them every step otherwise.
        hist = [st if st.params.uses_penalties else None for st in states]
        meta = SamplingMetadata.build(
            [st.params for st in states], [h.token_ids[:h.num_prompt_tokens] if h else [] for h in hist],
            [h.token_ids[h.num_prompt_tokens:] if h else [] for h in hist], gens, banned, self.vocab_size,
            self.device, _bitmask_rows(grammar, rids))
        res = self.sampler(logits, meta)
        sampled = res.sampled_token_ids.tolist()
        lp = res.logprobs.tolist() if res.logprobs is not None else None
        lp_ids = res.logprob_token_ids.tolist() if res.logprob_token_ids is not None else None
        ranks = res.sampled_ranks.tolist() if res.sampled_ranks is not None else None
        for i, (rid, st) in enumerate(zip(rids, states)):
            out.sampled[rid] = [sampled[i]]
            k = st.params.logprobs
            if k is not None and lp is not None:
                out.logprobs[rid] = [(lp_ids[i][:k + 1], lp[i][:k + 1], ranks[i])]

    def _verify(self, rids: list[str], drafts: dict[str, list[int]], draft_probs: dict[str, torch.Tensor | None],
                logits: torch.Tensor, out: ModelRunnerOutput, grammar=None) -> None:
        """Requests with k drafts: rows i = 0..k of logits are the target's distribution for the
        token after draft[:i] (penalties and banned tokens over the history with draft[:i], and a
        grammar's mask row for that prefix); verification (spec_decode/rejection.py) keeps a prefix
        of the drafts and samples the token after it. draft_probs: a draft model's distributions
        [k, V] per sampled request (absent: the drafts were fixed proposals)."""
        if not rids:
            return
        params, prompts, outputs, banned = [], [], [], []
        for rid in rids:
            st, d = self.requests[rid], drafts[rid]
            n_out = len(st.token_ids) - len(d) - st.num_prompt_tokens  # before the drafts
            prompt = st.token_ids[:st.num_prompt_tokens] if st.params.uses_penalties else []
            for i in range(len(d) + 1):
                params.append(st.params)
                prompts.append(prompt)
                outputs.append(st.token_ids[st.num_prompt_tokens:st.num_prompt_tokens + n_out + i]
                               if st.params.uses_penalties else [])
                banned.append(self._banned(st, n_out + i))
        meta = SamplingMetadata.build(params, prompts, outputs, {}, banned, self.vocab_size, self.device,
                                      _bitmask_rows(grammar, rids, [len(drafts[r]) + 1 for r in rids]))
        argmax, probs, raw = self.sampler.distributions(logits, meta)
        argmax_l = argmax.tolist()
        row = 0
        for rid in rids:
            st, d = self.requests[rid], drafts[rid]
            n = len(d) + 1
            if st.params.greedy:
                toks = verify_greedy(argmax_l[row:row + n], d)
            else:
                toks = verify_sampled(probs[row:row + n], d, draft_probs.get(rid), st.generator)
            out.sampled[rid] = toks
            k = st.params.logprobs
            if k is not None and raw is not None:
                vals, ids, ranks = gather_logprobs(raw[row:row + len(toks)], torch.tensor(toks, device=raw.device), k)
                out.logprobs[rid] = list(zip(ids.tolist(), vals.tolist(), ranks.tolist()))
            row += n

    def distributions(self, rids: list[str], logits: torch.Tensor, banned: list[list[int]]
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Each row's greedy pick and the distribution its request samples from (temperature,
        top-k, top-p, min-p; no penalties), for rows of other logits than the model's: a draft
        model's (spec_decode/draft_model.py). None for the distributions when every row is greedy."""
        params = [self.requests[r].params for r in rids]
        meta = SamplingMetadata.build(params, [[]] * len(rids), [[]] * len(rids), {}, banned, logits.shape[-1],
                                      logits.device)
        argmax, probs, _ = self.sampler.distributions(logits, meta)
        return argmax, probs

    def _banned(self, st: _ReqState, num_output: int | None = None) -> list[int]:
        """Tokens the request may not sample yet (EOS and stop tokens before min_tokens), at
        num_output output tokens (default: as many as it holds)."""
        p = st.params
        if num_output is None:
            num_output = len(st.token_ids) - st.num_prompt_tokens
        if num_output >= p.min_tokens:
            return []
        eos = [] if p.ignore_eos or self.eos_token_id is None else [self.eos_token_id]
        return eos + list(p.stop_token_ids)

    def _prompt_logprobs(self, plp, logits: torch.Tensor, out: ModelRunnerOutput) -> None:
        offset = 0
        for rid, rows, targets in plp:
            first = self.requests[rid].num_computed_tokens + 1
            k = self.requests[rid].params.prompt_logprobs
            chunk = logits[offset:offset + len(rows)]
            offset += len(rows)
            lps, ids, ranks = compute_prompt_logprobs(chunk, torch.tensor(targets, device=self.device), k)
            out.prompt_logprobs[rid] = (first, [(i[:k + 1], v[:k + 1], r) for i, v, r in
                                                zip(ids.tolist(), lps.tolist(), ranks.tolist())])


def _bitmask_rows(grammar, rids: list[str], counts: list[int] | None = None) -> torch.Tensor | None:
    """The step's grammar bitmask reordered to the sampled rows (`counts[i]` rows for rids[i]: 1, or
    a request's k + 1 verify rows); unconstrained rows allow everything."""
    if grammar is None:
        return None
    first = grammar.first_rows()
    counts = counts or [1] * len(rids)
    dst, src, row = [], [], 0
    for rid, n in zip(rids, counts):
        if rid in first:
            dst.extend(range(row, row + n))
            src.extend(range(first[rid], first[rid] + n))
        row += n
    if not dst:
        return None
    mask = torch.full((row, grammar.bitmask.shape[1]), -1, dtype=torch.int32)
    mask[dst] = torch.from_numpy(grammar.bitmask[src])
    return mask
