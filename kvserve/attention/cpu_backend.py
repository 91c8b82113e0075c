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
from kvserve.kernels import paged_attention


@register_backend
class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self) -> None:
        super().__init__()
        paged_attention.load_kernel()  # build now rather than inside the first decode step

    def _decodes(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, k_scale: float,
                 v_scale: float, out: torch.Tensor) -> None:
        if not paged_attention.supports(q, k_cache):
            return super()._decodes(q, k_cache, v_cache, meta, scale, k_scale, v_scale, out)
        nd = q.shape[0]
        out.copy_(paged_attention.paged_decode(q, k_cache, v_cache, meta.block_tables[:nd], meta.seq_lens_tensor[:nd],
                                          max(meta.seq_lens[:nd]), scale, k_scale, v_scale))

    def _prefills(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, k_scale: float,
                  v_scale: float, out: torch.Tensor) -> None:
        if not paged_attention.supports_prefill(q, k_cache):
            return super()._prefills(q, k, v, k_cache, v_cache, meta, scale, k_scale, v_scale, out)
        starts = torch.tensor(meta.query_start_loc, dtype=torch.int64)
        paged_attention.paged_prefill(q, k_cache, v_cache, meta.block_tables, starts, meta.seq_lens_tensor,
                                      meta.num_decodes, meta.num_reqs, scale, meta.query_positions, out)

    def _write_fp8(self, cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: float) -> None:
        if paged_attention.supports_write(cache, x):
            paged_attention.write_fp8(cache, slots, x, scale)
        else:
            super()._write_fp8(cache, slots, x, scale)

    def _gather(self, cache: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
        if cache.dtype == FP8 and paged_attention.supports_dequant(cache, dtype):
            return paged_attention.dequant_blocks(cache, ids, dtype, scale).view((-1,) + tuple(cache.shape[2:]))
        return super()._gather(cache, ids, dtype, scale)
