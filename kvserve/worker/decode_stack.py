"""A decode step's decoder layers in one C call (Llama-family models, float32, one rank, a CPU): a
runner-level fast path, like cuda_graphs.py. The model runner builds it once from the model's
public parts (its layers, norms and linears; a quantized linear's `inplace_weight()`) and asks it
first each step; the C driver and its structs are kvserve/kernels/decode_stack.py.

A decode step of a small model on a CPU is mostly dispatch: per layer ~40 torch and ctypes calls,
each microseconds of Python for a few thousand multiply-adds. llama.cpp runs the whole step in C.
This does the same for the layers: one call runs every layer of the batch's decode tokens in one
OpenMP parallel region, the threads meeting at a barrier between ops:

  x = norm(h + res)            res = h + res (layer 0: res = h)
  qkv = x @ Wqkv.T (+ bias)    q/k per-head norm (Qwen3), rotary on q and k
  K, V written to the paged cache at each token's slot (float32, bfloat16, or fp8 codes with the layer's scale)
  attn = paged decode attention (one task per request and kv head)
  x = norm(attn @ Wo.T + res)  res = attn @ Wo.T + res
  h = silu_mul(x @ Wgu.T) @ Wdown.T

The ops are the ones the layers' Python path calls (qmatmul's blocks kernels, ops' rows, the cpu
attention backend's kernel), compiled into one library, so both paths compute the same sums in
the same order: outputs are bit-identical (tested). The model's final norm runs here too (a
torch call after the stack cost ~0.1 ms: the Python it runs is out of cache after the layers'
weights streamed through); the embedding before and the LM head after stay in Python.

It runs a step when the batch is small enough that each quantized linear would use its kernel
rather than the dense path (`dense_from`, tuning.py): decodes, and also a request's several query
tokens after its cached context (speculative decoding's verify rows, a short later prefill chunk),
each taken as a decode row that sees the context up to itself (`_rows`). So a verify step runs the one-token step's
arithmetic per row, and speculation keeps greedy outputs bit for bit. Larger batches and long
prefills take the Python path, where matmuls dominate. `build` returns None (the Python path
always) for what it does not model: other dtypes, tensor or pipeline parallelism, MoE layers,
linears other than dense float32, blocks (qmatmul.Blocks) or raw K-quant rows (or a stack of
these, a StackedLinear) without an input permutation, non-CPU devices, or no C compiler.
`KVSERVE_DECODE_STACK=0` turns it off.
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Any

import torch

from kvserve.kernels import decode_stack as c_stack
from kvserve.kernels import kquant, paged_attention, qmatmul

logger = logging.getLogger(__name__)

DENSE_MAX_ROWS = 8  # float32 weights: from here torch's GEMM beats this file's row-at-a-time dot products

class Unsupported(Exception):
    """What the stack does not model (the message says what)."""


def _lin(module: Any) -> tuple[c_stack.Lin, int, list[Any]]:
    """A ParallelLinear as the C struct, the most rows its kernel runs at, and the tensors (and C
    structs) it points into (kept alive by the stack). A quantized one describes its weight itself
    (`inplace_weight()`, kvserve.quant.linear.InplaceWeight)."""
    if module.tp.size != 1:
        raise Unsupported("tensor parallelism")
    kernel = module.kernel
    bias = kernel.bias if kernel is not None and kernel.bias is not None else module.bias
    if bias is not None and bias.dtype != torch.float32:
        raise Unsupported(f"a {bias.dtype} bias")
    keep = [] if bias is None else [bias]
    bias_ptr = None if bias is None else bias.data_ptr()
    if kernel is None:
        w = module.weight
        if w.dtype != torch.float32 or not w.is_contiguous() or w.device.type != "cpu":
            raise Unsupported(f"a {w.dtype} dense weight")
        lin = c_stack.Lin(c_stack.LIN_DENSE, 0, w.shape[0], w.shape[1], w.data_ptr(), None, None, bias_ptr)
        return lin, DENSE_MAX_ROWS, keep + [w]
    desc = kernel.inplace_weight() if hasattr(kernel, "inplace_weight") else None
    if desc is None:
        raise Unsupported(f"a {type(kernel).__name__} linear ({getattr(kernel, 'path', '?')} path)")
    parts = desc.parts or [desc]  # a stacked linear: one Lin per part, each pointing at the next
    lin, first = None, desc.out_features
    for part in reversed(parts):
        first -= part.out_features
        lin, tensors = _inplace_lin(part, None if bias is None else bias_ptr + 4 * first, lin)
        keep += tensors
    return lin, desc.dense_from, keep


def _inplace_lin(desc: Any, bias_ptr: int | None, rest: c_stack.Lin | None) -> tuple[c_stack.Lin, list[Any]]:
    """One part's Lin (an InplaceWeight of blocks or K-quant rows), followed by `rest`; what it points into."""
    rest_ptr, keep = (None, []) if rest is None else (ctypes.addressof(rest), [rest])
    if desc.kquant_parts is not None:
        m = kquant.make_matrix(desc.kquant_parts, desc.in_features)  # the stack's own copy, into the module's rows
        lin = c_stack.Lin(c_stack.LIN_KQUANT, 0, desc.out_features, desc.in_features, ctypes.addressof(m), None, None,
                          bias_ptr, rest_ptr)
        return lin, keep + [rows for _, rows in desc.kquant_parts] + [m]
    b = desc.blocks
    n, k = b.shape
    lin = c_stack.Lin(b.kind, qmatmul.MODES.index(desc.activations), n, k, b.codes.data_ptr(), b.d.data_ptr(),
                      None if b.c is None else b.c.data_ptr(), bias_ptr, rest_ptr)
    return lin, keep + [t for t in (b.codes, b.d, b.c) if t is not None]


