"""A paged decode-attention kernel in C for CPUs, built with the system compiler on first use.

Decode attention with torch ops must first gather every request's K/V out of
the pages and copy it into a matmul-friendly layout: three passes over memory
for a few flops per byte. This kernel reads K/V in place from the pages, once.
It is loaded with ctypes (no torch headers, so it builds in about a second);
when no C compiler is available the torch path is used instead.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t x) {
    uint32_t u = ((uint32_t)x) << 16; float f; memcpy(&f, &u, 4); return f;
}
static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even */
    uint32_t u; memcpy(&u, &f, 4); u += 0x7FFFu + ((u >> 16) & 1u); return (uint16_t)(u >> 16);
}
static inline void load_row(const void *base, int64_t idx, int64_t d, int bf16, float *dst) {
    if (bf16) {
        const uint16_t *src = (const uint16_t *)base + idx;
        #pragma omp simd
        for (int64_t i = 0; i < d; ++i) dst[i] = bf16_to_f32(src[i]);
    } else {
        memcpy(dst, (const float *)base + idx, (size_t)d * sizeof(float));
    }
}

/* q, out: [B, Hq, D]; caches: [num_blocks, block_size, Hkv, D]; tables: [B, table_stride].
   One task per request, reading each position's K and V for all heads at once: a
   position's heads share cache lines, so splitting heads across tasks would fetch
   every line once per head. */
void paged_decode(const void *q, const void *k_cache, const void *v_cache, void *out,
                  const int64_t *tables, int64_t table_stride, const int64_t *seq_lens,
                  int64_t num_reqs, int64_t hq, int64_t hkv, int64_t d, int64_t block_size,
                  int64_t max_len, float scale, int bf16, int num_threads) {
    const int64_t g = hq / hkv, width = hkv * d;
    #pragma omp parallel num_threads(num_threads)
    {
        float *qf = malloc(sizeof(float) * hq * d);
        float *acc = malloc(sizeof(float) * hq * d);
        float *row = malloc(sizeof(float) * width);
        float *scores = malloc(sizeof(float) * hq * max_len);
        float *mx = malloc(sizeof(float) * hq);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t b = 0; b < num_reqs; ++b) {
            const int64_t len = seq_lens[b];
            const int64_t *table = tables + b * table_stride;
            load_row(q, b * hq * d, hq * d, bf16, qf);
            for (int64_t j = 0; j < hq; ++j) mx[j] = -INFINITY;
            for (int64_t t = 0; t < len; ++t) {
                const int64_t slot = table[t / block_size] * block_size + t % block_size;
                load_row(k_cache, slot * width, width, bf16, row);
                for (int64_t j = 0; j < hq; ++j) {
                    const float *qj = qf + j * d, *kj = row + (j / g) * d;
                    float s = 0.f;
                    #pragma omp simd reduction(+:s)
                    for (int64_t i = 0; i < d; ++i) s += qj[i] * kj[i];
                    s *= scale;
                    scores[j * max_len + t] = s;
                    if (s > mx[j]) mx[j] = s;
                }
            }
            for (int64_t j = 0; j < hq; ++j) {
                float *sj = scores + j * max_len, sum = 0.f;
                const float m = mx[j];
                #pragma omp simd reduction(+:sum)
                for (int64_t t = 0; t < len; ++t) { sj[t] = expf(sj[t] - m); sum += sj[t]; }
                const float inv = 1.f / sum;
                #pragma omp simd
                for (int64_t t = 0; t < len; ++t) sj[t] *= inv;
            }
            memset(acc, 0, sizeof(float) * hq * d);
            for (int64_t t = 0; t < len; ++t) {
                const int64_t slot = table[t / block_size] * block_size + t % block_size;
                load_row(v_cache, slot * width, width, bf16, row);
                for (int64_t j = 0; j < hq; ++j) {
                    const float p = scores[j * max_len + t], *vj = row + (j / g) * d;
                    float *aj = acc + j * d;
                    #pragma omp simd
                    for (int64_t i = 0; i < d; ++i) aj[i] += p * vj[i];
                }
            }
            if (bf16) {
                uint16_t *dst = (uint16_t *)out + b * hq * d;
                for (int64_t i = 0; i < hq * d; ++i) dst[i] = f32_to_bf16(acc[i]);
            } else {
                memcpy((float *)out + b * hq * d, acc, sizeof(float) * hq * d);
            }
        }
        free(qf); free(acc); free(row); free(scores); free(mx);
    }
}
"""

