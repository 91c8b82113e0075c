"""The `triton` attention backend: Triton kernels for the KV write into paged blocks and for
paged attention over a flat batch of decodes and prefill chunks.

One attention kernel serves both phases. Every token's K/V is written into its block first
(the backend contract), so each query reads its whole context from the paged cache: query i of
a request with seq_len tokens after this step sits at position seq_len - q_len + i and sees the
keys at positions 0 .. that position (a decode is the case q_len = 1). A program takes up to
BLOCK_M queries of one request and one query head, walks the request's blocks through its block
table with an online softmax, and reads a float8 cache as code * scale.

Triton compiles for CUDA devices. On a CPU the same kernels run in Triton's interpreter
(TRITON_INTERPRET=1, set before this module is imported): far too slow to serve with, which is
how the tests check them on machines without a GPU.
"""

from __future__ import annotations

import torch

from kvserve.attention.backend import FP8, AttentionBackend, AttentionMetadata, register_backend
from kvserve.config import triton_interpreting

try:
    import triton
    import triton.language as tl
except ImportError:  # the backend refuses to start (TritonAttentionBackend.__init__)
    triton = None

BLOCK_M = 16  # queries per program (a decode uses one row of it)


if triton is not None:

    @triton.jit
    def _round_to_e4m3(y):
        """y (within +-448) rounded to the nearest float8 e4m3 value, ties to even, in float32: the
        cast that follows is then exact everywhere (Triton's interpreter drops the carry when a
        rounding crosses a power of two, e.g. 124 -> 64 instead of 128)."""
        a = tl.abs(y)
        e = tl.floor(tl.log2(tl.maximum(a, 0.015625)))  # 2^-6: below it, subnormal steps of 2^-9
        step = tl.exp2(e - 3.0)  # 3 mantissa bits
        t = a / step
        r = tl.floor(t + 0.5)
        odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
        r = tl.where((r - t == 0.5) & odd, r - 1.0, r)
        return tl.where(y < 0, -r * step, r * step)

    @triton.jit
    def _kv_write_kernel(x_ptr, cache_ptr, slot_ptr, stride_xt, stride_xh, stride_cs, stride_ch, inv_scale,
                         HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, IS_FP8: tl.constexpr):
        """cache[slot[t], h, :] = x[t, h, :] (as float8 codes of x * inv_scale for an fp8 cache)."""
        t = tl.program_id(0)
        h = tl.program_id(1)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        offs = tl.arange(0, D_PAD)
        mask = offs < HEAD_DIM
        x = tl.load(x_ptr + t * stride_xt + h * stride_xh + offs, mask=mask, other=0.0).to(tl.float32)
        if IS_FP8:
            x = _round_to_e4m3(tl.minimum(tl.maximum(x * inv_scale, -448.0), 448.0))
        tl.store(cache_ptr + slot * stride_cs + h * stride_ch + offs, x.to(cache_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _paged_attention_kernel(q_ptr, k_cache, v_cache, out_ptr, block_tables, seq_lens, query_start,
                                stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch,
                                stride_bt, scale, v_scale,
                                GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, BS_PAD: tl.constexpr,
                                HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
        """out[queries of request r, head h]: `scale` already holds the K scale of an fp8 cache."""
        r = tl.program_id(0)
        h = tl.program_id(1)
        tile = tl.program_id(2)
        q_first = tl.load(query_start + r)
        q_len = tl.load(query_start + r + 1) - q_first
        if tile * BLOCK_M < q_len:
            seq_len = tl.load(seq_lens + r)
            kvh = h // GROUP
            offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_d = tl.arange(0, D_PAD)
            offs_s = tl.arange(0, BS_PAD)
            m_mask = offs_m < q_len
            d_mask = offs_d < HEAD_DIM
            q = tl.load(q_ptr + (q_first + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                        mask=m_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
            pos = seq_len - q_len + offs_m  # each query's position in its sequence
            last = seq_len - q_len + tl.minimum(tile * BLOCK_M + BLOCK_M, q_len) - 1
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
            for b in range(0, last // BLOCK_SIZE + 1):
                block = tl.load(block_tables + r * stride_bt + b).to(tl.int64)
                kpos = b * BLOCK_SIZE + offs_s
                rows = block * stride_cb + offs_s[:, None] * stride_cs + kvh * stride_ch + offs_d[None, :]
                kv_mask = (offs_s < BLOCK_SIZE)[:, None] & d_mask[None, :]
                k = tl.load(k_cache + rows, mask=kv_mask, other=0.0).to(tl.float32)  # [BS_PAD, D_PAD]
                v = tl.load(v_cache + rows, mask=kv_mask, other=0.0).to(tl.float32)
                s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [BLOCK_M, BS_PAD]
                seen = (kpos[None, :] <= pos[:, None]) & (offs_s < BLOCK_SIZE)[None, :] & m_mask[:, None]
                s = tl.where(seen, s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
                p = tl.exp(s - m_safe[:, None])
                alpha = tl.exp(m_i - m_safe)
                l_i = l_i * alpha + tl.sum(p, axis=1)
                acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
                m_i = m_new
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * v_scale
            tl.store(out_ptr + (q_first + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@register_backend
class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self) -> None:
        if triton is None:
            raise ValueError("attention_backend triton needs the triton package (pip install triton)")
        self._meta: AttentionMetadata | None = None
        self._tensors: tuple[torch.Tensor, torch.Tensor] | None = None

    def _device_meta(self, meta: AttentionMetadata, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """query_start_loc and seq_lens as int32 tensors on the device, built once per step (the
        metadata object is shared by every layer of the step)."""
        if self._meta is not meta or self._tensors is None or self._tensors[0].device != device:
            self._tensors = (torch.tensor(meta.query_start_loc, dtype=torch.int32, device=device),
                             meta.seq_lens_tensor.to(device=device, dtype=torch.int32))
            self._meta = meta
        return self._tensors

    def _check_device(self, x: torch.Tensor) -> None:
        if x.device.type == "cpu" and not triton_interpreting():
            raise RuntimeError("the triton attention backend runs on a CUDA device; on a CPU only in Triton's "
                               "interpreter (TRITON_INTERPRET=1, for tests)")

    def write(self, cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: float) -> None:
        """Store x [T, Hkv, D] at these slots of cache [num_blocks, block_size, Hkv, D]."""
        t, hkv, d = x.shape
        if t == 0:
            return
        flat = cache.view(-1, hkv, d)
        _kv_write_kernel[(t, hkv)](x, flat, slots, x.stride(0), x.stride(1), flat.stride(0), flat.stride(1),
                                   1.0 / scale if cache.dtype == FP8 else 1.0,
                                   HEAD_DIM=d, D_PAD=triton.next_power_of_2(d), IS_FP8=cache.dtype == FP8)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
                v_scale: float = 1.0):
        self._check_device(q)
        if meta.query_positions is not None:
            raise NotImplementedError("the triton attention backend has no query_positions (blending)")
        self.write(k_cache, meta.slot_mapping, k, k_scale)
        self.write(v_cache, meta.slot_mapping, v, v_scale)
        out = torch.empty_like(q)
        if meta.num_tokens == 0:
            return out
        query_start, seq_lens = self._device_meta(meta, q.device)
        _, hq, d = q.shape
        bs, hkv = k_cache.shape[1], k_cache.shape[2]
        max_q = max(b - a for a, b in zip(meta.query_start_loc, meta.query_start_loc[1:]))
        grid = (meta.num_reqs, hq, triton.cdiv(max_q, BLOCK_M))
        _paged_attention_kernel[grid](
            q, k_cache, v_cache, out, meta.block_tables, seq_lens, query_start,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
            scale * k_scale, v_scale,
            GROUP=hq // hkv, BLOCK_SIZE=bs, BS_PAD=triton.next_power_of_2(bs), HEAD_DIM=d,
            D_PAD=triton.next_power_of_2(d), BLOCK_M=BLOCK_M)
        return out

