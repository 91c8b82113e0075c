/* Paged decode attention from float32, bfloat16 or fp8 e4m3 caches, the fp8 KV write and the fp8
   block read (paged_attention.py). */
#include "common.h"
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
/* e4m3fn codes -> their values times 2^-8 as f32, exact for every finite code; callers fold
   the 2^8 into their scales. With AVX-512: a code sign-extended to 16 bits, shifted left by 7
   and bit 14 cleared is an IEEE half of the same sign and mantissa, exponent bias 15 instead of
   7 (hence 2^-8; e4m3 subnormals land on half subnormals), and one instruction (vcvtph2ps)
   turns 16 halves into floats: 4 instructions for 16 codes.
   Elsewhere: the 7 magnitude bits at bit 20 of a float with 120 added to the exponent for
   normal codes, m * 2^-9 for subnormal ones; no float denormal is ever multiplied (an x86
   microcode assist). */
static inline float fp8_to_f32_lo(uint8_t x) {
    const uint32_t mag = x & 0x7Fu;
    uint32_t u = (mag << 20) + (120u << 23);
    float f; memcpy(&f, &u, 4);
    f = (mag < 8u ? (float)mag * 0x1p-9f : f) * 0x1p-8f;
    memcpy(&u, &f, 4);
    u |= (uint32_t)(x & 0x80u) << 24;
    memcpy(&f, &u, 4);
    return f;
}
static inline void fp8_row_to_f32_lo(const uint8_t *src, int64_t n, float *dst) {
    int64_t i = 0;
#if defined(__AVX512F__) && defined(__AVX2__)
    const __m256i keep = _mm256_set1_epi16((short)0xBFFF);
    for (; i + 16 <= n; i += 16) {
        const __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(src + i)));
        _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_and_si256(_mm256_slli_epi16(w, 7), keep)));
    }
#endif
    #pragma omp simd
    for (int64_t j = i; j < n; ++j) dst[j] = fp8_to_f32_lo(src[j]);
}
/* The e4m3fn code of f, rounded to nearest even and saturated to +-448 (NaN stays NaN), as
   torch's clamp-then-cast. Normal results: round the f32 mantissa to 3 bits, then rebias the
   exponent field. Subnormal ones (|f| < 2^-6): adding 2^23 to |f| * 2^9 rounds it to the
   integer m in the low bits (code m, value m * 2^-9). Branch-free, so it vectorizes. */
static inline uint8_t f32_to_fp8(float f) {
    uint32_t u; memcpy(&u, &f, 4);
    float a = fabsf(f);
    const int nan = a != a;
    a = a > 448.f ? 448.f : a;
    uint32_t ua; memcpy(&ua, &a, 4);
    const uint32_t normal = ((ua + 0x7FFFFu + ((ua >> 20) & 1u)) >> 20) - (120u << 3);
    const float t = a * 512.f + 0x1p23f;
    uint32_t ut; memcpy(&ut, &t, 4);
    const uint32_t code = nan ? 0x7Fu : a < 0x1p-6f ? (ut & 0xFu) : normal;
    return (uint8_t)(((u >> 24) & 0x80u) | code);
}
enum { ROW_F32 = 0, ROW_BF16 = 1, ROW_FP8 = 2 };
static inline void load_row(const void *base, int64_t idx, int64_t d, int kind, float *dst) {
    if (kind == ROW_BF16) {
        const uint16_t *src = (const uint16_t *)base + idx;
        #pragma omp simd
        for (int64_t i = 0; i < d; ++i) dst[i] = bf16_to_f32(src[i]);
    } else if (kind == ROW_FP8) {
        const uint8_t *src = (const uint8_t *)base + idx;
        fp8_row_to_f32_lo(src, d, dst);
    } else {
        memcpy(dst, (const float *)base + idx, (size_t)d * sizeof(float));
    }
}

/* Bytes per element of a cache of this kind. */
static inline int64_t kind_bytes(int kind) { return kind == ROW_F32 ? 4 : kind == ROW_BF16 ? 2 : 1; }
/* The row at element idx of a cache of this kind. */
static inline const void *cache_row(const void *cache, int kind, int64_t idx) {
    return (const char *)cache + idx * kind_bytes(kind);
}
/* rows[i] = position t0 + i's row (i < n) of kv heads [kh0, kh0 + w / d) as floats: the cache's own
   row for a float32 cache, else converted into buf [n * w]; a conversion also asks for the row n
   positions on (below len), the next gather's. */
static void gather_rows(const void *cache, const int64_t *table, int64_t t0, int64_t n, int64_t len,
                        int64_t block_size, int64_t width, int64_t kh0, int64_t d, int64_t w, int kind,
                        const float **rows, float *buf) {
    int64_t b = t0 / block_size, o = t0 % block_size;
    for (int64_t i = 0; i < n; ++i) {
        const int64_t idx = (table[b] * block_size + o) * width + kh0 * d;
        if (kind == ROW_F32) {
            rows[i] = (const float *)cache + idx;
        } else {
            const int64_t p = t0 + i + n;
            if (p < len) {
                const char *next = cache_row(cache, kind, (table[p / block_size] * block_size + p % block_size) * width
                                                          + kh0 * d);
                for (int64_t c = 0; c < w * kind_bytes(kind); c += 64) __builtin_prefetch(next + c);
            }
            load_row(cache, idx, w, kind, buf + i * w);
            rows[i] = buf + i * w;
        }
        if (++o == block_size) { o = 0; ++b; }
    }
}
/* Rows come from blocks scattered in memory (the hardware prefetchers stop at page ends): each
   position's row is fetched PREFETCH_AHEAD positions before it is used. */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 8
#endif
static inline void prefetch_row(const float **rows, int64_t t, int64_t len, int64_t off, int64_t w) {
    if (t < len)
        for (int64_t c = 0; c < w; c += 16) __builtin_prefetch(rows[t] + off + c);  /* 16 floats: a line */
}
/* a . b over d floats. */
static inline float dot_row(const float *a, const float *b, int64_t d) {
    int64_t i = 0;
    float s = 0.f;
#if defined(__AVX2__)
    __m256 s0 = _mm256_setzero_ps(), s1 = s0;  /* two chains: half the FMA latency waited on */
    for (; i + 16 <= d; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    if (i + 8 <= d) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        i += 8;
    }
    s = hsum8(_mm256_add_ps(s0, s1));
#endif
    for (; i < d; ++i) s += a[i] * b[i];
    return s;
}
#if defined(__AVX2__)
/* The sums of 8 vectors' lanes, in lane order: (r0 .. r7) -> [sum r0, .., sum r7]. Each sum is
   r_i's own lanes added in one fixed tree, whichever vectors sit beside it. */
