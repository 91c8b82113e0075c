"""Fused float32 CPU ops for the decode step: fewer torch calls per layer.

A decode step of a small model is dozens of tiny ops per layer, each a few microseconds of
dispatch for a few hundred floats of work. These do in one C call what took several:
  rms_norm: (x + residual) -> residual, RMSNorm(x + residual) * weight      (6-8 torch ops)
  rotary:   q and k rotated in place inside the fused qkv output             (2 x 6 torch ops)
  silu_mul: silu(gate) * up from the fused gate_up output                    (3 torch ops)
The same math as the torch code they replace (float32 throughout; only summation order
differs). Used for float32 tensors on the CPU when the library builds; torch ops otherwise.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from kvserve.worker.kernels import build

logger = logging.getLogger(__name__)

# Helpers every kernel source starts with (the decode stack compiles several sources as one, hence
# the include guard): e^x that `omp simd` loops vectorize (libm's expf is one call per element,
# most of the time of a softmax or SiLU), and an AVX2 horizontal sum.
COMMON_SOURCE = r"""
#ifndef KVSERVE_COMMON
#define KVSERVE_COMMON
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif
/* e^x, branch-free: n = round(x log2 e), r = x - n ln 2 in two parts (Cody-Waite), e^r by Cephes'
   degree-7 expf polynomial, times 2^n put into the exponent bits. Relative error ~2e-7 (a few
   float ulps); x is clamped to [-87, 88], so e^x never overflows and tiny results stay normal
   (e^-87 ~ 1.6e-38: nothing a softmax or SiLU sees). */
static inline float vexpf(float x) {
    x = x < -87.f ? -87.f : x > 88.f ? 88.f : x;
    const float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    float e = p * r * r + r + 1.f;
    int32_t u;
    memcpy(&u, &e, 4);
    u += (int32_t)n << 23;
    memcpy(&e, &u, 4);
    return e;
}
#endif
"""

SOURCE = COMMON_SOURCE + r"""
#include <math.h>
#include <stdint.h>

/* One row of each op; the exported functions below and the decode stack (decode_stack.py) loop
   over rows with them. */
/* out = norm(x (+ res)) * w; with res: res_out = x + res first. */
static inline void norm_row(const float *x, const float *res, float *res_out, const float *w, float *out, int64_t n,
                            float eps) {
    float ss = 0.f;
    if (res) {
        for (int64_t i = 0; i < n; ++i) { res_out[i] = x[i] + res[i]; ss += res_out[i] * res_out[i]; }
        x = res_out;
    } else {
        for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
    }
    const float s = 1.f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * s);
}
/* h heads of d values (head stride d) rotated in place: the two halves of each head (HF
   rotate_half) by c / s [d/2]. */
static inline void rotary_row(float *x, int64_t h, int64_t d, const float *c, const float *s) {
    const int64_t half = d / 2;
    for (int64_t j = 0; j < h; ++j) {
        float *a = x + j * d, *b = a + half;
        for (int64_t i = 0; i < half; ++i) {
            const float x1 = a[i], x2 = b[i];
            a[i] = x1 * c[i] - x2 * s[i];
            b[i] = x2 * c[i] + x1 * s[i];
        }
    }
}
/* out [n] = silu(gu[:n]) * gu[n:]. */
static inline void silu_mul_row(const float *gu, float *out, int64_t n) {
    const float *u = gu + n;
    #pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = gu[i] / (1.f + vexpf(-gu[i])) * u[i];
}

/* out[t] = norm(x[t] (+ res[t])) * w; with res: res_out[t] = x[t] + res[t] first. */
void rms_norm(const float *x, int64_t ldx, const float *res, float *res_out, const float *w, float *out,
              int64_t T, int64_t n, float eps, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (T >= 32)
    for (int64_t t = 0; t < T; ++t)
        norm_row(x + t * ldx, res ? res + t * n : 0, res ? res_out + t * n : 0, w, out + t * n, n, eps);
}

/* Rotate heads [0, h) of each row t of x (row stride ldx, head stride d) in place by cos / sin
   [T, d/2]. */
void rotary(float *x, int64_t ldx, int64_t T, int64_t h, int64_t d, const float *cos_, const float *sin_,
            int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (T >= 32)
    for (int64_t t = 0; t < T; ++t) rotary_row(x + t * ldx, h, d, cos_ + t * (d / 2), sin_ + t * (d / 2));
}

/* out [T, n] = silu(gu[:, :n]) * gu[:, n:] for gu [T, 2n]. */
void silu_mul(const float *gu, float *out, int64_t T, int64_t n, int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (T >= 32)
    for (int64_t t = 0; t < T; ++t) silu_mul_row(gu + t * 2 * n, out + t * n, n);
}
"""

_i64, _vp, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {
    "rms_norm": [_vp, _i64, _vp, _vp, _vp, _vp, _i64, _i64, ctypes.c_float, _int],
    "rotary": [_vp, _i64, _i64, _i64, _i64, _vp, _vp, _int],
    "silu_mul": [_vp, _vp, _i64, _i64, _int],
}
_lib: ctypes.CDLL | None = None


def load() -> ctypes.CDLL | None:
    """The compiled library (build.load_library), or None: callers then use torch ops."""
    global _lib
    _lib = build.load_library("ops", SOURCE, _SIGNATURES)
    return _lib


def usable(*tensors: torch.Tensor) -> bool:
    """Every tensor is float32 on the CPU, and the library is built."""
    return (all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)
            and (_lib is not None or load() is not None))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [T, n] with dense rows (a view when it already is)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x) * weight; with residual: (norm(x + residual) * weight, x + residual), as RMSNorm."""
    x2 = _rows(x)
    t, n = x2.shape
    out = torch.empty(x.shape)
    if residual is None:
        _lib.rms_norm(x2.data_ptr(), x2.stride(0), None, None, weight.data_ptr(), out.data_ptr(), t, n, eps,
                      torch.get_num_threads())
        return out
    r_in = _rows(residual)
    if r_in.stride(0) != n:
        r_in = r_in.contiguous()
    r_out = torch.empty(x.shape)
    _lib.rms_norm(x2.data_ptr(), x2.stride(0), r_in.data_ptr(), r_out.data_ptr(), weight.data_ptr(), out.data_ptr(),
                  t, n, eps, torch.get_num_threads())
    return out, r_out


def rotary_(x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate x [T, heads * head_dim] (rows may be strided, e.g. a column slice of qkv) in place;
    cos / sin hold [T, head_dim / 2] contiguous values."""
    assert x.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous()
    _lib.rotary(x.data_ptr(), x.stride(0), x.shape[0], heads, head_dim, cos.data_ptr(), sin.data_ptr(),
                torch.get_num_threads())


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2n] (contiguous) -> [T, n]."""
    gu = gate_up if gate_up.is_contiguous() else gate_up.contiguous()
    t, n2 = gu.shape
    out = torch.empty(t, n2 // 2)
    _lib.silu_mul(gu.data_ptr(), out.data_ptr(), t, n2 // 2, torch.get_num_threads())
    return out