# fast-math lets expf and the reductions vectorize; -inf still has to mean -inf.
_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-ffast-math", "-fno-finite-math-only",
          "-fPIC"]
# Linked in a separate step without -ffast-math: a -ffast-math link adds crtfastmath.o,
# whose constructor turns on flush-to-zero for the whole process that loads the library.
_LINK_FLAGS = ["-shared", "-fopenmp"]
_lib: ctypes.CDLL | None = None
_tried = False


def _cache_dir() -> Path:
    root = os.environ.get("KVSERVE_CACHE_DIR") or os.path.join(Path.home(), ".cache", "kvserve")
    return Path(root) / "kernels"


def _cpu_id() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return platform.processor()


def _build() -> ctypes.CDLL | None:
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        return None
    key = hashlib.sha256("\0".join([_SOURCE, cc, *_FLAGS, *_LINK_FLAGS, _cpu_id()]).encode()).hexdigest()[:16]
    lib_path = _cache_dir() / f"paged_decode_{key}.so"
    if not lib_path.exists():
        lib_path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "paged_decode.c"
            src.write_text(_SOURCE)
            obj, tmp_lib = Path(tmp) / "paged_decode.o", Path(tmp) / "paged_decode.so"
            subprocess.run([cc, *_FLAGS, "-c", str(src), "-o", str(obj)], check=True, capture_output=True,
                           timeout=120)
            subprocess.run([cc, *_LINK_FLAGS, str(obj), "-o", str(tmp_lib), "-lm"], check=True,
                           capture_output=True, timeout=120)
            os.replace(tmp_lib, lib_path)  # atomic: concurrent builders never see half a file
    lib = ctypes.CDLL(str(lib_path))
    lib.paged_decode.restype = None
    i64, vp = ctypes.c_int64, ctypes.c_void_p
    lib.paged_decode.argtypes = [vp, vp, vp, vp, vp, i64, vp, i64, i64, i64, i64, i64, i64,
                                 ctypes.c_float, ctypes.c_int, ctypes.c_int]
    return lib


def load_kernel() -> ctypes.CDLL | None:
    """The compiled kernel, or None (no compiler, build failure, or KVSERVE_NO_C_KERNEL=1)."""
    global _lib, _tried
    if not _tried:
        _tried = True
        if os.environ.get("KVSERVE_NO_C_KERNEL") == "1":
            return None
        try:
            _lib = _build()
        except (OSError, subprocess.SubprocessError) as e:
            logger.warning("paged decode kernel unavailable, using torch ops: %s", e)
            _lib = None
    return _lib


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)
            and k_cache.dtype == q.dtype
            and load_kernel() is not None)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, max_len: int, scale: float) -> torch.Tensor:
    """q [B, Hq, D] (one token per request) -> attention output [B, Hq, D]."""
    lib = load_kernel()
    assert lib is not None
    q = q.contiguous()
    tables = block_tables.contiguous()
    lens = seq_lens.contiguous()
    out = torch.empty_like(q)
    b, hq, d = q.shape
    lib.paged_decode(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                     tables.data_ptr(), tables.shape[1], lens.data_ptr(), b, hq, k_cache.shape[2], d,
                     k_cache.shape[1], max_len, scale, int(q.dtype == torch.bfloat16),
                     torch.get_num_threads())
    return out