static inline __m256 hsum8x8(__m256 r0, __m256 r1, __m256 r2, __m256 r3, __m256 r4, __m256 r5, __m256 r6,
                             __m256 r7) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(r0, r1), _mm256_hadd_ps(r2, r3));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(r4, r5), _mm256_hadd_ps(r6, r7));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif
#if defined(__AVX512F__) && defined(__AVX2__)
static inline __m256 fold16(__m512 v) {  /* lanes i and i + 8 added */
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}
#endif
/* Positions a score group takes: their K rows are read while one query head's q stays in a
   register, and their 8 dot products are summed across lanes together (hsum8x8) instead of
   one horizontal sum each. */
#define SCORE_GROUP 8
/* scores[j * ld + t] = (q_j . rows[t][(j / g) * d ..]) * scale for t < n and the nh query heads j of
   qf [nh * d] (g heads per kv head). With AVX2, 8 positions at a time per head, q's 8 floats loaded
   once for the 8 rows (AVX-512: 16 floats, where d allows); a last group short of 8 reads its last
   row again for the missing ones, so a position's score is the same arithmetic wherever its
   group starts. Elsewhere one dot product at a time (dot_row). */
static void score_rows(const float *qf, const float **rows, int64_t n, int64_t d, int64_t nh, int64_t g,
                       float scale, float *scores, int64_t ld) {
#if defined(__AVX2__)
    if (d % 8 == 0) {
        const __m256 sc = _mm256_set1_ps(scale);
        for (int64_t t0 = 0; t0 < n; t0 += SCORE_GROUP) {
            const float *r[SCORE_GROUP];
            for (int p = 0; p < SCORE_GROUP; ++p) r[p] = rows[t0 + p < n ? t0 + p : n - 1];
            for (int64_t t = t0 + PREFETCH_AHEAD; t < t0 + PREFETCH_AHEAD + SCORE_GROUP && t < n; ++t)
                for (int64_t c = 0; c < (nh / g) * d; c += 16) __builtin_prefetch(rows[t] + c);
            for (int64_t j = 0; j < nh; ++j) {
                const float *q = qf + j * d;
                const int64_t off = (j / g) * d;
                __m256 s;
#if defined(__AVX512F__)
                if (d % 16 == 0) {
                    __m512 a[SCORE_GROUP];
                    for (int p = 0; p < SCORE_GROUP; ++p) a[p] = _mm512_setzero_ps();
                    for (int64_t i = 0; i < d; i += 16) {
                        const __m512 qv = _mm512_loadu_ps(q + i);
                        for (int p = 0; p < SCORE_GROUP; ++p)
                            a[p] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(r[p] + off + i), a[p]);
                    }
                    s = hsum8x8(fold16(a[0]), fold16(a[1]), fold16(a[2]), fold16(a[3]), fold16(a[4]), fold16(a[5]),
                                fold16(a[6]), fold16(a[7]));
                } else
#endif
                {
                    __m256 a[SCORE_GROUP];
                    for (int p = 0; p < SCORE_GROUP; ++p) a[p] = _mm256_setzero_ps();
                    for (int64_t i = 0; i < d; i += 8) {
                        const __m256 qv = _mm256_loadu_ps(q + i);
                        for (int p = 0; p < SCORE_GROUP; ++p)
                            a[p] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(r[p] + off + i), a[p]);
                    }
                    s = hsum8x8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]);
                }
                s = _mm256_mul_ps(s, sc);
                if (t0 + SCORE_GROUP <= n) {
                    _mm256_storeu_ps(scores + j * ld + t0, s);
                } else {
                    float tmp[SCORE_GROUP];
                    _mm256_storeu_ps(tmp, s);
                    memcpy(scores + j * ld + t0, tmp, sizeof(float) * (size_t)(n - t0));
                }
            }
        }
        return;
    }
#endif
    for (int64_t t = 0; t < n; ++t) {
        prefetch_row(rows, t + PREFETCH_AHEAD, n, 0, (nh / g) * d);
        for (int64_t j = 0; j < nh; ++j) scores[j * ld + t] = dot_row(qf + j * d, rows[t] + (j / g) * d, d) * scale;
    }
}
#if defined(__AVX2__)
/* out[j] [32] += sum_t p[j * ldp + t] v[t][..32] over n rows for H <= 2 heads that read the same
   rows: each row's 32 floats are loaded once for the H heads, 4H independent accumulator chains
   (3 heads would spill: 12 accumulators + 4 rows + 1 weight > 16 registers). */
static inline __attribute__((always_inline)) void weighted_rows_32(const int H, const float *p, int64_t ldp,
        int64_t n, const float **rows, int64_t off, float *out, int64_t ldo) {
    __m256 acc[2][4];
    for (int j = 0; j < H; ++j)
        for (int i = 0; i < 4; ++i) acc[j][i] = _mm256_loadu_ps(out + j * ldo + i * 8);
    for (int64_t t = 0; t < n; ++t) {
        const float *v = rows[t] + off;
        prefetch_row(rows, t + PREFETCH_AHEAD, n, off, 32);
        const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8), v2 = _mm256_loadu_ps(v + 16),
                     v3 = _mm256_loadu_ps(v + 24);
        for (int j = 0; j < H; ++j) {
            const __m256 pj = _mm256_broadcast_ss(p + j * ldp + t);
            acc[j][0] = _mm256_fmadd_ps(pj, v0, acc[j][0]);
            acc[j][1] = _mm256_fmadd_ps(pj, v1, acc[j][1]);
            acc[j][2] = _mm256_fmadd_ps(pj, v2, acc[j][2]);
            acc[j][3] = _mm256_fmadd_ps(pj, v3, acc[j][3]);
        }
    }
    for (int j = 0; j < H; ++j)
        for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + j * ldo + i * 8, acc[j][i]);
}
#endif
#if defined(__AVX512F__) && defined(__AVX2__)
/* weighted_rows_32's AVX-512 form: 64 floats of each row (4 registers) for H <= 4 heads, 4H
   accumulators. Each lane is the same fused multiply-adds in the same order as there. */
