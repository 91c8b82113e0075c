"""A paged decode-attention kernel in C for CPUs, built with the system compiler on first use.

Decode attention with torch ops must first gather every request's K/V out of
the pages and copy it into a matmul-friendly layout: three passes over memory
for a few flops per byte. This kernel reads K/V in place from the pages, once,
from float32, bfloat16 or float8 e4m3 caches (an fp8 cache is converted in
registers: half the bytes of bf16 to read).
It is built per ISA level (kvserve/kernels: build.py, cpu.py) and loaded with ctypes;
when no C compiler is available the torch path is used instead.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math

import torch

from kvserve.kernels import build, cpu, qmatmul

logger = logging.getLogger(__name__)

_i64, _vp, _f32, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "paged_decode": [_vp, _vp, _vp, _vp, _vp, _i64, _vp, _i64, _i64, _i64, _i64, _i64, _i64, _f32, _f32, _int, _int,
                     _int],
    "dequant_blocks": [_vp, _vp, _i64, _i64, _f32, _vp, _int, _int],
    "write_fp8": [_vp, _int, _i64, _vp, _i64, _i64, _f32, _vp],
    "paged_prefill": [_vp, _int, _i64, _vp, _vp, _int, _vp, _vp, _i64, _vp, _vp, _vp, _i64, _i64, _i64, _i64, _i64,
                      _i64, _f32, _int, _int],
}


_lib: ctypes.CDLL | None = None
_tried = False


def load_kernel() -> ctypes.CDLL | None:
    """The compiled kernel (wide vectors on AVX-512), or None (no compiler, build failure, or
    KVSERVE_NO_C_KERNEL=1)."""
    global _lib, _tried
    if not _tried:  # called on every decode step: decide once
        _tried = True
        wide = ("-mprefer-vector-width=512",) if cpu.isa_level().startswith("avx512") else ()
        _lib = build.load_library("paged_decode", "paged_attention.c", _SIGNATURES, wide)
        if _lib is not None:
            _lib.prefill_vector_width.restype = ctypes.c_int64
            _lib.prefill_bf16_products.restype = ctypes.c_int
    return _lib


ROW_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2}  # load_row's kinds in c/paged_attention.c


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """q is float32 or bfloat16 on the CPU and the cache holds q's dtype, bfloat16 (a float32
    model's `kv_cache_dtype="bfloat16"`) or float8 e4m3 (fp8 KV cache)."""
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)
            and k_cache.dtype in (q.dtype, torch.bfloat16, torch.float8_e4m3fn)
            and load_kernel() is not None)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, max_len: int, scale: float, k_scale: float = 1.0,
                 v_scale: float = 1.0) -> torch.Tensor:
    """q [B, Hq, D] (one token per request) -> attention output [B, Hq, D].

    The caches hold K / k_scale and V / v_scale (scales are 1 unless the cache is fp8).
    """
    lib = load_kernel()
    assert lib is not None
    q = q.contiguous()
    tables = block_tables.contiguous()
    lens = seq_lens.contiguous()
    out = torch.empty_like(q)
    b, hq, d = q.shape
    lib.paged_decode(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                     tables.data_ptr(), tables.shape[1], lens.data_ptr(), b, hq, k_cache.shape[2], d,
                     k_cache.shape[1], max_len, scale * k_scale, v_scale, int(q.dtype == torch.bfloat16),
                     ROW_KIND[k_cache.dtype], torch.get_num_threads())
    return out


def supports_dequant(cache: torch.Tensor, dtype: torch.dtype) -> bool:
    """dequant_blocks handles this cache: float8 e4m3 on the CPU, read as float32 or bfloat16."""
    return (cache.device.type == "cpu" and cache.dtype == torch.float8_e4m3fn
            and dtype in (torch.float32, torch.bfloat16) and load_kernel() is not None)


