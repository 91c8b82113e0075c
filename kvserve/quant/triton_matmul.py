"""A Triton GEMM over group-quantized weights kept compact: y[M, N] = x[M, K] @ W.T with
W[n, k] = code[n, k] * scale[n, k // group] + offset[n, k // group].

The codes are read in place (uint8 [N, K]; 4-bit also packed two per byte, the low nibble
holding the even column: [N, K / 2]), so a call moves the compact weight once instead of
writing and re-reading a dequantized copy as the "dequantize" path of quant/linear.py does.

A K tile never straddles two groups (BLOCK_K divides the group, or the one group spans K), so
each tile multiplies x by the raw codes and applies the group's scale and offset afterwards:
    sum_k x[m,k] W[n,k] = scale[n,g] * sum_k x[m,k] code[n,k] + offset[n,g] * sum_k x[m,k].
Codes 0..255 are exact in fp16 / bf16 / fp32, so tl.dot runs on them as they are and the weight
is never rounded to the activation dtype (dequantizing the tile first would round it, and
would cost a multiply-add per weight where this costs two per output per tile).

Triton compiles for CUDA devices. On a CPU the kernel runs in Triton's interpreter
(TRITON_INTERPRET=1, set before this module is imported), which is how tests check it.
"""

from __future__ import annotations

import torch

from kvserve.config import triton_interpreting

try:
    import triton
    import triton.language as tl
except ImportError:  # supports() says no; quant/linear.py then dequantizes per call
    triton = None
else:
    _DOT_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) by the rows M. Decode-sized M reads the
# weight once for a few rows: narrow N tiles give more programs to spread over the GPU's SMs
# (N is 576-3072 on small models), long K tiles fewer loop steps. Prefill: square tiles, enough
# rows per program to reuse each code tile. Not tuned on a GPU yet (written on a CPU-only machine).
_CONFIGS = ((16, (16, 32, 128, 4, 3)), (256, (32, 32, 64, 4, 3)), (None, (64, 64, 64, 4, 3)))


def supports(in_features: int, group_size: int) -> bool:
    """Triton imports and a K tile of at least 16 (tl.dot's minimum) fits in one group."""
    return triton is not None and (group_size == in_features or group_size % 16 == 0)


if triton is not None:

    @triton.jit
    def _group_gemm_kernel(x_ptr, codes_ptr, scale_ptr, offset_ptr, y_ptr, M, N, K, group,
                           stride_xm, stride_cn, stride_sn, stride_ym,
                           PACKED: tl.constexpr, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """y[BLOCK_M rows, BLOCK_N outputs] of one program; see the module docstring."""
        # int64: offsets * strides pass 2^31 on large weights (an int8 LM head of 128k x 16k)
        offs_m = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        offs_n = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
        m_mask = offs_m < M
        n_mask = offs_n < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < K
            # x is 0 past K, so whatever the masked codes read there adds nothing
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                        mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            if PACKED:
                offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
                b = tl.load(codes_ptr + offs_n[:, None] * stride_cn + offs_b[None, :],
                            mask=n_mask[:, None] & (offs_b < K // 2)[None, :], other=0)
                q = tl.interleave(b & 15, b >> 4)  # [BLOCK_N, BLOCK_K], column k from byte k // 2
            else:
                q = tl.load(codes_ptr + offs_n[:, None] * stride_cn + offs_k[None, :],
                            mask=n_mask[:, None] & k_mask[None, :], other=0)
            part = tl.dot(x.to(DOT_DTYPE), tl.trans(q.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
            g = k0 // group
            s = tl.load(scale_ptr + offs_n * stride_sn + g, mask=n_mask, other=0.0)
            o = tl.load(offset_ptr + offs_n * stride_sn + g, mask=n_mask, other=0.0)
            xsum = tl.sum(x.to(tl.float32), axis=1)
            acc += part * s[None, :] + xsum[:, None] * o[None, :]
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=m_mask[:, None] & n_mask[None, :])


def matmul(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor,
           group: int) -> torch.Tensor:
    """x [M, K] (fp16 / bf16 / fp32) @ W.T -> [M, N] in x's dtype, W from uint8 codes [N, K]
    (or [N, K / 2] packed 4-bit) and float32 scale / offset [N, K / group].

    fp32 activations use input_precision="ieee": a GPU would otherwise round them to tf32.
    Triton's interpreter multiplies bfloat16 as raw bits, so there bf16 tiles are multiplied
    in float32 (same result: products of bf16 values and codes are exact in float32).
    """
    m, k = x.shape
    n = codes.shape[0]
    if not supports(k, group):
        raise ValueError(f"the Triton GEMM needs group_size % 16 == 0 or one group per row, got {group} (K={k})")
    x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    bm, bn, bk, warps, stages = next(c for top, c in _CONFIGS if top is None or m <= top)
    if group != k:
        bk = min(bk, group & -group)  # the largest power of two dividing the group
    dot_dtype = _DOT_DTYPES[x.dtype]
    if dot_dtype == tl.bfloat16 and triton_interpreting():
        dot_dtype = tl.float32
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _group_gemm_kernel[grid](x, codes, scale, offset, y, m, n, k, group,
                             x.stride(0), codes.stride(0), scale.stride(0), y.stride(0),
                             PACKED=codes.shape[1] != k, DOT_DTYPE=dot_dtype,
                             DOT_PRECISION="ieee" if dot_dtype == tl.float32 else "tf32",
                             BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages)
    return y