static inline __attribute__((always_inline)) void weighted_rows_64(const int H, const float *p, int64_t ldp,
        int64_t n, const float **rows, int64_t off, float *out, int64_t ldo) {
    __m512 acc[4][4];
    for (int j = 0; j < H; ++j)
        for (int i = 0; i < 4; ++i) acc[j][i] = _mm512_loadu_ps(out + j * ldo + i * 16);
    for (int64_t t = 0; t < n; ++t) {
        const float *v = rows[t] + off;
        prefetch_row(rows, t + PREFETCH_AHEAD, n, off, 64);
        const __m512 v0 = _mm512_loadu_ps(v), v1 = _mm512_loadu_ps(v + 16), v2 = _mm512_loadu_ps(v + 32),
                     v3 = _mm512_loadu_ps(v + 48);
        for (int j = 0; j < H; ++j) {
            const __m512 pj = _mm512_set1_ps(p[j * ldp + t]);
            acc[j][0] = _mm512_fmadd_ps(pj, v0, acc[j][0]);
            acc[j][1] = _mm512_fmadd_ps(pj, v1, acc[j][1]);
            acc[j][2] = _mm512_fmadd_ps(pj, v2, acc[j][2]);
            acc[j][3] = _mm512_fmadd_ps(pj, v3, acc[j][3]);
        }
    }
    for (int j = 0; j < H; ++j)
        for (int i = 0; i < 4; ++i) _mm512_storeu_ps(out + j * ldo + i * 16, acc[j][i]);
}
#endif
/* out[j] [d] (row stride d) += sum_t p[j * ldp + t] rows[t][off ..] over n rows, for the g heads j
   that share one kv head. */
static void weighted_rows(const float *p, int64_t ldp, const float **rows, int64_t off, int64_t n, int64_t d,
                          int64_t g, float *out) {
    int64_t i0 = 0;
#if defined(__AVX512F__) && defined(__AVX2__)
    for (; i0 + 64 <= d; i0 += 64)
        for (int64_t j = 0; j < g; j += 4) {
            switch (g - j) {
            case 1: weighted_rows_64(1, p + j * ldp, ldp, n, rows, off + i0, out + j * d + i0, d); break;
            case 2: weighted_rows_64(2, p + j * ldp, ldp, n, rows, off + i0, out + j * d + i0, d); break;
            case 3: weighted_rows_64(3, p + j * ldp, ldp, n, rows, off + i0, out + j * d + i0, d); break;
            default: weighted_rows_64(4, p + j * ldp, ldp, n, rows, off + i0, out + j * d + i0, d);
            }
        }
#endif
#if defined(__AVX2__)
    for (; i0 + 32 <= d; i0 += 32)
        for (int64_t j = 0; j < g; j += 2) {
            if (g - j >= 2) weighted_rows_32(2, p + j * ldp, ldp, n, rows, off + i0, out + j * d + i0, d);
            else weighted_rows_32(1, p + j * ldp, ldp, n, rows, off + i0, out + j * d + i0, d);
        }
#endif
    if (i0 == d) return;
    for (int64_t j = 0; j < g; ++j) {
        float *oj = out + j * d;
        for (int64_t t = 0; t < n; ++t) {
            const float pt = p[j * ldp + t], *v = rows[t] + off;
            #pragma omp simd
            for (int64_t i = i0; i < d; ++i) oj[i] += pt * v[i];
        }
    }
}
/* Positions gathered (and, for other dtypes than float32, converted) at a time: bounds the scratch. */
#define ROWS_CHUNK 256
/* ... of a cache whose rows are converted (bfloat16, fp8): few enough that they are still in L1 when
   used, so converting and using them take turns, the next rows' reads asked for meanwhile */
#define CONV_CHUNK 32
static inline int64_t chunk_rows(int kind) { return kind == ROW_F32 ? ROWS_CHUNK : CONV_CHUNK; }
/* Scratch floats attend_heads needs in buf for rows of w floats. */
static inline int64_t attend_buf_floats(int kind, int64_t w) { return kind == ROW_F32 ? 0 : CONV_CHUNK * w; }

/* Decode attention of one request's query heads that share kv heads [kh0, kh1): qf [hq * d]
   (f32), its block table and length; writes those heads of out [hq * d]. Scores are q.k * scale
   and the output is sum p v * v_scale, so an fp8 cache's per-layer scales cost nothing (fp8
   callers multiply both by 2^8 first: fp8_row_to_f32_lo's 2^-8). Float32 caches are read in
   place; others are converted CONV_CHUNK positions at a time. The scores take 8 positions' K rows
   at a time (score_rows: they stay in L1 for all the query heads); the softmax's exp is vectorized
   (vexpf); the output sums 32 floats (AVX-512: 64) in registers for 2 (4) heads per row read.
   Scratch: rows [ROWS_CHUNK], buf [attend_buf_floats], scores [(kh1 - kh0) * g * len]. */
static void attend_heads(const float *qf, const void *k_cache, const void *v_cache, const int64_t *table, int64_t len,
                         int64_t hq, int64_t hkv, int64_t d, int64_t block_size, int kv_kind, float scale,
                         float v_scale, int64_t kh0, int64_t kh1, float *out, const float **rows, float *buf,
                         float *scores) {
    const int64_t g = hq / hkv, width = hkv * d, w = (kh1 - kh0) * d, nh = (kh1 - kh0) * g, j0 = kh0 * g;
    const int64_t chunk = chunk_rows(kv_kind);
    for (int64_t c0 = 0; c0 < len; c0 += chunk) {
        const int64_t n = len - c0 < chunk ? len - c0 : chunk;
        gather_rows(k_cache, table, c0, n, len, block_size, width, kh0, d, w, kv_kind, rows, buf);
        score_rows(qf + j0 * d, rows, n, d, nh, g, scale, scores + c0, len);
    }
    for (int64_t j = 0; j < nh; ++j) {
        float *sj = scores + j * len, m = -INFINITY, sum = 0.f;
        #pragma omp simd reduction(max:m)
        for (int64_t t = 0; t < len; ++t) m = sj[t] > m ? sj[t] : m;
        #pragma omp simd reduction(+:sum)
        for (int64_t t = 0; t < len; ++t) { sj[t] = vexpf(sj[t] - m); sum += sj[t]; }
        const float inv = v_scale / sum;
        #pragma omp simd
        for (int64_t t = 0; t < len; ++t) sj[t] *= inv;
    }
    memset(out + j0 * d, 0, sizeof(float) * nh * d);
    for (int64_t c0 = 0; c0 < len; c0 += chunk) {
        const int64_t n = len - c0 < chunk ? len - c0 : chunk;
        gather_rows(v_cache, table, c0, n, len, block_size, width, kh0, d, w, kv_kind, rows, buf);
        for (int64_t kh = 0; kh < kh1 - kh0; ++kh)
            weighted_rows(scores + kh * g * len + c0, len, rows, kh * d, n, d, g, out + (j0 + kh * g) * d);
    }
}