def dequant_blocks(cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """cache [num_blocks, *block] float8 -> [len(block_ids), *block] in dtype, each code times scale."""
    lib = load_kernel()
    assert lib is not None
    cache = cache.contiguous()
    ids = block_ids.to(torch.int64).contiguous()
    elems = cache[0].numel()
    out = torch.empty((ids.numel(), *cache.shape[1:]), dtype=dtype)
    lib.dequant_blocks(cache.data_ptr(), ids.data_ptr(), ids.numel(), elems, scale, out.data_ptr(),
                       int(dtype == torch.bfloat16), torch.get_num_threads())
    return out


def supports_write(cache: torch.Tensor, x: torch.Tensor) -> bool:
    """write_fp8 handles this write: a float8 e4m3 cache on the CPU, x float32 or bfloat16."""
    return (cache.device.type == "cpu" and cache.dtype == torch.float8_e4m3fn and x.device.type == "cpu"
            and x.dtype in (torch.float32, torch.bfloat16) and load_kernel() is not None)


def write_fp8(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: float) -> None:
    """Store x [T, *row] as float8 codes of x / scale, saturated to +-448, at these slots of
    cache [num_blocks, block_size, *row]: quantize_fp8 and the scatter in one pass, bit-exact.
    Called twice per layer and step, so it avoids torch ops where an attribute check will do."""
    lib = load_kernel()
    assert lib is not None and cache.dtype == torch.float8_e4m3fn and cache.is_contiguous()
    width = math.prod(cache.shape[2:])
    # Rows of x may sit apart (K and V are column slices of the fused qkv output); within a row
    # the elements must be dense.
    if x.stride(-1) != 1 or any(x.stride(i) != math.prod(x.shape[i + 1:]) for i in range(1, x.dim() - 1)):
        x = x.contiguous()
    if slots.dtype != torch.int64 or not slots.is_contiguous():
        slots = slots.to(torch.int64).contiguous()
    lib.write_fp8(x.data_ptr(), int(x.dtype == torch.bfloat16), x.stride(0), slots.data_ptr(), slots.numel(),
                  width, 1.0 / scale, cache.data_ptr())


def supports_prefill(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """paged_prefill handles these: float32 or bfloat16 queries over a cache of their dtype or of
    bfloat16 (a float32 model's bfloat16 cache: its rows read as floats; an fp8 cache keeps the
    torch path, where a prefill without cached context attends to its unquantized K/V), a head
    size that is a whole number of the kernel's vectors, query heads dense within a token, and
    vector units (at the generic level, SSE2 or another architecture's 16-byte vectors,
    torch's SDPA is faster)."""
    return (supports(q, k_cache) and k_cache.dtype != torch.float8_e4m3fn and cpu.isa_level() != "generic"
            and q.shape[-1] % _lib.prefill_vector_width() == 0 and q.stride(-1) == 1 and q.stride(1) == q.shape[-1])


@functools.cache
def bf16_products() -> bool:
    """Whether paged_prefill can take its dot products in bfloat16 here: a build with them (AVX-512
    levels) on a CPU with AVX512-BF16 (vdpbf16ps). Asked once (paged_prefill asks on every call)."""
    lib = load_kernel()
    return lib is not None and bool(lib.prefill_bf16_products()) and "avx512_bf16" in cpu.cpu_flags()


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  starts: torch.Tensor, seq_lens: torch.Tensor, first: int, last: int, scale: float,
                  positions: torch.Tensor | None, out: torch.Tensor, bf16: bool = False, amx: bool | None = None
                  ) -> None:
    """Causal attention of requests [first, last) of a flat batch into their rows of out [T, Hq, D].

    q [T, Hq, D] float32 or bfloat16 (token rows may sit apart: a view of the fused qkv output), out
    of its dtype; request i's query tokens are rows [starts[i], starts[i + 1]) at positions[...]
    (None: the last ones of its seq_lens[i] positions); the caches [blocks, block_size, Hkv, D] hold
    q's dtype (or bfloat16) and already every position up to each query's own. Rows of out outside those
    requests are left alone. bf16: the products of Q K^T and P V in bfloat16, summed in float32
    (where bf16_products(); each input rounded to 8 significant bits once), on the AMX tiles where
    qmatmul.amx_ready() (amx=False: not even there) and the head size is a multiple of 32."""
    lib = load_kernel()
    assert lib is not None and out.is_contiguous() and out.dtype == q.dtype
    assert k_cache.dtype in (q.dtype, torch.bfloat16) and v_cache.dtype == k_cache.dtype
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    tables, starts, seq_lens = (t.to(torch.int64).contiguous() for t in (block_tables, starts, seq_lens))
    pos = None if positions is None else positions.to(torch.int64).contiguous()
    lib.paged_prefill(q.data_ptr(), int(q.dtype == torch.bfloat16), q.stride(0), k_cache.data_ptr(),
                      v_cache.data_ptr(), ROW_KIND[k_cache.dtype], out.data_ptr(), tables.data_ptr(), tables.shape[1],
                      starts.data_ptr(), seq_lens.data_ptr(), None if pos is None else pos.data_ptr(), first, last,
                      q.shape[1], k_cache.shape[2], q.shape[2], k_cache.shape[1], scale,
                      (2 if amx is not False and qmatmul.amx_ready() else 1) if bf16 and bf16_products() else 0,
                      torch.get_num_threads())