class DecodeStack:
    """The C decode path of one Llama-family model (see the module docstring); `build` makes one.
    The model runner asks `runs` each step and, where it does, takes `forward`'s hidden states."""

    def __init__(self, model: Any, lib: ctypes.CDLL, layers: list[c_stack.Layer], dims: c_stack.Dims, max_rows: int,
                 keep: list[torch.Tensor], attns: list[Any]) -> None:
        self.model = model  # the LlamaModel: its embedding, rotary tables and final norm
        self.lib, self.dims, self.max_rows = lib, dims, max_rows
        self.layers = (c_stack.Layer * len(layers))(*layers)
        self._keep, self._attns = keep, attns
        self._caches: list | None = None  # the kv_caches list the layers point into

    @classmethod
    def build(cls, model: Any, dtype: torch.dtype, attention_backend: str,
              device: torch.device | str = "cpu") -> DecodeStack | None:
        """The stack for `model` (a LlamaForCausalLM, its weights, tuning and KV scales final) on
        `device`, or None when it cannot run it (logged once; silently off a CPU)."""
        if torch.device(device).type != "cpu" or os.environ.get("KVSERVE_DECODE_STACK", "1") == "0":
            return None
        try:
            return cls._build(model, dtype, attention_backend)
        except Unsupported as e:
            logger.info("decode stack off: %s; decode steps run layer by layer", e)
            return None

    @classmethod
    def _build(cls, top: Any, dtype: torch.dtype, attention_backend: str) -> DecodeStack:
        from kvserve.models.llama import LlamaForCausalLM, LlamaMLP, LlamaModel

        if not isinstance(top, LlamaForCausalLM) or type(top.model) is not LlamaModel:
            raise Unsupported(f"a {type(top).__name__} model (it runs Llama-family decoder stacks)")
        model = top.model
        if dtype != torch.float32:
            raise Unsupported(f"dtype {dtype} (it runs float32 models)")
        if attention_backend not in ("cpu", "torch"):
            raise Unsupported(f"the {attention_backend} attention backend")
        if model.start != 0 or not model.pp.is_last or model.embed_tokens is None:
            raise Unsupported("pipeline parallelism")
        rot = model.rotary_emb
        if rot.cos_cache.dtype != torch.float32 or rot.cos_cache.device.type != "cpu":
            raise Unsupported("rotary tables not float32 on the CPU")
        lib = c_stack.load()
        if lib is None:
            raise Unsupported("no C compiler")
        layers, keep, attns, max_rows = [], [rot.cos_cache, rot.sin_cache], [], 1 << 30
        first = model.layers[0]
        a0 = first.self_attn
        eps = first.input_layernorm.eps
        for layer in model.layers:
            a, mlp = layer.self_attn, layer.mlp
            if type(mlp) is not LlamaMLP:
                raise Unsupported(f"{type(mlp).__name__} feed-forward layers")
            lins = []
            for mod in (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj):
                lin, rows, tensors = _lin(mod)
                lins.append(lin)
                keep += tensors
                max_rows = min(max_rows, rows)
            norms = [layer.input_layernorm, layer.post_attention_layernorm] + (
                [a.q_norm, a.k_norm] if a.q_norm is not None else [])
            if any(n.eps != eps or n.weight.dtype != torch.float32 for n in norms):
                raise Unsupported("norms of different eps or dtype")
            keep += [n.weight for n in norms]
            ptrs = [n.weight.data_ptr() for n in norms] + [None] * (4 - len(norms))
            layers.append(c_stack.Layer(*ptrs, *lins))  # caches and their scales: _point_at
            attns.append(a.attn)
        if model.norm.eps != eps or model.norm.weight.dtype != torch.float32:
            raise Unsupported("a final norm of another eps or dtype")
        keep.append(model.norm.weight)
        mlp0 = first.mlp
        dims = c_stack.Dims(hidden=first.input_layernorm.weight.shape[0], hq=a0.num_heads, hkv=a0.num_kv_heads,
                     d=a0.head_dim, inter=mlp0.down_proj.in_features, block_size=0, kv_kind=0,
                     max_k=max(lin.k for layer in layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)),
                     eps=eps, scale=a0.attn.scale)
        if dims.hq % dims.hkv or dims.d % 2:
            raise Unsupported("heads that do not group evenly")
        return cls(model, lib, layers, dims, max_rows, keep, attns)

    def runs(self, num_tokens: int, meta: Any, kv_caches: list) -> bool:
        """Whether this step's layers run here: a small batch whose query tokens are each request's
        last ones (not a blend's) and follow context in the cache (a decode, verify rows, a later
        prefill chunk; a prompt's first chunk attends to its own fresh K/V on the layer path, which
        an fp8 cache would not give back), caches it handles."""
        return (num_tokens < self.max_rows and meta.query_positions is None
                and (meta.num_decodes == meta.num_reqs or all(
                    n > end - start or end - start == 1
                    for n, start, end in zip(meta.seq_lens, meta.query_start_loc, meta.query_start_loc[1:])))
                and (kv_caches is self._caches or self._point_at(kv_caches)))

    def _point_at(self, kv_caches: list) -> bool:
        """Point the layers at these caches; False if the stack cannot read or write them."""
        k0 = kv_caches[0][0]
        kind = paged_attention.ROW_KIND.get(k0.dtype)
        if kind is None or k0.device.type != "cpu" or any(a.kv_amax is not None for a in self._attns):
            return False
        if k0.dim() != 4 or k0.shape[2] != self.dims.hkv or k0.shape[3] != self.dims.d:
            return False
        if len(kv_caches) != len(self.layers) or not all(
                k.is_contiguous() and v.is_contiguous() and k.dtype == v.dtype == k0.dtype and k.shape == k0.shape
                for k, v in kv_caches):
            return False
        for layer, (k, v), a in zip(self.layers, kv_caches, self._attns):
            layer.k_cache, layer.v_cache = k.data_ptr(), v.data_ptr()
            layer.k_scale, layer.v_scale = a.k_scale, a.v_scale
        self.dims.block_size, self.dims.kv_kind = k0.shape[1], kind
        self._caches = kv_caches
        return True

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any) -> torch.Tensor:
        """The final-norm hidden states [B, hidden] of a step `runs` accepted, as the model's forward
        gives them: the embedding, then every layer and the final norm here in C."""
        return self(self.model.embed_tokens(input_ids), positions, meta, self.model.rotary_emb)

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, meta: Any, rotary: Any) -> torch.Tensor:
        """Run every layer and the final norm on the embeddings h [B, hidden] (written in place): the
        final-norm hidden states, as the model's norm(hidden, residual) gives them."""
        b = h.shape[0]
        h = h.contiguous()
        res = torch.empty_like(h)
        tables, lens = self._rows(meta, b)
        pos = positions.to(torch.int64).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        self.lib.decode_stack(ctypes.addressof(self.layers), len(self.layers), ctypes.addressof(self.dims), b,
                              h.data_ptr(), res.data_ptr(), rotary.cos_cache.data_ptr(),
                              rotary.sin_cache.data_ptr(), pos.data_ptr(), slots.data_ptr(), tables.data_ptr(),
                              tables.shape[1], lens.data_ptr(), max(meta.seq_lens),
                              self.model.norm.weight.data_ptr(), torch.get_num_threads())
        return h

    @staticmethod
    def _rows(meta: Any, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each of the b query tokens as a decode row: its request's block table [b, ts] and its
        context length [b] (the request's seq_len less the query tokens after it). The kernel
        writes every row's K/V before any row attends, so a request's rows see each other causally:
        a verify step's rows compute what one-token steps would, bit for bit."""
        tables = meta.block_tables.to(torch.int64)
        lens = meta.seq_lens_tensor.to(torch.int64)
        if meta.num_decodes == meta.num_reqs == b:
            return tables[:b].contiguous(), lens[:b].contiguous()
        counts = torch.tensor([e - s for s, e in zip(meta.query_start_loc, meta.query_start_loc[1:])])
        req = torch.repeat_interleave(torch.arange(len(counts)), counts)
        after = torch.tensor(meta.query_start_loc[1:], dtype=torch.int64)[req] - 1 - torch.arange(b)
        return tables[req].contiguous(), (lens[req] - after).contiguous()
