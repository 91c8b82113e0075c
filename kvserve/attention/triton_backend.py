"""The `triton` attention backend: Triton kernels for the KV write into paged blocks and for
paged attention over a flat batch of decodes and prefill chunks.

Every token's K/V is written into its block first (the backend contract; a slot < 0 is a padding
row of a captured batch and is skipped), so each query reads its whole context from the paged
cache: query i of a request with seq_len tokens after this step sits at position
seq_len - q_len + i and sees the keys at positions 0 .. that position.

Both attention kernels are tiles of tl.dot with an online softmax in float32:
- A program's rows are (query, head) pairs of one request and one KV head: the GROUP query heads
  that share the KV head are stacked into the M dimension, so each K/V tile is loaded once for
  all of them. Keys are walked in tiles of BLOCK_N positions, each row gathered through the block
  table (block = table[pos // block_size], slot pos % block_size), so a tile may span blocks of
  any size. tl.dot needs every dim >= 16: rows, keys and the head dim (to a power of two) are
  padded and masked.
- Prefill chunks (`_prefill_kernel`): one pass, PREFILL_ROWS rows per program.
- Decodes (the first num_decodes requests, one query each) split their context into NUM_SPLITS
  partitions (flash-decoding, vLLM's paged attention v2): `_decode_split_kernel` writes each
  partition's (max, sum, unnormalized output) to scratch and `_decode_reduce_kernel` combines them,
  so a long context is spread over many programs even in a small batch. NUM_SPLITS follows the
  block table's width (the longest context it can hold), never this step's lengths: a decode step
  launches the same grids for any seq_lens and reads no device value on the host, so it can be
  replayed from a CUDA graph (worker/cuda_graphs.py). A partition past a request's length is
  empty (max -inf, sum 0); a padding row (seq_len 0) reads nothing and comes out zeros.
- K/V are converted to the queries' dtype for tl.dot (a float8 cache: its codes, exact in bf16 or
  fp16, with the K scale folded into the softmax scale and the V scale into the output), and P to
  it for P.V. float32 queries multiply as float32 (input_precision ieee: no silent tf32). In
  Triton's interpreter every dot runs in float32 on the same (rounded) operands: its tl.dot
  multiplies bfloat16 as the integer bit patterns it stores them in (Triton 3.9).

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

BLOCK_N = 64  # key positions per tile
PREFILL_ROWS = 64  # (query, head) rows per prefill program
DECODE_ROWS = 16  # rows per decode program: one query's heads of a group, padded for tl.dot
MIN_PARTITION = 256  # decode positions per split at least: shorter splits cost more to combine
MAX_SPLITS = 16  # a power of two: the reduce kernel's tile (one compiled kernel whatever the split count)
LOG2E = 1.4426950408889634  # the kernels use exp2: scores are scaled into base 2


def num_splits(max_context: int) -> tuple[int, int]:
    """(splits, positions per split) of a decode whose block table holds up to max_context keys."""
    splits = max(1, min(MAX_SPLITS, max_context // MIN_PARTITION))
    return splits, triton.cdiv(triton.cdiv(max_context, splits), BLOCK_N) * BLOCK_N


if triton is not None:

    @triton.jit
    def _round_to_e4m3(y):
        """y (within +-448) rounded to the nearest float8 e4m3 value, ties to even, in float32, for
        Triton's interpreter, whose cast drops the carry when a rounding crosses a power of two
        (124 -> 64 instead of 128). Compiled, the cast itself rounds to nearest even (and log2 /
        exp2 are approximations there), so this runs in the interpreter only."""
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
                         HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, IS_FP8: tl.constexpr,
                         INTERPRETED: tl.constexpr):
        """cache[slot[t], h, :] = x[t, h, :] (as float8 codes of x * inv_scale for an fp8 cache)."""
        t = tl.program_id(0)
        h = tl.program_id(1)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:  # else a padding row: nothing to write
            offs = tl.arange(0, D_PAD)
            mask = offs < HEAD_DIM
            x = tl.load(x_ptr + t * stride_xt + h * stride_xh + offs, mask=mask, other=0.0).to(tl.float32)
            if IS_FP8:
                x = tl.minimum(tl.maximum(x * inv_scale, -448.0), 448.0)
                if INTERPRETED:
                    x = _round_to_e4m3(x)
            tl.store(cache_ptr + slot * stride_cs + h * stride_ch + offs, x.to(cache_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _dot(a, b, F32_DOT: tl.constexpr):
        """a @ b accumulated in float32, b converted to a's dtype (or both to float32)."""
        if F32_DOT:
            c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            c = tl.dot(a, b.to(a.dtype))
        return c

    @triton.jit
    def _attend(q, pos, lo, hi, k_cache, v_cache, table, kv_off, stride_cb, stride_cs, offs_d, d_mask, qk_scale,
                BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, F32_DOT: tl.constexpr):
        """(max, sum, unnormalized output) of the online softmax (base 2) of the rows q [M, D_PAD] over
        the keys at positions lo .. hi - 1 that each row sees (<= pos). Nothing past hi is read."""
        m_i = tl.full([q.shape[0]], float("-inf"), tl.float32)
        l_i = tl.zeros([q.shape[0]], tl.float32)
        acc = tl.zeros([q.shape[0], q.shape[1]], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            kpos = start + tl.arange(0, BLOCK_N)
            k_mask = kpos < hi
            block = tl.load(table + kpos // BLOCK_SIZE, mask=k_mask, other=0).to(tl.int64)
            rows = block * stride_cb + (kpos % BLOCK_SIZE) * stride_cs + kv_off  # [BLOCK_N]
            kt = tl.load(k_cache + rows[None, :] + offs_d[:, None], mask=d_mask[:, None] & k_mask[None, :], other=0.0)
            v = tl.load(v_cache + rows[:, None] + offs_d[None, :], mask=k_mask[:, None] & d_mask[None, :], other=0.0)
            s = _dot(q, kt, F32_DOT) * qk_scale  # [M, BLOCK_N]
            s = tl.where(k_mask[None, :] & (kpos[None, :] <= pos), s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + _dot(p.to(q.dtype), v, F32_DOT)
            m_i = m_new
        return m_i, l_i, acc

    @triton.jit
    def _prefill_kernel(q_ptr, k_cache, v_cache, out_ptr, block_tables, seq_lens, query_start, first_req,
                        stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
                        qk_scale, v_scale, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                        D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, F32_DOT: tl.constexpr):
        """out for a tile of request first_req + pid0's queries, all heads of KV head pid1."""
        r = first_req + tl.program_id(0)
        kvh = tl.program_id(1)
        tile = tl.program_id(2)
        QPT: tl.constexpr = BLOCK_M // GROUP  # queries per tile
        q_first = tl.load(query_start + r)
        q_len = tl.load(query_start + r + 1) - q_first
        if tile * QPT < q_len:
            seq_len = tl.load(seq_lens + r).to(tl.int32)
            offs_m = tl.arange(0, BLOCK_M)
            offs_d = tl.arange(0, D_PAD)
            d_mask = offs_d < HEAD_DIM
            qi = tile * QPT + offs_m // GROUP  # the row's query within the request
            head = kvh * GROUP + offs_m % GROUP
            mask = ((offs_m < QPT * GROUP) & (qi < q_len))[:, None] & d_mask[None, :]
            q = tl.load(q_ptr + (q_first + qi)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                        mask=mask, other=0.0)
            pos = seq_len - q_len + qi  # each row's position in its sequence
            hi = seq_len - q_len + tl.minimum(tile * QPT + QPT, q_len)  # past the tile's last query
            _, l_i, acc = _attend(q, pos[:, None], 0, hi, k_cache, v_cache, block_tables + r * stride_bt,
                                  kvh * stride_ch, stride_cb, stride_cs, offs_d, d_mask, qk_scale, BLOCK_SIZE, BLOCK_N,
                                  F32_DOT)
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * v_scale
            tl.store(out_ptr + (q_first + qi)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _decode_split_kernel(q_ptr, k_cache, v_cache, m_ptr, l_ptr, acc_ptr, block_tables, seq_lens, query_start,
                             stride_qt, stride_qh, stride_cb, stride_cs, stride_ch, stride_bt, qk_scale, part_len,
                             GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                             D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             F32_DOT: tl.constexpr):
        """Decode request pid0, the heads of KV head pid1, over split pid2 of its context: the
        partial (max, sum, output) to m/l/acc [num_decodes, Hq, splits(, D_PAD)]."""
        r = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        seq_len = tl.load(seq_lens + r).to(tl.int32)
        offs_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D_PAD)
        d_mask = offs_d < HEAD_DIM
        head = kvh * GROUP + offs_m
        m_mask = offs_m < GROUP
        q = tl.load(q_ptr + tl.load(query_start + r) * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                    mask=m_mask[:, None] & d_mask[None, :], other=0.0)
        lo = split * part_len
        m_i, l_i, acc = _attend(q, seq_len - 1, lo, tl.minimum(lo + part_len, seq_len), k_cache, v_cache,
                                block_tables + r * stride_bt, kvh * stride_ch, stride_cb, stride_cs, offs_d, d_mask,
                                qk_scale, BLOCK_SIZE, BLOCK_N, F32_DOT)
        idx = (r * tl.num_programs(1) * GROUP + head) * tl.num_programs(2) + split  # [r, head, split]
        tl.store(m_ptr + idx, m_i, mask=m_mask)
        tl.store(l_ptr + idx, l_i, mask=m_mask)
        tl.store(acc_ptr + idx[:, None] * D_PAD + offs_d[None, :], acc, mask=m_mask[:, None])

    @triton.jit
    def _decode_reduce_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, query_start, stride_ot, stride_oh, v_scale, splits,
                              S_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
        """out[decode pid0, head pid1]: its splits' partials combined; zeros where all are empty."""
        r = tl.program_id(0)
        h = tl.program_id(1)
        offs_s = tl.arange(0, S_PAD)
        offs_d = tl.arange(0, D_PAD)
        s_mask = offs_s < splits
        idx = (r * tl.num_programs(1) + h) * splits + offs_s
        m = tl.load(m_ptr + idx, mask=s_mask, other=float("-inf"))
        l = tl.load(l_ptr + idx, mask=s_mask, other=0.0)
        acc = tl.load(acc_ptr + idx[:, None] * D_PAD + offs_d[None, :], mask=s_mask[:, None], other=0.0)
        m_max = tl.max(m, axis=0)
        w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # an empty split weighs 0
        total = tl.sum(l * w, axis=0)
        out = tl.sum(acc * w[:, None], axis=0) / tl.where(total > 0, total, 1.0) * v_scale
        tl.store(out_ptr + tl.load(query_start + r) * stride_ot + h * stride_oh + offs_d,
                 out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)


@register_backend
class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self) -> None:
        if triton is None:
            raise ValueError("attention_backend triton needs the triton package (pip install triton)")
        self._meta: AttentionMetadata | None = None
        self._query_start: torch.Tensor | None = None

    def _query_start_tensor(self, meta: AttentionMetadata, device: torch.device) -> torch.Tensor:
        """meta.query_start_tensor, or query_start_loc copied to the device once per step (the
        metadata object is shared by every layer of the step)."""
        if meta.query_start_tensor is not None:
            return meta.query_start_tensor
        if self._meta is not meta or self._query_start is None or self._query_start.device != device:
            self._query_start = torch.tensor(meta.query_start_loc, dtype=torch.int32, device=device)
            self._meta = meta
        return self._query_start

    def _check_device(self, x: torch.Tensor) -> None:
        if x.device.type == "cpu" and not triton_interpreting():
            raise RuntimeError("the triton attention backend runs on a CUDA device; on a CPU only in Triton's "
                               "interpreter (TRITON_INTERPRET=1, for tests)")

    def write(self, cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: float) -> None:
        """Store x [T, Hkv, D] at these slots of cache [num_blocks, block_size, Hkv, D]; slots < 0 are skipped."""
        t, hkv, d = x.shape
        if t == 0:
            return
        flat = cache.view(-1, hkv, d)
        _kv_write_kernel[(t, hkv)](x, flat, slots, x.stride(0), x.stride(1), flat.stride(0), flat.stride(1),
                                   1.0 / scale if cache.dtype == FP8 else 1.0,
                                   HEAD_DIM=d, D_PAD=triton.next_power_of_2(d), IS_FP8=cache.dtype == FP8,
                                   INTERPRETED=triton_interpreting())

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
        hq, d = q.shape[1:]
        hkv = k_cache.shape[2]
        args = {  # both attention kernels take these
            "block_tables": meta.block_tables, "seq_lens": meta.seq_lens_tensor.to(q.device),
            "query_start": self._query_start_tensor(meta, q.device), "stride_qt": q.stride(0),
            "stride_qh": q.stride(1), "stride_cb": k_cache.stride(0), "stride_cs": k_cache.stride(1),
            "stride_ch": k_cache.stride(2), "stride_bt": meta.block_tables.stride(0),
            "qk_scale": scale * k_scale * LOG2E, "GROUP": hq // hkv, "BLOCK_SIZE": k_cache.shape[1],
            "HEAD_DIM": d, "D_PAD": max(16, triton.next_power_of_2(d)), "BLOCK_N": BLOCK_N,
            "F32_DOT": q.dtype == torch.float32 or triton_interpreting(),
            # K and V tiles of a 256-wide head at 3 stages would pass a GPU's shared memory
            "num_stages": 2 if d > 128 else 3}
        nd = meta.num_decodes
        if nd:
            self._decodes(q, k_cache, v_cache, out, meta, v_scale, args)
        if nd < meta.num_reqs:
            qsl = meta.query_start_loc
            max_q = max(b - a for a, b in zip(qsl[nd:], qsl[nd + 1:]))
            rows = max(PREFILL_ROWS, triton.next_power_of_2(hq // hkv))
            grid = (meta.num_reqs - nd, hkv, triton.cdiv(max_q, rows // (hq // hkv)))
            _prefill_kernel[grid](q, k_cache, v_cache, out, first_req=nd, stride_ot=out.stride(0),
                                  stride_oh=out.stride(1), v_scale=v_scale, BLOCK_M=rows, **args)
        return out

    def _decodes(self, q, k_cache, v_cache, out, meta: AttentionMetadata, v_scale: float, args: dict) -> None:
        """Into out: the first num_decodes requests, split-K. The grids and the scratch follow
        shapes only (the batch size, the table's width), never this step's lengths."""
        nd, hq, hkv, group = meta.num_decodes, q.shape[1], k_cache.shape[2], args["GROUP"]
        splits, part_len = num_splits(meta.block_tables.shape[1] * k_cache.shape[1])
        m = torch.empty(nd, hq, splits, dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)
        acc = torch.empty(nd, hq, splits, args["D_PAD"], dtype=torch.float32, device=q.device)
        _decode_split_kernel[(nd, hkv, splits)](q, k_cache, v_cache, m, l, acc, part_len=part_len,
                                                BLOCK_M=max(DECODE_ROWS, triton.next_power_of_2(group)), **args)
        _decode_reduce_kernel[(nd, hq)](m, l, acc, out, args["query_start"], out.stride(0), out.stride(1), v_scale,
                                        splits, S_PAD=MAX_SPLITS, HEAD_DIM=args["HEAD_DIM"], D_PAD=args["D_PAD"])
