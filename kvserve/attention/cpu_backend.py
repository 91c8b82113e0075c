"""The `cpu` attention backend: the torch backend with compiled C kernels (kvserve/kernels/paged_attention.py) for
paged decode and prefill attention, the fp8 KV write, and the fp8 KV read of prefills where the
prefill kernel does not apply.

Each kernel is used where it applies (a CPU tensor of a dtype it handles, a kernel that built
on this machine) and the torch backend's own step everywhere else, so it runs without a C
compiler too, only slower.
"""

from __future__ import annotations

import torch

from kvserve.attention.backend import FP8, AttentionMetadata, register_backend
from kvserve.attention.torch_backend import TorchAttentionBackend
from kvserve.kernels import paged_attention, tuning


@register_backend
class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        super().__init__()
        paged_attention.load_kernel()  # build now rather than inside the first decode step
        self.prefill_kernel = True  # the C prefill kernel where it applies (`tune` measures it against SDPA)
        self.prefill_bf16 = False  # its dot products in bfloat16 (`tune`, where allowed and measured faster)

    def tune(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
             bf16_products: bool = False, kv_dtype: torch.dtype | None = None) -> None:
        kv_dtype = kv_dtype or dtype
        probe = torch.empty(1, num_heads, head_dim, dtype=dtype)
        if not paged_attention.supports_prefill(probe, probe.to(kv_dtype)):
            return
        bf16 = bf16_products and paged_attention.bf16_products()
        shape = [num_heads, num_kv_heads, head_dim, str(dtype)] + [f"kv {kv_dtype}"] * (kv_dtype != dtype)
        chosen = tuning.choose_prefill_attention(shape + ["bf16"] * bf16, "paged_attention.c",
                                                 lambda q, n: self._prefill_candidates(num_heads, num_kv_heads,
                                                                                       head_dim, dtype, kv_dtype,
                                                                                       bf16, q, n))
        self.prefill_kernel, self.prefill_bf16 = chosen != "sdpa", chosen == "kernel_bf16"

    def _prefill_candidates(self, hq: int, hkv: int, d: int, dtype: torch.dtype, kv_dtype: torch.dtype, bf16: bool,
                            q_len: int, length: int) -> dict:
        """The prefill paths for one request's chunk of q_len tokens ending a context of `length`:
        this backend's (the kernel; with bf16, also the kernel with bfloat16 products) and the torch
        backend's (gather, then SDPA), on random values; the cache in kv_dtype."""
        bs = 16
        g = torch.Generator().manual_seed(0)
        kc, vc = (torch.randn(-(-length // bs), bs, hkv, d, generator=g).to(kv_dtype) for _ in range(2))
        q = torch.randn(q_len, hq, d, generator=g).to(dtype)
        out = torch.empty_like(q)
        meta = AttentionMetadata(num_decodes=0, query_start_loc=[0, q_len], seq_lens=[length],
                                 slot_mapping=torch.zeros(0, dtype=torch.int64),
                                 block_tables=torch.arange(kc.shape[0])[None], seq_lens_tensor=torch.tensor([length]),
                                 block_size=bs)
        def kernel(bf: bool) -> None:
            paged_attention.paged_prefill(q, kc, vc, meta.block_tables, torch.tensor(meta.query_start_loc),
                                          meta.seq_lens_tensor, 0, 1, d ** -0.5, None, out, bf)

        return {"kernel": lambda: kernel(False),
                **({"kernel_bf16": lambda: kernel(True)} if bf16 else {}),
                "sdpa": lambda: super(CpuAttentionBackend, self)._prefills(q, None, None, kc, vc, meta, d ** -0.5,
                                                                           1.0, 1.0, out)}

    def _decodes(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, k_scale: float,
                 v_scale: float, out: torch.Tensor) -> None:
        if not paged_attention.supports(q, k_cache):
            return super()._decodes(q, k_cache, v_cache, meta, scale, k_scale, v_scale, out)
        nd = q.shape[0]
        out.copy_(paged_attention.paged_decode(q, k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens_tensor[:nd],
                                          max(meta.seq_lens[:nd]), scale, k_scale, v_scale))

    def _prefills(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, k_scale: float,
                  v_scale: float, out: torch.Tensor) -> None:
        if not (self.prefill_kernel and paged_attention.supports_prefill(q, k_cache)):
            return super()._prefills(q, k, v, k_cache, v_cache, meta, scale, k_scale, v_scale, out)
        starts = torch.tensor(meta.query_start_loc, dtype=torch.int64)
        # bfloat16 products only for steps with as many prefill rows as the linears' bfloat16 and int8
        # paths need: fewer (a short prompt, a cached prompt's tail) keep float32 attention as they
        # keep float32-class linears, so their outputs do not move with the tuning's choice
        rows = meta.query_start_loc[meta.num_reqs] - meta.query_start_loc[meta.num_decodes]
        paged_attention.paged_prefill(q, k_cache, v_cache, meta.block_tables, starts, meta.seq_lens_tensor,
                                      meta.num_decodes, meta.num_reqs, scale, meta.query_positions, out,
                                      self.prefill_bf16 and rows >= tuning.BF16_DENSE_MIN_ROWS)

    def _write_fp8(self, cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: float) -> None:
        if paged_attention.supports_write(cache, x):
            paged_attention.write_fp8(cache, slots, x, scale)
        else:
            super()._write_fp8(cache, slots, x, scale)

    def _gather(self, cache: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
        if cache.dtype == FP8 and paged_attention.supports_dequant(cache, dtype):
            return paged_attention.dequant_blocks(cache, ids, dtype, scale).view((-1,) + tuple(cache.shape[2:]))
        return super()._gather(cache, ids, dtype, scale)
