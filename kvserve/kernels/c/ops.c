/* Fused float32 CPU ops for the decode step (ops.py): RMSNorm (with the residual add), rotary,
   SiLU-mul; the decode stack (decode_stack.c) uses their rows. */
#include "common.h"
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
/* out [n] = silu(g) * u, as g u times the sigmoid 1 / (1 + e^-g): written as g / (1 + e^-g), GCC
   computed the clamped case's g / (1 + e^88) as g times a denormal constant in every lane, a
   microcode assist per vector on Intel (prefill's silu_mul 15x slower). */
static inline void silu_mul_span(const float *g, const float *u, float *out, int64_t n) {
    #pragma omp simd
    for (int64_t i = 0; i < n; ++i) out[i] = g[i] * u[i] * (1.f / (1.f + vexpf(-g[i])));
}
/* out [n] = silu(gu[:n]) * gu[n:]. */
static inline void silu_mul_row(const float *gu, float *out, int64_t n) { silu_mul_span(gu, gu + n, out, n); }

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