/* q, out: [B, Hq, D] (f32, or bf16 if q_bf16); caches: [num_blocks, block_size, Hkv, D] of kv_kind;
   tables: [B, table_stride]. One task per request and kv head (attend_heads over the query heads
   that share it), so a single request's heads are spread over the threads too; a head's output
   is the same whichever task computes it. */
void paged_decode(const void *q, const void *k_cache, const void *v_cache, void *out,
                  const int64_t *tables, int64_t table_stride, const int64_t *seq_lens,
                  int64_t num_reqs, int64_t hq, int64_t hkv, int64_t d, int64_t block_size,
                  int64_t max_len, float scale, float v_scale, int q_bf16, int kv_kind, int num_threads) {
    if (kv_kind == ROW_FP8) { scale *= 256.f; v_scale *= 256.f; }  /* fp8_row_to_f32_lo's 2^-8 */
    const int64_t g = hq / hkv, gd = g * d;
    #pragma omp parallel num_threads(num_threads)
    {
        float *qf = malloc(sizeof(float) * hq * d);
        float *acc = malloc(sizeof(float) * hq * d);
        const float **rows = malloc(sizeof(float *) * ROWS_CHUNK);
        float *buf = malloc(sizeof(float) * (attend_buf_floats(kv_kind, d) + 1));
        float *scores = malloc(sizeof(float) * g * max_len);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_reqs * hkv; ++i) {
            const int64_t b = i / hkv, kh = i % hkv, o = b * hq * d + kh * gd;
            load_row(q, o, gd, q_bf16 ? ROW_BF16 : ROW_F32, qf + kh * gd);
            attend_heads(qf, k_cache, v_cache, tables + b * table_stride, seq_lens[b], hq, hkv, d, block_size,
                         kv_kind, scale, v_scale, kh, kh + 1, acc, rows, buf, scores);
            if (q_bf16) {
                uint16_t *dst = (uint16_t *)out + o;
                for (int64_t e = 0; e < gd; ++e) dst[e] = f32_to_bf16(acc[kh * gd + e]);
            } else {
                memcpy((float *)out + o, acc + kh * gd, sizeof(float) * gd);
            }
        }
        free(qf); free(acc); free(rows); free(buf); free(scores);
    }
}

/* cache row slots[t] = f32_to_fp8(x[t] * inv_scale) for the n rows of x (f32, or bf16 if x_bf16;
   width elements each, x_stride apart): an fp8 cache's write in one call instead of five torch ops. */
void write_fp8(const void *x, int x_bf16, int64_t x_stride, const int64_t *slots, int64_t n, int64_t width,
               float inv_scale, uint8_t *cache) {
    for (int64_t t = 0; t < n; ++t) {
        uint8_t *dst = cache + slots[t] * width;
        if (x_bf16) {
            const uint16_t *src = (const uint16_t *)x + t * x_stride;
            #pragma omp simd
            for (int64_t i = 0; i < width; ++i) dst[i] = f32_to_fp8(bf16_to_f32(src[i]) * inv_scale);
        } else {
            const float *src = (const float *)x + t * x_stride;
            #pragma omp simd
            for (int64_t i = 0; i < width; ++i) dst[i] = f32_to_fp8(src[i] * inv_scale);
        }
    }
}

/* out[i] = block ids[i] of an fp8 cache (elems codes per block) times scale, as f32 or bf16:
   the context of a prefill that reads the cache, in one pass (gather, convert and scale with
   torch ops take ~5x as long: its float8 conversion is scalar). */
void dequant_blocks(const uint8_t *cache, const int64_t *ids, int64_t n, int64_t elems, float scale, void *out,
                    int out_bf16, int num_threads) {
    scale *= 256.f;  /* fp8_row_to_f32_lo's 2^-8 */
    #pragma omp parallel num_threads(num_threads)
    {
        float *row = malloc(sizeof(float) * elems);
        #pragma omp for schedule(static)
        for (int64_t b = 0; b < n; ++b) {
            fp8_row_to_f32_lo(cache + ids[b] * elems, elems, row);
            if (out_bf16) {
                uint16_t *dst = (uint16_t *)out + b * elems;
                #pragma omp simd
                for (int64_t i = 0; i < elems; ++i) dst[i] = f32_to_bf16(row[i] * scale);
            } else {
                float *dst = (float *)out + b * elems;
                #pragma omp simd
                for (int64_t i = 0; i < elems; ++i) dst[i] = row[i] * scale;
            }
        }
        free(row);
    }
}

/* ---- Prefill attention (flash attention on the CPU) ----
   Causal attention of a prefill chunk's query tokens over their request's paged K/V (the cached
   context and the chunk's own, written before), read from the pages (float32 or bfloat16, each
   chunk's rows converted to float32 as they are copied): no gather of the context into a
   contiguous copy, no mask tensor, and the key chunks past every query of a tile are skipped.
   A task is one kv head of a request and a tile of TQ query tokens: its M = TQ * g query rows
   (token-major; g query heads share the kv head) go through the keys FA_N at a time with an online
   softmax (Dao et al. 2022). Scores are computed transposed, S[n][m] = k_n . q_m, so each key's
   element is one broadcast against query rows that sit in vector lanes (Qt [D][M], packed once per
   tile with the softmax scale folded in), and the softmax's max, exp and sums run down the columns
   vectorized across query rows. Register tiles: FA_R keys x 2 vectors of query rows for S, FA_R2
   query rows x FA_DV vectors of D for O += P V. Written with GCC vector extensions: one source
   for every ISA level, the width from the level. */
#if defined(__AVX512F__)
#define FA_VW 16
#define FA_R 8
#define FA_DV 4
#elif defined(__AVX2__)
#define FA_VW 8
#define FA_R 6
#define FA_DV 2
#else
#define FA_VW 4
#define FA_R 4
#define FA_DV 2
#endif
#define FA_R2 4
#define FA_MV 4  /* query rows per tile: FA_MV vectors */
#define FA_N (FA_R * 8)  /* keys per chunk */
typedef float fa_vec __attribute__((vector_size(FA_VW * 4), aligned(4), may_alias));
static inline fa_vec fa_load(const float *p) { return *(const fa_vec *)p; }
static inline void fa_store(float *p, fa_vec v) { *(fa_vec *)p = v; }
static inline fa_vec fa_splat(float x) { return (fa_vec){0} + x; }

/* S[n][c..c + 2 VW) for the FA_R keys n0.. (rows kr[n], d floats each): sum over e of kr[n][e] qt[e][c..]. */
static inline __attribute__((always_inline)) void fa_scores(const float *const *kr, const float *qt, int64_t m,
                                                            int64_t d, int64_t n0, int64_t c, float *s) {
    fa_vec acc[FA_R][2];
    for (int r = 0; r < FA_R; ++r) acc[r][0] = acc[r][1] = fa_splat(0.f);
    for (int64_t e = 0; e < d; ++e) {
        const fa_vec q0 = fa_load(qt + e * m + c), q1 = fa_load(qt + e * m + c + FA_VW);
        #pragma GCC unroll 16
        for (int r = 0; r < FA_R; ++r) {
            const fa_vec k = fa_splat(kr[n0 + r][e]);
            acc[r][0] += k * q0;
            acc[r][1] += k * q1;
        }
    }
    for (int r = 0; r < FA_R; ++r) {
        fa_store(s + (n0 + r) * m + c, acc[r][0]);
        fa_store(s + (n0 + r) * m + c + FA_VW, acc[r][1]);
    }
}
/* o[m0 + r][e0 .. e0 + DV VW) += sum over the n keys of p[n][m0 + r] vr[n][e0 ..], r < FA_R2. */
static inline __attribute__((always_inline)) void fa_pv(const int DV, const float *p, int64_t m, int64_t m0,
                                                        const float *const *vr, int64_t d, int64_t e0, int64_t n,
                                                        float *o) {
    fa_vec acc[FA_R2][FA_DV];
    for (int r = 0; r < FA_R2; ++r)
        for (int c = 0; c < DV; ++c) acc[r][c] = fa_load(o + (m0 + r) * d + e0 + c * FA_VW);
    for (int64_t t = 0; t < n; ++t) {
        fa_vec v[FA_DV];
        for (int c = 0; c < DV; ++c) {
            v[c] = fa_load(vr[t] + e0 + c * FA_VW);
#if defined(__x86_64__)
            __asm__("" : "+v"(v[c]));  /* loaded once into a register, not once per row as an FMA operand */
#endif
        }
        #pragma GCC unroll 8
        for (int r = 0; r < FA_R2; ++r) {
            const fa_vec w = fa_splat(p[t * m + m0 + r]);
            for (int c = 0; c < DV; ++c) acc[r][c] += w * v[c];
        }
    }
    for (int r = 0; r < FA_R2; ++r)
        for (int c = 0; c < DV; ++c) fa_store(o + (m0 + r) * d + e0 + c * FA_VW, acc[r][c]);
}

/* bfloat16 dot products (AVX512-BF16, chosen at run time: bf != 0 in fa_tile). vdpbf16ps adds the
   products of 16 pairs of bfloat16 into 16 float lanes, so the pairs are laid out along what each
   sum runs over: for S, Q as qb [d / 2][m][2] (a lane's two query elements e, e + 1) against a key's
   pair broadcast; for O += P V, V as vb [n / 2][d][2] (two keys' elements) against a query row's
   two probabilities pb [n / 2][m][2] broadcast. Sums stay float32; inputs are rounded to nearest
   even once. On Zen 4 one vdpbf16ps does the multiply-adds of two FMAs. */
#if defined(__AVX512F__) && defined(__GNUC__) && (defined(__clang__) || __GNUC__ >= 10)
#define FA_BF16 1
#define FA_BF16_TARGET __attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl")))
static inline __m512 fa_dpbf16(__m512 acc, __m512i a, uint32_t pair) FA_BF16_TARGET;
static inline __m512 fa_dpbf16(__m512 acc, __m512i a, uint32_t pair) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)_mm512_set1_epi32((int)pair));
}
/* 16 values at a (float32, or bfloat16 with src_bf16) as bfloat16, zero-extended to 32-bit lanes. */
FA_BF16_TARGET static inline __m512i fa_bf_lanes(const void *a, int src_bf16) {
    return _mm512_cvtepu16_epi32(src_bf16 ? _mm256_loadu_si256((const __m256i *)a)
                                          : (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps((const float *)a)));
}
/* dst [n] (as 32-bit words: n pairs) = (a[i], b[i]) as bfloat16 (rounded to nearest even from
   float32, copied from bfloat16), n a multiple of 16. */
FA_BF16_TARGET static void fa_bf_pairs(const void *a, const void *b, int src_bf16, int64_t n, uint16_t *dst) {
    const int64_t step = src_bf16 ? 2 : 4;  /* bytes per value */
    for (int64_t i = 0; i < n; i += 16) {
        const __m512i lo = fa_bf_lanes((const char *)a + i * step, src_bf16);
        const __m512i hi = fa_bf_lanes((const char *)b + i * step, src_bf16);
        _mm512_storeu_si512(dst + 2 * i, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
}
/* dst [n] = a as bfloat16 (as fa_bf_pairs), n a multiple of 16. */
FA_BF16_TARGET static void fa_bf_row(const void *a, int src_bf16, int64_t n, uint16_t *dst) {
    if (src_bf16) {
        memcpy(dst, a, (size_t)n * 2);
        return;
    }
    for (int64_t i = 0; i < n; i += 16)
        _mm256_storeu_si256((__m256i *)(dst + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps((const float *)a + i)));
}
/* s[n][m] for all np keys (a multiple of FA_R) of kb [np][d] against qb. */
FA_BF16_TARGET static void fa_bf_scores(const uint16_t *kb, const uint16_t *qb, int64_t m, int64_t d, int64_t np,
                                        float *s) {
    for (int64_t n0 = 0; n0 < np; n0 += FA_R)
        for (int64_t c = 0; c < m; c += 32) {
            __m512 acc[FA_R][2];
            for (int r = 0; r < FA_R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
            for (int64_t e2 = 0; e2 < d / 2; ++e2) {
                const __m512i q0 = _mm512_loadu_si512(qb + (e2 * m + c) * 2);
                const __m512i q1 = _mm512_loadu_si512(qb + (e2 * m + c + 16) * 2);
                for (int r = 0; r < FA_R; ++r) {
                    uint32_t k;
                    memcpy(&k, kb + (n0 + r) * d + 2 * e2, 4);
                    acc[r][0] = fa_dpbf16(acc[r][0], q0, k);
                    acc[r][1] = fa_dpbf16(acc[r][1], q1, k);
                }
            }
            for (int r = 0; r < FA_R; ++r) {
                _mm512_storeu_ps(s + (n0 + r) * m + c, acc[r][0]);
                _mm512_storeu_ps(s + (n0 + r) * m + c + 16, acc[r][1]);
            }
        }
}
/* o[r][..d] += sum over the np keys (even) of pb's row r against vb, for rows [0, rows4). */
FA_BF16_TARGET static void fa_bf_pv(const uint16_t *pb, int64_t m, int64_t rows4, const uint16_t *vb, int64_t d,
                                    int64_t np, float *o) {
    for (int64_t m0 = 0; m0 < rows4; m0 += FA_R2)
        for (int64_t e0 = 0; e0 < d; e0 += 16 * FA_DV) {
            const int dv = d - e0 >= 16 * FA_DV ? FA_DV : (int)((d - e0) / 16);
            __m512 acc[FA_R2][FA_DV];
            for (int r = 0; r < FA_R2; ++r)
                for (int c = 0; c < FA_DV; ++c)
                    acc[r][c] = c < dv ? _mm512_loadu_ps(o + (m0 + r) * d + e0 + 16 * c) : _mm512_setzero_ps();
            for (int64_t t2 = 0; t2 < np / 2; ++t2) {
                __m512i v[FA_DV];
                for (int c = 0; c < FA_DV; ++c)
                    v[c] = c < dv ? _mm512_loadu_si512(vb + (t2 * d + e0 + 16 * c) * 2) : _mm512_setzero_si512();
                for (int r = 0; r < FA_R2; ++r) {
                    uint32_t w;
                    memcpy(&w, pb + (t2 * m + m0 + r) * 2, 4);
                    for (int c = 0; c < FA_DV; ++c) acc[r][c] = fa_dpbf16(acc[r][c], v[c], w);
                }
            }
            for (int r = 0; r < FA_R2; ++r)
                for (int c = 0; c < dv; ++c) _mm512_storeu_ps(o + (m0 + r) * d + e0 + 16 * c, acc[r][c]);
        }
}
#if defined(__linux__)
/* The same products on AMX tiles (bf == 2; d a multiple of 32, np of 32): S tiles [16 keys][16 rows]
   = kb's 16 keys x 32 elements against qb's 16 element pairs x 16 rows; O tiles [16 rows][16 of d]
   += pa's 16 rows x 32 keys (P row-major: pb's pairs transposed) against vb's 16 key pairs x 16.
   The same bfloat16 inputs and float32 sums as the dot products above, in another order. */
#define FA_AMX 1
AMX_TARGET static void fa_amx_scores(const uint16_t *kb, const uint16_t *qb, int64_t m, int64_t d, int64_t np,
                                     float *s) {
    for (int64_t n0 = 0; n0 < np; n0 += 16)
        for (int64_t c = 0; c < m; c += 32) {
            _tile_zero(4); _tile_zero(5);
            for (int64_t e0 = 0; e0 < d; e0 += 32) {
                _tile_loadd(0, kb + n0 * d + e0, d * 2);
                _tile_loadd(2, qb + (e0 / 2 * m + c) * 2, m * 4);
                _tile_loadd(3, qb + (e0 / 2 * m + c + 16) * 2, m * 4);
                _tile_dpbf16ps(4, 0, 2); _tile_dpbf16ps(5, 0, 3);
            }
            _tile_stored(4, s + n0 * m + c, m * 4);
            _tile_stored(5, s + n0 * m + c + 16, m * 4);
        }
}
/* o[r][..d] += P V for rows [0, rows16) (a multiple of 16), P as pb [np / 2][m] pairs; pa: scratch
   for P row-major [m][np]. */
AMX_TARGET static void fa_amx_pv(const uint16_t *pb, uint16_t *pa, int64_t m, int64_t rows16, const uint16_t *vb,
                                 int64_t d, int64_t np, float *o) {
    for (int64_t t0 = 0; t0 < np / 2; t0 += 16)
        for (int64_t r0 = 0; r0 < rows16; r0 += 16)
            transpose16((const float *)pb + t0 * m + r0, m, (float *)pa + r0 * (np / 2) + t0, np / 2, 16);
    for (int64_t r0 = 0; r0 < rows16; r0 += 16)
        for (int64_t e0 = 0; e0 < d; e0 += 16) {
            _tile_loadd(4, o + r0 * d + e0, d * 4);
            for (int64_t k0 = 0; k0 < np; k0 += 32) {
                _tile_loadd(0, pa + r0 * np + k0, np * 2);
                _tile_loadd(2, vb + (k0 / 2 * d + e0) * 2, d * 4);
                _tile_dpbf16ps(4, 0, 2);
            }
            _tile_stored(4, o + r0 * d + e0, d * 4);
        }
}
#endif
#else
#define FA_BF16 0
#endif
#ifndef FA_AMX
#define FA_AMX 0
#endif
int prefill_bf16_products(void) { return FA_BF16; }

/* Scratch floats of one thread for rows of m query rows and head size d (fa_tile's layout: qt, s, o,
   kc, vc, mx, l, alpha, qp, a zero row, then the bfloat16 copies qb, kb, vb, pb and P row-major, pa). */
static inline int64_t fa_scratch_floats(int64_t m, int64_t d) {
    return d * m + FA_N * m + m * d + 2 * FA_N * d + 4 * m + d + (d * m + 2 * FA_N * d + 2 * FA_N * m + 1) / 2;
}

/* One task: kv head h, query tokens tok[0 .. nt) (rows of q at q_stride floats; their positions
   pos[]), each with the g query heads h * g ..; keys at positions 0 .. max pos through the block
   table. Writes those heads' rows of out (hq * d floats per token). */
static void fa_tile(const void *q, int q_bf16, int64_t q_stride, const int64_t *tok, const int64_t *pos, int64_t nt,
                    const void *k_cache, const void *v_cache, int kv_kind, const int64_t *table, int64_t block_size,
                    int64_t hq, int64_t hkv, int64_t d, int64_t h, int64_t m, float scale, int bf, void *out,
                    float *scratch) {
    const int64_t g = hq / hkv, rows = nt * g, width = hkv * d;
    float *qt = scratch, *s = qt + d * m, *o = s + FA_N * m, *kc = o + m * d, *vc = kc + FA_N * d;
    float *mx = vc + FA_N * d, *l = mx + m, *alpha = l + m, *qp = alpha + m, *zero = qp + m;
#if FA_BF16
    uint16_t *qb = (uint16_t *)(zero + d), *kb = qb + d * m, *vb = kb + FA_N * d, *pb = vb + FA_N * d;
    uint16_t *pa = pb + FA_N * m;
#endif
    int64_t lo = pos[0], hi = pos[0];
    for (int64_t t = 0; t < nt; ++t) { lo = pos[t] < lo ? pos[t] : lo; hi = pos[t] > hi ? pos[t] : hi; }
    for (int64_t r = 0; r < m; ++r) {  /* padded rows: zero queries that see every key */
        const int64_t t = r / g, at = r < rows ? tok[t] * q_stride + (h * g + r % g) * d : 0;
        qp[r] = r < rows ? (float)pos[t] : (float)hi;
        for (int64_t e = 0; e < d; ++e)
            qt[e * m + r] = r >= rows ? 0.f
                            : (q_bf16 ? bf16_to_f32(((const uint16_t *)q)[at + e]) : ((const float *)q)[at + e]) * scale;
        mx[r] = -INFINITY;
        l[r] = 0.f;
    }
    memset(zero, 0, sizeof(float) * d);  /* the padding keys' row (float32 or bfloat16 zeros) */
#if FA_BF16
    if (bf) {  /* qt [d][m] -> qb [d / 2][m][2] */
        for (int64_t e2 = 0; e2 < d / 2; ++e2)
            fa_bf_pairs(qt + 2 * e2 * m, qt + (2 * e2 + 1) * m, 0, m, qb + e2 * m * 2);
    }
#endif
    memset(o, 0, sizeof(float) * m * d);
    const int64_t len = hi + 1;
    const float *kr[FA_N], *vr[FA_N];  /* the chunk's K and V rows as float32 */
#if FA_BF16
    const void *vb_rows[FA_N];  /* its V rows as the pages hold them (bfloat16 products) */
#endif
    for (int64_t k0 = 0; k0 < len; k0 += FA_N) {
        const int64_t keys = bf == 2 ? 32 : FA_R;  /* np: a whole number of the products' key steps */
        const int64_t n = len - k0 < FA_N ? len - k0 : FA_N, np = (n + keys - 1) / keys * keys;
        for (int64_t t = 0; t < np; ++t) {  /* the chunk's K/V rows in the pages; zeros past its keys */
            const int64_t p = k0 + t;
            const int64_t idx = t < n ? (table[p / block_size] * block_size + p % block_size) * width + h * d : 0;
            const void *kp = t < n ? cache_row(k_cache, kv_kind, idx) : zero;
            const void *vp = t < n ? cache_row(v_cache, kv_kind, idx) : zero;
#if FA_BF16
            if (bf) {  /* K -> kb [np][d] now, V -> vb [np / 2][d][2] below */
                fa_bf_row(kp, kv_kind == ROW_BF16, d, kb + t * d);
                vb_rows[t] = vp;
                continue;
            }
#endif
            if (kv_kind == ROW_F32 || t >= n) {  /* read in place */
                kr[t] = kp;
                vr[t] = vp;
            } else {  /* a bfloat16 cache's rows converted into kc / vc */
                load_row(k_cache, idx, d, kv_kind, kc + t * d);
                load_row(v_cache, idx, d, kv_kind, vc + t * d);
                kr[t] = kc + t * d;
                vr[t] = vc + t * d;
            }
        }
#if FA_BF16
        if (bf) {
            for (int64_t t2 = 0; t2 < np / 2; ++t2)
                fa_bf_pairs(vb_rows[2 * t2], vb_rows[2 * t2 + 1], kv_kind == ROW_BF16, d, vb + t2 * d * 2);
#if FA_AMX
            if (bf == 2) fa_amx_scores(kb, qb, m, d, np, s);
            else
#endif
            fa_bf_scores(kb, qb, m, d, np, s);
        } else
#endif
        for (int64_t n0 = 0; n0 < np; n0 += FA_R)
            for (int64_t c = 0; c < m; c += 2 * FA_VW) fa_scores(kr, qt, m, d, n0, c, s);
        if (k0 + np - 1 > lo)  /* some key of the chunk lies past some query: mask it */
            for (int64_t t = 0; t < np; ++t) {
                const float kp = (float)(k0 + t);
                float *st = s + t * m;
                #pragma omp simd
                for (int64_t r = 0; r < m; ++r) st[r] = kp > qp[r] ? -INFINITY : st[r];
            }
        #pragma omp simd
        for (int64_t r = 0; r < m; ++r) alpha[r] = mx[r];
        for (int64_t t = 0; t < np; ++t) {
            const float *st = s + t * m;
            #pragma omp simd
            for (int64_t r = 0; r < m; ++r) mx[r] = st[r] > mx[r] ? st[r] : mx[r];
        }
        #pragma omp simd
        for (int64_t r = 0; r < m; ++r) alpha[r] = vexpf(alpha[r] - mx[r]);
        #pragma omp simd
        for (int64_t r = 0; r < m; ++r) l[r] *= alpha[r];
        for (int64_t t = 0; t < np; ++t) {
            float *st = s + t * m;
            #pragma omp simd
            for (int64_t r = 0; r < m; ++r) { st[r] = vexpf(st[r] - mx[r]); l[r] += st[r]; }
        }
        for (int64_t r = 0; r < rows; ++r) {
            #pragma omp simd
            for (int64_t e = 0; e < d; ++e) o[r * d + e] *= alpha[r];
        }
        const int64_t rows4 = (rows + FA_R2 - 1) / FA_R2 * FA_R2;
#if FA_BF16
        if (bf) {
            for (int64_t t2 = 0; t2 < np / 2; ++t2)
                fa_bf_pairs(s + 2 * t2 * m, s + (2 * t2 + 1) * m, 0, m, pb + t2 * m * 2);
#if FA_AMX
            if (bf == 2) fa_amx_pv(pb, pa, m, (rows + 15) / 16 * 16, vb, d, np, o);
            else
#endif
            fa_bf_pv(pb, m, rows4, vb, d, np, o);
            continue;
        }
#endif
        for (int64_t m0 = 0; m0 < rows4; m0 += FA_R2) {
            int64_t e0 = 0;
            for (; e0 + FA_DV * FA_VW <= d; e0 += FA_DV * FA_VW) fa_pv(FA_DV, s, m, m0, vr, d, e0, np, o);
            for (; e0 < d; e0 += FA_VW) fa_pv(1, s, m, m0, vr, d, e0, np, o);
        }
    }
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t t = r / g, j = r % g, at = tok[t] * hq * d + (h * g + j) * d;
        const float inv = 1.f / l[r];
        if (q_bf16) {
            uint16_t *dst = (uint16_t *)out + at;
            for (int64_t e = 0; e < d; ++e) dst[e] = f32_to_bf16(o[r * d + e] * inv);
        } else {
            float *dst = (float *)out + at;
            #pragma omp simd
            for (int64_t e = 0; e < d; ++e) dst[e] = o[r * d + e] * inv;
        }
    }
}

/* Rows of query tokens per tile for g heads per kv head: M = tile_tokens * g rows, padded to a
   multiple of 2 vectors. */
static int64_t prefill_tile_tokens(int64_t g) { return g >= FA_MV * FA_VW ? 1 : FA_MV * FA_VW / g; }
int64_t prefill_vector_width(void) { return FA_VW; }

/* Prefill attention of requests [r0, r1) of a flat batch. q [T, hq, d] float32 or bfloat16 (q_bf16;
   token rows q_stride elements apart), out [T, hq, d] contiguous, q's dtype; request i's query tokens
   are [starts[i], starts[i + 1]), at positions pos[starts[i] ..] (pos NULL: the last ones of its
   seq_lens[i] positions); K/V are caches [blocks, block_size, hkv, d] of kv_kind (ROW_F32 or
   ROW_BF16) that hold every position up to each query's own; scores are q.k * scale. bf16_products:
   the dot products in bfloat16 (float32 sums) where this build has them (prefill_bf16_products()). */
void paged_prefill(const void *q, int q_bf16, int64_t q_stride, const void *k_cache, const void *v_cache,
                   int kv_kind, void *out, const int64_t *tables, int64_t table_stride, const int64_t *starts,
                   const int64_t *seq_lens, const int64_t *pos, int64_t r0, int64_t r1, int64_t hq, int64_t hkv,
                   int64_t d, int64_t block_size, float scale, int bf16_products, int num_threads) {
    const int64_t g = hq / hkv, tq = prefill_tile_tokens(g);
    /* bf: 0 float32 products, 1 AVX512-BF16 dot products, 2 AMX tiles (asked for with 2) */
    const int bf = !(FA_BF16 && bf16_products && d % 16 == 0) ? 0 : FA_AMX && bf16_products == 2 && d % 32 == 0 ? 2 : 1;
    const int64_t m = (tq * g + 2 * FA_VW - 1) / (2 * FA_VW) * (2 * FA_VW);
    int64_t ntasks = 0, ntok = starts[r1] - starts[r0];
    for (int64_t i = r0; i < r1; ++i) ntasks += (starts[i + 1] - starts[i] + tq - 1) / tq * hkv;
    int64_t *task = malloc(sizeof(int64_t) * 3 * (ntasks + 1)), *tok = malloc(sizeof(int64_t) * (ntok + 1));
    int64_t *tpos = malloc(sizeof(int64_t) * (ntok + 1));
    int64_t nt = 0;
    /* Longest contexts last in each request (its latest tiles), so the dynamic schedule takes the
       costliest tiles first: tasks listed from the last tile down. */
    for (int64_t i = r0; i < r1; ++i) {
        const int64_t a = starts[i], b = starts[i + 1];
        for (int64_t t = a; t < b; ++t) {
            tok[t - starts[r0]] = t;
            tpos[t - starts[r0]] = pos ? pos[t] : seq_lens[i] - (b - a) + (t - a);
        }
        for (int64_t t0 = a + (b - a - 1) / tq * tq; t0 >= a; t0 -= tq)
            for (int64_t h = 0; h < hkv; ++h, ++nt) {
                task[3 * nt] = i; task[3 * nt + 1] = t0; task[3 * nt + 2] = h;
            }
    }
    #pragma omp parallel num_threads(num_threads)
    {
        float *scratch = malloc(sizeof(float) * fa_scratch_floats(m, d));
#if FA_AMX
        if (bf == 2) amx_tiles_16x64();
#endif
        #pragma omp for schedule(dynamic, 1)
        for (int64_t x = 0; x < ntasks; ++x) {
            const int64_t i = task[3 * x], t0 = task[3 * x + 1], h = task[3 * x + 2];
            const int64_t n = starts[i + 1] - t0 < tq ? starts[i + 1] - t0 : tq, off = t0 - starts[r0];
            fa_tile(q, q_bf16, q_stride, tok + off, tpos + off, n, k_cache, v_cache, kv_kind, tables + i * table_stride,
                    block_size, hq, hkv, d, h, m, scale, bf, out, scratch);
        }
#if FA_AMX
        if (bf == 2) amx_tiles_release();
#endif
        free(scratch);
    }
    free(task); free(tok); free(tpos);
}
