/* GGUF K-quant rows read in place: y = x @ W.T for W in llama.cpp's Q4_K / Q5_K / Q6_K blocks, as
 * they lie in the file (no repacking, no float copy of the weight).
 *
 * Super-blocks of 256 weights along a row (fp16 scalars, little endian):
 *   Q6_K (210 bytes): ql[128], qh[64], int8 sc[16], d.  w = d sc[i] (q - 32) for 16-weight
 *     sub-blocks i; in each half of 128 weights (ql + 64h, qh + 32h), weight 32s + j takes its low
 *     4 bits from ql[j + 32 (s & 1)] (low nibble for s < 2, high for s >= 2) and its top 2 bits
 *     from qh[j] >> 2s.
 *   Q5_K (176 bytes): d, dmin, 12 bytes of 6-bit (sc, m) for 8 sub-blocks of 32, qh[32], qs[128].
 *     w = d sc q - dmin m; sub-block 2c has its low 4 bits in qs[32c + j]'s low nibble, 2c+1 in
 *     the high nibble, and the 5th bit of sub-block s is bit s of qh[j].
 *   Q4_K (144 bytes): Q5_K without qh. The loader gives Q4_K to qmatmul's blocks (factored
 *     scales, rows interleaved: about twice the weights per second of this kernel on Zen 3), also
 *     beside Q5_K / Q6_K parts (a stacked linear); it is read here only when handed over raw.
 *
 * Activations (kq_quantize): per token and 32-value block, int16 codes xq (scale xd = amax /
 * 32767: a product's error is ~1e-5 of its size) and xh = -32 * the sum of the codes of each
 * 16-value half, exact in float. xh is what centring Q6_K's codes (q - 32) subtracts, so the
 * kernel multiplies the codes as they are (0..63, unsigned); Q4_K / Q5_K take their mins from it
 * (over 32 values: xh[2b] + xh[2b+1] = -32 * the block's code sum). Every term of the sum thus uses
 * the same quantized x, so the error is that of x's rounding times the weights (centred), not
 * times the raw codes.
 *
 * AVX2: a block's 32 codes are built in a register from ql/qh (or qs/qh) and widened to int16 by
 * unpacking with zero, which interleaves in-lane (weights 0-7 and 16-23, then 8-15 and 24-31);
 * kq_quantize stores each activation block in that order, so no shuffle runs per weight row. The
 * products run as vpmaddwd, the second half's added by vpdpwssd where VNNI exists (common.h's
 * madd2_epi16; int32 sums: at most 4 x 63 x 32767, exact), are converted to float once per block
 * and scaled per sub-block; at one token Q6_K rows go two at a time (kq_q6k_row2), each activation
 * line read once for both. Q6_K parts whose rows come in 8s are regrouped by 8 rows at load
 * (KQ_Q6_KI, below), the layout decode reads fastest. Rows are split between OpenMP threads in
 * contiguous ranges. A plain C body (activations in natural order) serves the generic level, which
 * never sees KQ_Q6_KI (kq_q6k_interleave declines there).
 *
 * This file is also compiled into the decode stack (decode_stack.py), after other kernel sources:
 * every name is kq_ / KQ_ prefixed. */

#include <math.h>
#include <omp.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include "common.h"
#include "layout.h"

enum { KQ_Q4_K = 12, KQ_Q5_K = 13, KQ_Q6_K = 14 };  /* GGMLQuantizationType values */
/* Q6_K rows interleaved by 8 (below; no GGML type: kquant.py's own code for such a part). */
enum { KQ_Q6_KI = 114 };
/* An interleaved group of 8 rows (kq_q6k_interleave, below): offsets in its super-blocks. */
#define KQ_Q6I_BYTES 1680  /* a group's super-block */
#define KQ_Q6I_TOP 1024    /* offsets in it: tops, scales, d */
#define KQ_Q6I_SC 1536
#define KQ_Q6I_D 1664
#define KQ_MAX_PARTS 4
#define KQ_TILE 4  /* tokens per pass over a weight row: its blocks are decoded once per KQ_TILE tokens */

/* A weight [n, k]: parts of consecutive output rows, each rows x (k / 256) blocks of one type. */
typedef struct {
    int64_t qtype, rows;
    const uint8_t *data;
} KqPart;
typedef struct {
    int64_t nparts, k;
    KqPart part[KQ_MAX_PARTS];
} KqMatrix;

/* The structs' layout, so the ctypes mirrors (kquant.py) are checked against them (layout.h). */
KV_LAYOUT_TABLE(kq_layout,
    KV_LAYOUT_STRUCT(KqPart), KV_LAYOUT_FIELD(KqPart, qtype), KV_LAYOUT_FIELD(KqPart, rows),
    KV_LAYOUT_FIELD(KqPart, data),
    KV_LAYOUT_STRUCT(KqMatrix), KV_LAYOUT_FIELD(KqMatrix, nparts), KV_LAYOUT_FIELD(KqMatrix, k),
    KV_LAYOUT_FIELD(KqMatrix, part))

static inline int64_t kq_block_bytes(int64_t qtype) {
    return qtype == KQ_Q6_K || qtype == KQ_Q6_KI ? 210 : qtype == KQ_Q5_K ? 176 : 144;
}

static inline float kq_half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, man = h & 1023;
    uint32_t bits;
    float f;
    if (e == 31) bits = sign | 0x7f800000u | (man << 13);
    else if (e) bits = sign | ((e + 112) << 23) | (man << 13);
    else {  /* zero or subnormal: man * 2^-24, exact in float */
        f = (float)man * (1.f / 16777216.f);
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* Q4_K / Q5_K's 12 bytes -> 6-bit scales sc[0..7] and mins m[0..7] (llama.cpp's get_scale_min_k4). */
static inline void kq_scale_min(const uint8_t *s, uint8_t sc[8], uint8_t m[8]) {
    uint32_t u[3], o[4];
    memcpy(u, s, 12);
    o[0] = u[0] & 0x3f3f3f3fu;
    o[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    o[2] = u[1] & 0x3f3f3f3fu;
    o[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
    memcpy(sc, o, 8);
    memcpy(m, o + 2, 8);
}

/* A super-block's 256 codes (natural order), their 16 sub-block scales d sc (Q6_K) or 8 (Q4_K /
   Q5_K) and the 8 mins dmin m. */
static void kq_decode(int64_t qtype, const uint8_t *blk, uint8_t q[256], float scale[16], float mins[8]) {
    if (qtype == KQ_Q6_K) {
        const float d = kq_half(blk + 208);
        for (int i = 0; i < 16; ++i) scale[i] = d * (float)(int8_t)blk[192 + i];
        for (int h = 0; h < 2; ++h)
            for (int j = 0; j < 128; ++j) {
                const int s = j / 32, l = j % 32;
                const uint8_t lo = blk[64 * h + l + 32 * (s & 1)], hb = blk[128 + 32 * h + l];
                q[128 * h + j] = (uint8_t)(((s < 2 ? lo : lo >> 4) & 15) | (((hb >> (2 * s)) & 3) << 4));
            }
        return;
    }
    const int has_qh = qtype == KQ_Q5_K;
    const uint8_t *qs = blk + (has_qh ? 48 : 16);
    uint8_t sc[8], mn[8];
    kq_scale_min(blk + 4, sc, mn);
    const float d = kq_half(blk), dmin = kq_half(blk + 2);
    for (int s = 0; s < 8; ++s) {
        scale[s] = d * (float)sc[s];
        mins[s] = dmin * (float)mn[s];
        for (int l = 0; l < 32; ++l) {
            const uint8_t v = qs[32 * (s / 2) + l];
            q[32 * s + l] = (uint8_t)(((s & 1) ? v >> 4 : v & 15) | (has_qh ? ((blk[16 + l] >> s) & 1) << 4 : 0));
        }
    }
}

/* Where activation j of a 32-value block is stored: the AVX2 kernels' unpack order, else natural. */
#if defined(__AVX2__)
#define KQ_POS(j) (((j) & 7) | (((j) & 8) << 1) | (((j) & 16) >> 1))
#else
#define KQ_POS(j) (j)
#endif

/* Block i (of M x K / 32) of kq_quantize's output: the decode stack's threads share a call's blocks. */
static inline void kq_quantize_block(const float *x, int64_t ldx, int64_t K, int16_t *xq, float *xd, float *xh,
                                     int64_t i) {
    const int64_t nb = K / 32, m = i / nb, b = i % nb;
    const float *src = x + m * ldx + b * 32;
    float amax = 0.f;
    for (int j = 0; j < 32; ++j) { const float a = fabsf(src[j]); amax = a > amax ? a : amax; }
    const float id = amax > 0.f ? 32767.f / amax : 0.f;
    int16_t q[32];  /* natural order first: plain loops vectorize, a scattered store does not */
    int32_t h0 = 0, h1 = 0;
    for (int j = 0; j < 32; ++j) {
        const float v = src[j] * id;
        q[j] = (int16_t)(int)(v + (v >= 0.f ? .5f : -.5f));
    }
    for (int j = 0; j < 16; ++j) { h0 += q[j]; h1 += q[16 + j]; }
    int16_t *dst = xq + m * K + b * 32;
    for (int c = 0; c < 4; ++c) memcpy(dst + KQ_POS(8 * c), q + 8 * c, 16);
    xd[i] = amax / 32767.f;
    xh[2 * i] = -32.f * (float)h0;
    xh[2 * i + 1] = -32.f * (float)h1;
}
/* x [M, K] (row stride ldx) -> xq int16 [M, K], xd [M, K/32], xh [M, K/16] (see the top). */
static void kq_quantize(const float *x, int64_t ldx, int64_t M, int64_t K, int16_t *xq, float *xd, float *xh,
                        int nthreads) {
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (M * K >= 65536)
    for (int64_t i = 0; i < M * (K / 32); ++i) kq_quantize_block(x, ldx, K, xq, xd, xh, i);
}

#if defined(__AVX2__)
/* 32 codes (bytes 0..63) against one token's stored block: 8 int32 sums, lanes 0-3 from weights
   0-15 and lanes 4-7 from weights 16-31. */
static inline __m256i kq_dot(__m256i lo, __m256i hi, const int16_t *xv) {
    return madd2_epi16(lo, _mm256_loadu_si256((const __m256i *)xv), hi, _mm256_loadu_si256((const __m256i *)(xv + 16)));
}

/* Each super-block asks for the bytes KQ_AHEAD past it into L2 (T1), spread over the row as the
   kernel goes, rather than the whole row 4 KB ahead into L1 at its start: Q6_K from DRAM 18 -> 19.6
   GB/s at K = 8192, 27-28 -> 30-32 GB/s at K = 3072 (Zen 4, the variants alternating in one process).
   For the interleaved Q6_K (below), 113 MB from DRAM: 4 KB ahead 0.94x, 16 KB 0.93x of 8 KB's speed;
   6 KB, with the 4-bit kernels' IL_AHEAD (qmatmul.c), ran decode 1.5-5% faster than 8 KB at the
   slower memory speed. Past the weight's end a prefetch is a no-op. */
#ifndef KQ_AHEAD
#define KQ_AHEAD 6144
#endif
#ifndef KQ_HINT
#define KQ_HINT _MM_HINT_T1
#endif
static inline void kq_prefetch(const uint8_t *blk) {
    for (int o = 0; o < 256; o += 64) _mm_prefetch((const char *)blk + KQ_AHEAD + o, KQ_HINT);
}
/* A Q6_K super-block's d sc[i] for the sub-blocks 8h..8h+7 of half h. */
static inline __m256 kq_q6k_scales(const uint8_t *blk, int h) {
    const __m128i sc = _mm_loadu_si128((const __m128i *)(blk + 192));
    return _mm256_mul_ps(_mm256_set1_ps(kq_half(blk + 208)),
                         _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(h ? _mm_srli_si128(sc, 8) : sc)));
}
/* The 32 codes (0..63) of sub-block pair s4 of a half, from its ql bytes l0 / l1 and qh bytes hb
   (16-bit shifts: bits crossing into the neighbour byte are masked off). */
static inline __m256i kq_q6k_codes(__m256i l0, __m256i l1, __m256i hb, int s4) {
    const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30), l = s4 & 1 ? l1 : l0;
    const __m256i low = s4 < 2 ? _mm256_and_si256(l, m4) : _mm256_and_si256(_mm256_srli_epi16(l, 4), m4);
    const __m256i top = s4 == 0 ? _mm256_slli_epi16(hb, 4) : s4 == 1 ? _mm256_slli_epi16(hb, 2)
                      : s4 == 2 ? hb : _mm256_srli_epi16(hb, 2);
    return _mm256_or_si256(low, _mm256_and_si256(top, m30));
}
/* One Q6_K row (nsb super-blocks) against MT tokens; token t's activations at xq + t K, xd + t nb,
   xh + 2 t nb; y[t ldy]. */
static inline __attribute__((always_inline)) void kq_q6k_row(
        const int MT, const uint8_t *row, int64_t nsb, int64_t K, const int16_t *xq, const float *xd,
        const float *xh, float *y, int64_t ldy) {
    const int64_t nb = K / 32;
    const __m256i zero = _mm256_setzero_si256();
    const __m256i pair[2] = {_mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7)};
    /* two accumulators per token (one fma chain would wait on its latency), at any MT: a token's
       sum does not depend on its batch */
    __m256 acc[KQ_TILE][2];
    for (int t = 0; t < MT; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nsb; ++sb) {
        const uint8_t *blk = row + sb * 210, *ql = blk, *qh = blk + 128;
        kq_prefetch(blk);
        for (int h = 0; h < 2; ++h) {
            /* d sc[i] xd of sub-blocks 8h..8h+7, per token; the centring term joins acc here */
            const __m256 s = kq_q6k_scales(blk, h);
            __m256 sx[KQ_TILE];
            for (int t = 0; t < MT; ++t) {
                const __m256 xdv = _mm256_loadu_ps(xd + t * nb + sb * 8);
                sx[t] = _mm256_mul_ps(s, _mm256_permutevar8x32_ps(xdv, pair[h]));
                acc[t][0] = _mm256_fmadd_ps(sx[t], _mm256_loadu_ps(xh + 2 * t * nb + sb * 16 + 8 * h), acc[t][0]);
            }
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h));
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 64 * h + 32));
            const __m256i hb = _mm256_loadu_si256((const __m256i *)(qh + 32 * h));
            for (int s4 = 0; s4 < 4; ++s4) {
                const __m256i q = kq_q6k_codes(l0, l1, hb, s4);
                const __m256i lo = _mm256_unpacklo_epi8(q, zero), hi = _mm256_unpackhi_epi8(q, zero);
                const __m256i sel = _mm256_setr_epi32(2 * s4, 2 * s4, 2 * s4, 2 * s4, 2 * s4 + 1, 2 * s4 + 1,
                                                      2 * s4 + 1, 2 * s4 + 1);
                const int64_t b = sb * 8 + 4 * h + s4;
                for (int t = 0; t < MT; ++t) {
                    __m256 *a = &acc[t][s4 % 2];
                    *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(kq_dot(lo, hi, xq + t * K + b * 32)),
                                         _mm256_permutevar8x32_ps(sx[t], sel), *a);
                }
            }
        }
    }
    for (int t = 0; t < MT; ++t) y[t * ldy] = hsum8(_mm256_add_ps(acc[t][0], acc[t][1]));
}

/* One Q4_K (HAS_QH 0) or Q5_K (HAS_QH 1) row against MT tokens, as kq_q6k_row. */
static inline __attribute__((always_inline)) void kq_q45k_row(
        const int MT, const int HAS_QH, const uint8_t *row, int64_t nsb, int64_t K, const int16_t *xq,
        const float *xd, const float *xh, float *y, int64_t ldy) {
    const int64_t nb = K / 32, bytes = HAS_QH ? 176 : 144;
    const __m256i m4 = _mm256_set1_epi8(15), m10 = _mm256_set1_epi8(0x10), zero = _mm256_setzero_si256();
    __m256 acc[KQ_TILE][2];  /* as kq_q6k_row */
    for (int t = 0; t < MT; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nsb; ++sb) {
        const uint8_t *blk = row + sb * bytes, *qs = blk + (HAS_QH ? 48 : 16);
        kq_prefetch(blk);
        uint8_t sc[8], mn[8];
        kq_scale_min(blk + 4, sc, mn);
        const __m256 scv = _mm256_mul_ps(_mm256_set1_ps(kq_half(blk)),
                                         _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sc))));
        /* dmin m / 32 against xh (-32 x code sums) is the min term, -dmin m sum(x), with its sign */
        const __m256 mnv = _mm256_mul_ps(_mm256_set1_ps(kq_half(blk + 2) * (1.f / 32.f)),
                                         _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)mn))));
        __m256 sx[KQ_TILE];
        for (int t = 0; t < MT; ++t) {
            const __m256 xdv = _mm256_loadu_ps(xd + t * nb + sb * 8);
            const float *hp = xh + 2 * t * nb + sb * 16;
            /* pairwise sums come out as blocks 0 1 4 5 | 2 3 6 7; the 64-bit permute restores 0..7 */
            const __m256 pairs = _mm256_castpd_ps(_mm256_permute4x64_pd(
                _mm256_castps_pd(_mm256_hadd_ps(_mm256_loadu_ps(hp), _mm256_loadu_ps(hp + 8))), 0xD8));
            sx[t] = _mm256_mul_ps(scv, xdv);
            acc[t][0] = _mm256_fmadd_ps(_mm256_mul_ps(mnv, xdv), pairs, acc[t][0]);
        }
        /* bit s of qh moves to bit 4 by a running 16-bit shift: left by 4 first for s < 4, the raw
           bytes from s = 4 (a left shift by 4 would push the high byte's bits 4-7 out of the word) */
        const __m256i qh = HAS_QH ? _mm256_loadu_si256((const __m256i *)(blk + 16)) : zero;
        __m256i hb = _mm256_slli_epi16(qh, 4);
        for (int c = 0; c < 4; ++c) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(qs + 32 * c));
            if (c == 2) hb = qh;
            for (int e = 0; e < 2; ++e) {
                __m256i q = _mm256_and_si256(e ? _mm256_srli_epi16(v, 4) : v, m4);
                if (HAS_QH) {
                    q = _mm256_or_si256(q, _mm256_and_si256(hb, m10));
                    hb = _mm256_srli_epi16(hb, 1);
                }
                const __m256i lo = _mm256_unpacklo_epi8(q, zero), hi = _mm256_unpackhi_epi8(q, zero);
                const __m256i sel = _mm256_set1_epi32(2 * c + e);
                const int64_t b = sb * 8 + 2 * c + e;
                for (int t = 0; t < MT; ++t) {
                    __m256 *a = &acc[t][e];
                    *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(kq_dot(lo, hi, xq + t * K + b * 32)),
                                         _mm256_permutevar8x32_ps(sx[t], sel), *a);
                }
            }
        }
    }
    for (int t = 0; t < MT; ++t) y[t * ldy] = hsum8(_mm256_add_ps(acc[t][0], acc[t][1]));
}
/* Two Q6_K rows against one token (decode), every Q6_K row at M = 1 (an odd last row paired with
   itself): each activation line is read once for both rows. An 8192-wide row's activations (19 KB)
   do not stay in L1 beside the weights streaming through it, so one row at a time read them from
   L2 once per 32 weights, and ffn_down's Q6_K streamed at 18 GB/s where 3072-wide rows took 27.
   Without reassociation (GCC), the two rows' sums are formed alike, so a row's output does not
   depend on which of a pair it is, hence not on how rows were split between threads. */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("no-associative-math")))
#endif
static void kq_q6k_row2(const uint8_t *row0, const uint8_t *row1, int64_t nsb, const int16_t *xq, const float *xd,
                        const float *xh, float *y0, float *y1) {
    const __m256i zero = _mm256_setzero_si256();
    const __m256i pair[2] = {_mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3), _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7)};
    const uint8_t *rows[2] = {row0, row1};
    __m256 acc[2][2] = {{_mm256_setzero_ps(), _mm256_setzero_ps()}, {_mm256_setzero_ps(), _mm256_setzero_ps()}};
    for (int64_t sb = 0; sb < nsb; ++sb) {
        const uint8_t *blk[2] = {rows[0] + sb * 210, rows[1] + sb * 210};
        kq_prefetch(blk[0]);
        kq_prefetch(blk[1]);
        const __m256 xdv = _mm256_loadu_ps(xd + sb * 8);
        for (int h = 0; h < 2; ++h) {
            const __m256 xhv = _mm256_loadu_ps(xh + sb * 16 + 8 * h);
            __m256 sx[2];
            __m256i l0[2], l1[2], hb[2];
            for (int r = 0; r < 2; ++r) {
                sx[r] = _mm256_mul_ps(kq_q6k_scales(blk[r], h), _mm256_permutevar8x32_ps(xdv, pair[h]));
                acc[r][0] = _mm256_fmadd_ps(sx[r], xhv, acc[r][0]);
                l0[r] = _mm256_loadu_si256((const __m256i *)(blk[r] + 64 * h));
                l1[r] = _mm256_loadu_si256((const __m256i *)(blk[r] + 64 * h + 32));
                hb[r] = _mm256_loadu_si256((const __m256i *)(blk[r] + 128 + 32 * h));
            }
            for (int s4 = 0; s4 < 4; ++s4) {
                const int64_t b = sb * 8 + 4 * h + s4;
                const __m256i x0 = _mm256_loadu_si256((const __m256i *)(xq + b * 32));
                const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xq + b * 32 + 16));
                const __m256i sel = _mm256_setr_epi32(2 * s4, 2 * s4, 2 * s4, 2 * s4, 2 * s4 + 1, 2 * s4 + 1,
                                                      2 * s4 + 1, 2 * s4 + 1);
                for (int r = 0; r < 2; ++r) {
                    const __m256i q = kq_q6k_codes(l0[r], l1[r], hb[r], s4);
                    const __m256i d = madd2_epi16(_mm256_unpacklo_epi8(q, zero), x0, _mm256_unpackhi_epi8(q, zero), x1);
                    acc[r][s4 % 2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_permutevar8x32_ps(sx[r], sel),
                                                     acc[r][s4 % 2]);
                }
            }
        }
    }
    *y0 = hsum8(_mm256_add_ps(acc[0][0], acc[0][1]));
    *y1 = hsum8(_mm256_add_ps(acc[1][0], acc[1][1]));
}

/* Q6_K rows interleaved by 8 (KQ_Q6_KI): kquant.py's interleave rewrites a Q6_K part whose rows are
   a multiple of 8 into groups of 8 rows, super-block by super-block, in the same bytes (8 x 210 per
   group and super-block): the 4-bit low parts of the codes as qmatmul's interleaved 4-bit blocks
   (per 32-weight block 4 chunks of 32 bytes, chunk c's byte 4 i + j: row i's weights 4c + j in the
   low nibble and 16 + 4c + j in the high one), the 2-bit tops in two more chunks per block (byte
   4 i + j of plane p, bits 2q..2q+1: the top of the weight that code register 4p + q holds, below),
   then the 16 sub-block scales [16][8 rows] and d [8 rows] (KQ_Q6I_*, above). One token's int16 codes, split into
   bytes as qmatmul's 4-bit kernel takes them, are broadcast 4 at a time against a register of 8
   rows' codes, so the codes are built once per 8 rows rather than once per row and token: per block
   and 8 rows 16 dpbusd (VNNI) where kq_q6k_row2 spends ~12 operations per row. Read from DRAM on
   Zen 4 (2 threads, 8192-wide and 3072-wide weights): 33-35 GB/s against kq_q6k_row2's 21-26. */
/* Block j of a group's super-block o as 8 registers of codes (0..63): w[2c + e] holds, in lane i,
   row i's weights 16 e + 4 c + 0..3. */
static inline void kq_q6i_codes(const uint8_t *o, int j, __m256i w[8]) {
    const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
    const __m256i h[2] = {_mm256_loadu_si256((const __m256i *)(o + KQ_Q6I_TOP + 64 * j)),
                          _mm256_loadu_si256((const __m256i *)(o + KQ_Q6I_TOP + 64 * j + 32))};
    for (int k = 0; k < 8; ++k) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(o + 128 * j + 32 * (k >> 1)));
        const __m256i low = k & 1 ? _mm256_and_si256(_mm256_srli_epi16(v, 4), m4) : _mm256_and_si256(v, m4);
        const __m256i hp = h[k >> 2];  /* top bits 2q..2q+1 to bits 4..5 (16-bit shifts, then masked) */
        const int q = k & 3;
        const __m256i top = q == 0 ? _mm256_slli_epi16(hp, 4) : q == 1 ? _mm256_slli_epi16(hp, 2)
                          : q == 2 ? hp : _mm256_srli_epi16(hp, 2);
#if defined(__AVX512VL__)
        w[k] = _mm256_ternarylogic_epi32(low, top, m30, 0xF8);  /* low | (top & 0x30) */
#else
        w[k] = _mm256_or_si256(low, _mm256_and_si256(top, m30));
#endif
    }
}
/* The 8 rows' sums of codes x int16 codes over each 16-weight half of a block (s[0]: weights 0-15,
   s[1]: 16-31), from the codes' low bytes lo (unsigned) and high bytes hi (signed), natural order:
   sum(q x) = sum(q lo) + 256 sum(q hi), exact in int32 (at most 16 x 63 x 32768). Without VNNI
   each maddubs of lo (pairs up to 2 x 255 x 63) is widened alone; hi's pairs (2 x 63 x 128) two at
   a time. */
static inline void kq_q6i_sums(const __m256i w[8], const uint8_t *lo, const int8_t *hi, __m256i s[2]) {
    const int32_t *l4 = (const int32_t *)lo, *h4 = (const int32_t *)hi;
    for (int e = 0; e < 2; ++e) {
#if HAS_VNNI
        __m256i sl = _mm256_setzero_si256(), sh = _mm256_setzero_si256();
        for (int c = 0; c < 4; ++c) {
            sl = dpbusd(sl, _mm256_set1_epi32(l4[4 * e + c]), w[2 * c + e]);
            sh = dpbusd_bcast(sh, w[2 * c + e], h4 + 4 * e + c);
        }
#else
        const __m256i ones = _mm256_set1_epi16(1);
        __m256i sl = _mm256_setzero_si256(), sh = _mm256_setzero_si256();
        for (int c = 0; c < 4; ++c)
            sl = _mm256_add_epi32(sl, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi32(l4[4 * e + c]),
                                                                             w[2 * c + e]), ones));
        for (int c = 0; c < 4; c += 2)
            sh = _mm256_add_epi32(sh, _mm256_madd_epi16(_mm256_add_epi16(
                _mm256_maddubs_epi16(w[2 * c + e], _mm256_set1_epi32(h4[4 * e + c])),
                _mm256_maddubs_epi16(w[2 * c + 2 + e], _mm256_set1_epi32(h4[4 * e + c + 1]))), ones));
#endif
        s[e] = _mm256_add_epi32(sl, _mm256_slli_epi32(sh, 8));
    }
}
/* One group (nsb super-blocks at wg) against T tokens (1..8: a constant): token t's bytes at
   lo / hi + t K, its centring terms c32 (-32 x each half's code sum) at + 2 t nb, scales xd at
   + t nb. Per token and row: half 0 of every block into one accumulator, half 1 into another, each
   (sum + c32) by d sc xd; the block's codes are built once for all T tokens and each token's
   operations do not depend on T, so a token's 8 outputs have the bits it gets alone. */
static inline __attribute__((always_inline)) void kq_q6i_tile(
        const int T, const uint8_t *wg, int64_t nsb, int64_t K, const uint8_t *lo, const int8_t *hi,
        const int32_t *c32, const float *xd, __m256 *out) {
    const int64_t nb = K / 32;
    __m256 acc[2][8];
    for (int t = 0; t < T; ++t) acc[0][t] = acc[1][t] = _mm256_setzero_ps();
    for (int64_t sb = 0; sb < nsb; ++sb) {
        const uint8_t *o = wg + sb * KQ_Q6I_BYTES;
        for (int off = 0; off < KQ_Q6I_BYTES; off += 64) _mm_prefetch((const char *)o + KQ_AHEAD + off, KQ_HINT);
        const __m256 D = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + KQ_Q6I_D)));
        for (int j = 0; j < 8; ++j) {
            const int64_t b = sb * 8 + j;
            __m256i w[8];
            kq_q6i_codes(o, j, w);
            const __m256 sc[2] = {
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(o + KQ_Q6I_SC + 16 * j)))),
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(o + KQ_Q6I_SC + 16 * j + 8))))};
            for (int t = 0; t < T; ++t) {
                __m256i s[2];
                kq_q6i_sums(w, lo + t * K + b * 32, hi + t * K + b * 32, s);
                __m256 f = _mm256_mul_ps(D, _mm256_set1_ps(xd[t * nb + b]));
                __asm__("" : "+x"(f));  /* d xd as computed, in every T's loop (see il_k_scaled) */
                for (int e = 0; e < 2; ++e) {
                    const __m256i v = _mm256_add_epi32(s[e], _mm256_set1_epi32(c32[2 * (t * nb + b) + e]));
                    acc[e][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_mul_ps(sc[e], f), acc[e][t]);
                }
            }
        }
    }
    for (int t = 0; t < T; ++t) {
        __m256 a = acc[0][t];
        __asm__("" : "+x"(a));
        out[t] = _mm256_add_ps(a, acc[1][t]);
    }
}
/* A per-thread byte buffer kept between calls (as qmatmul's split_scratch): kq_q6i_rows' split
   activations, kq_linear_int8's unit copy. */
static uint8_t *kq_scratch(size_t n) {
    static __thread uint8_t *buf;
    static __thread size_t cap;
    if (n > cap) {
        free(buf);
        buf = malloc(n);
        cap = buf ? n : 0;
    }
    return buf;
}
#define KQ_Q6I_CASE(T) case T: kq_q6i_tile(T, wg, nsb, K, lo + m0 * K, hi + m0 * K, c32 + 2 * m0 * nb, xd + m0 * nb, out); break;
/* Rows [a, e) of an interleaved part (groups at data) for M tokens given as kq_quantize's, into
   y + row (row stride ldy): whole groups, tokens 8 at a time; a group cut by a or e computes its
   8 rows and keeps those inside (each row's lane is computed alone, so the same bits). */
static void kq_q6i_rows(const uint8_t *data, int64_t K, const int16_t *xq, const float *xd, const float *xh,
                        int64_t M, float *y, int64_t ldy, int64_t a, int64_t e) {
    const int64_t nb = K / 32, nsb = K / 256;
    uint8_t *lo = kq_scratch((size_t)(M * K) * 2 + sizeof(int32_t) * (size_t)(2 * M * nb));
    if (!lo) abort();
    int8_t *hi = (int8_t *)lo + M * K;
    int32_t *c32 = (int32_t *)(lo + 2 * M * K);
    /* kq_quantize's order (KQ_POS: 0-7 16-23 | 8-15 24-31) back to natural, as bytes: the packs
       work per 128-bit lane, which is that order's undoing */
    const __m256i m8 = _mm256_set1_epi16(255);
    for (int64_t i = 0; i < M * nb; ++i) {
        const __m256i u = _mm256_loadu_si256((const __m256i *)(xq + i * 32));
        const __m256i v = _mm256_loadu_si256((const __m256i *)(xq + i * 32 + 16));
        _mm256_storeu_si256((__m256i *)(lo + i * 32), _mm256_packus_epi16(_mm256_and_si256(u, m8), _mm256_and_si256(v, m8)));
        _mm256_storeu_si256((__m256i *)(hi + i * 32), _mm256_packs_epi16(_mm256_srai_epi16(u, 8), _mm256_srai_epi16(v, 8)));
    }
    for (int64_t i = 0; i < 2 * M * nb; ++i) c32[i] = (int32_t)xh[i];  /* -32 x an integer, exact in float */
    for (int64_t g = a >> 3; g * 8 < e; ++g) {
        const uint8_t *wg = data + g * nsb * KQ_Q6I_BYTES;
        for (int64_t m0 = 0; m0 < M; m0 += 8) {
            __m256 out[8];
            switch (M - m0 < 8 ? M - m0 : 8) {
                KQ_Q6I_CASE(1) KQ_Q6I_CASE(2) KQ_Q6I_CASE(3) KQ_Q6I_CASE(4)
                KQ_Q6I_CASE(5) KQ_Q6I_CASE(6) KQ_Q6I_CASE(7) default: KQ_Q6I_CASE(8)
            }
            for (int64_t t = 0; t < 8 && m0 + t < M; ++t) {
                if (g * 8 >= a && g * 8 + 8 <= e) {
                    _mm256_storeu_ps(y + (m0 + t) * ldy + g * 8, out[t]);
                    continue;
                }
                float v[8];
                _mm256_storeu_ps(v, out[t]);
                for (int64_t i = 0; i < 8; ++i)
                    if (g * 8 + i >= a && g * 8 + i < e) y[(m0 + t) * ldy + g * 8 + i] = v[i];
            }
        }
    }
}
#undef KQ_Q6I_CASE

#define KQ_CASE(T) case T: \
    if (qtype == KQ_Q6_K) kq_q6k_row(T, row, nsb, K, xq, xd, xh, y, ldy); \
    else if (qtype == KQ_Q5_K) kq_q45k_row(T, 1, row, nsb, K, xq, xd, xh, y, ldy); \
    else kq_q45k_row(T, 0, row, nsb, K, xq, xd, xh, y, ldy); \
    break;
/* A row against mt <= KQ_TILE tokens: a constant token count keeps the accumulators in registers. */
static void kq_row(int64_t qtype, int mt, const uint8_t *row, int64_t K, const int16_t *xq, const float *xd,
                   const float *xh, float *y, int64_t ldy) {
    const int64_t nsb = K / 256;
    switch (mt) { KQ_CASE(4) KQ_CASE(3) KQ_CASE(2) default: KQ_CASE(1) }
}
#undef KQ_CASE

#else  /* generic */

static void kq_row(int64_t qtype, int mt, const uint8_t *row, int64_t K, const int16_t *xq, const float *xd,
                   const float *xh, float *y, int64_t ldy) {
    const int64_t nb = K / 32, nsb = K / 256, bytes = kq_block_bytes(qtype);
    float acc[KQ_TILE] = {0.f, 0.f, 0.f, 0.f};
    uint8_t q[256];
    float scale[16], mins[8];
    for (int64_t sb = 0; sb < nsb; ++sb) {
        kq_decode(qtype, row + sb * bytes, q, scale, mins);
        for (int t = 0; t < mt; ++t)
            for (int i = 0; i < 16; ++i) {  /* 16-value halves: Q6_K's sub-blocks */
                const int64_t b = sb * 8 + i / 2;
                const int16_t *xv = xq + t * K + b * 32 + (i & 1) * 16;
                int32_t s = 0;
                for (int j = 0; j < 16; ++j) s += (int32_t)q[16 * i + j] * xv[j];
                const float xdv = xd[t * nb + b], h = xh[2 * (t * nb + b) + (i & 1)];
                if (qtype == KQ_Q6_K) acc[t] += scale[i] * xdv * ((float)s + h);
                else acc[t] += xdv * (scale[i / 2] * (float)s + mins[i / 2] * (1.f / 32.f) * h);
            }
    }
    for (int t = 0; t < mt; ++t) y[t * ldy] = acc[t];
}
#endif

/* y[m, n] (row stride ldy) for output rows n in [n0, n1) and M tokens given as kq_quantize's
   xq / xd / xh: what one thread of a row split computes. */
static void kq_rows(const KqMatrix *W, const int16_t *xq, const float *xd, const float *xh, int64_t M, float *y,
                    int64_t ldy, int64_t n0, int64_t n1) {
    const int64_t K = W->k, nb = K / 32;
    int64_t first = 0;
    for (int64_t p = 0; p < W->nparts; ++p) {
        const KqPart *P = W->part + p;
        const int64_t lo = n0 > first ? n0 : first, hi = n1 < first + P->rows ? n1 : first + P->rows;
        const int64_t row_bytes = K / 256 * kq_block_bytes(P->qtype);
#if defined(__AVX2__)
        if (P->qtype == KQ_Q6_KI) {
            if (lo < hi) kq_q6i_rows(P->data, K, xq, xd, xh, M, y + first, ldy, lo - first, hi - first);
            first += P->rows;
            continue;
        }
#endif
        for (int64_t n = lo; n < hi; ++n) {
            const uint8_t *row = P->data + (n - first) * row_bytes;
#if defined(__AVX2__)
            if (M == 1 && P->qtype == KQ_Q6_K) {  /* a last odd row goes through it too (twice), so every
                                                     row's sum takes the same path */
                float spare;
                const int two = n + 1 < hi;
                kq_q6k_row2(row, two ? row + row_bytes : row, K / 256, xq, xd, xh, y + n, two ? y + n + 1 : &spare);
                n += two;
                continue;
            }
#endif
            for (int64_t m0 = 0; m0 < M; m0 += KQ_TILE) {
                const int mt = M - m0 < KQ_TILE ? (int)(M - m0) : KQ_TILE;
#if defined(__AVX2__)
                if (mt == 1 && P->qtype == KQ_Q6_K) {  /* a batch's last lone token sums as at M = 1 (the
                                                         one-token tile came out an ulp apart) */
                    float spare;
                    kq_q6k_row2(row, row, K / 256, xq + m0 * K, xd + m0 * nb, xh + 2 * m0 * nb, y + m0 * ldy + n,
                                &spare);
                    continue;
                }
#endif
                kq_row(P->qtype, mt, row, K, xq + m0 * K, xd + m0 * nb, xh + 2 * m0 * nb, y + m0 * ldy + n, ldy);
            }
        }
        first += P->rows;
    }
}

/* y = x @ W.T for float32 x [M, K] (row stride ldx), y [M, N] (row stride ldy); scratch from malloc. */
void kq_linear(const KqMatrix *W, int64_t N, const float *x, int64_t ldx, int64_t M, float *y, int64_t ldy,
               int nthreads) {
    const int64_t K = W->k, nb = K / 32;
    int16_t *xq = malloc(sizeof(int16_t) * M * K);
    float *xd = malloc(sizeof(float) * M * nb * 3), *xh = xd + M * nb;
    kq_quantize(x, ldx, M, K, xq, xd, xh, nthreads);
    #pragma omp parallel num_threads(nthreads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        kq_rows(W, xq, xd, xh, M, y, ldy, N * t / nt, N * (t + 1) / nt);
    }
    free(xq);
    free(xd);
}

/* Rows [n0, n1) of W as float32 into w [n1 - n0, K], each weight computed as gguf's dequantizers do
   ((d sc) q, less dmin m), so the values match theirs (up to the fused multiply-add the compiler
   may form for Q4_K / Q5_K: at most one rounding apart). */
static void kq_dequantize_row(int64_t qtype, const uint8_t *row, int64_t K, float *out) {
    const int64_t bytes = kq_block_bytes(qtype);
    for (int64_t sb = 0; sb < K / 256; ++sb) {
        const uint8_t *blk = row + sb * bytes;
        float *o = out + sb * 256;
        if (qtype == KQ_Q6_K) {  /* loops of 16 with one shift and one scale each: they vectorize */
            const float d = kq_half(blk + 208);
            for (int h = 0; h < 2; ++h)
                for (int s = 0; s < 4; ++s)
                    for (int e = 0; e < 2; ++e) {
                        const uint8_t *lo = blk + 64 * h + 32 * (s & 1) + 16 * e, *hb = blk + 128 + 32 * h + 16 * e;
                        const int nib = s < 2 ? 0 : 4, top = 2 * s;
                        const float ds = d * (float)(int8_t)blk[192 + 8 * h + 2 * s + e];
                        float *dst = o + 128 * h + 32 * s + 16 * e;
                        for (int l = 0; l < 16; ++l)
                            dst[l] = ds * (float)((((lo[l] >> nib) & 15) | (((hb[l] >> top) & 3) << 4)) - 32);
                    }
            continue;
        }
        const int has_qh = qtype == KQ_Q5_K;
        const uint8_t *qs = blk + (has_qh ? 48 : 16);
        uint8_t sc[8], mn[8];
        kq_scale_min(blk + 4, sc, mn);
        const float d = kq_half(blk), dmin = kq_half(blk + 2);
        for (int s = 0; s < 8; ++s) {
            const float ds = d * (float)sc[s], dm = dmin * (float)mn[s];
            const uint8_t *v = qs + 32 * (s / 2);
            const int nib = (s & 1) * 4;
            if (has_qh)
                for (int l = 0; l < 32; ++l)
                    o[32 * s + l] = ds * (float)(((v[l] >> nib) & 15) | (((blk[16 + l] >> s) & 1) << 4)) - dm;
            else
                for (int l = 0; l < 32; ++l) o[32 * s + l] = ds * (float)((v[l] >> nib) & 15) - dm;
        }
    }
}

#if defined(__AVX2__)
/* Block j's codes of an interleaved group's super-block o, centred (q - 32, signed bytes), as 8
   chunks in weight order: chunk c's lane i holds row i's weights 4c..4c+3 (kq8_repack's copy). */
static inline void kq_q6i_chunks(const uint8_t *o, int j, __m256i r[8]) {
    __m256i w[8];
    kq_q6i_codes(o, j, w);
    for (int c = 0; c < 8; ++c) r[c] = _mm256_sub_epi8(w[c < 4 ? 2 * c : 2 * (c - 4) + 1], _mm256_set1_epi8(32));
}
/* An interleaved group (K columns at wg) as rows row0..row0 + 7 of w [N, K], float32 or bfloat16:
   each weight (d sc) (q - 32), as kq_dequantize_row computes it from the file's rows. */
static void kq_q6i_dequantize(const uint8_t *wg, int64_t K, int bf16, void *w, int64_t row0) {
    for (int64_t sb = 0; sb < K / 256; ++sb) {
        const uint8_t *o = wg + sb * KQ_Q6I_BYTES;
        for (int j = 0; j < 8; ++j) {
            __m256i r[8];
            kq_q6i_chunks(o, j, r);
            transpose8((__m256 *)r);  /* r[i]: row i's 32 codes in order */
            for (int i = 0; i < 8; ++i) {
                const float d = kq_half(o + KQ_Q6I_D + 2 * i);
                const int64_t at = (row0 + i) * K + sb * 256 + 32 * j;
                int8_t q32[32];
                _mm256_storeu_si256((__m256i *)q32, r[i]);
                for (int q = 0; q < 4; ++q) {
                    const float ds = d * (float)(int8_t)o[KQ_Q6I_SC + (2 * j + q / 2) * 8 + i];
                    const __m256 v = _mm256_mul_ps(_mm256_set1_ps(ds), _mm256_cvtepi32_ps(
                        _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q32 + 8 * q)))));
                    if (bf16) _mm_storeu_si128((__m128i *)((uint16_t *)w + at + 8 * q), bf16x8(v));
                    else _mm256_storeu_ps((float *)w + at + 8 * q, v);
                }
            }
        }
    }
}
#endif
/* W [N, K] as float32, or bfloat16 when bf16 (each value rounded once from float32, as
   `.bfloat16()` would: the dense path of prefill-sized batches on bfloat16 units), and embedding
   rows. */
void kq_dequantize(const KqMatrix *W, void *w, int bf16, int nthreads) {
    const int64_t K = W->k;
    int64_t first = 0;
    for (int64_t p = 0; p < W->nparts; ++p) {
        const KqPart *P = W->part + p;
        const int64_t row_bytes = K / 256 * kq_block_bytes(P->qtype);
#if defined(__AVX2__)
        if (P->qtype == KQ_Q6_KI) {
            #pragma omp parallel for num_threads(nthreads) schedule(static)
            for (int64_t g = 0; g < P->rows / 8; ++g)
                kq_q6i_dequantize(P->data + g * 8 * row_bytes, K, bf16, w, first + 8 * g);
            first += P->rows;
            continue;
        }
#endif
        #pragma omp parallel num_threads(nthreads)
        {
            float *row = bf16 ? (float *)malloc((size_t)K * sizeof(float)) : 0;
            #pragma omp for schedule(static)
            for (int64_t n = 0; n < P->rows; ++n) {
                const uint8_t *src = P->data + n * row_bytes;
                if (!bf16) {
                    kq_dequantize_row(P->qtype, src, K, (float *)w + (first + n) * K);
                    continue;
                }
                uint16_t *dst = (uint16_t *)w + (first + n) * K;
                kq_dequantize_row(P->qtype, src, K, row);
                int64_t j = 0;
#if defined(__AVX2__)
                for (; j + 8 <= K; j += 8) _mm_storeu_si128((__m128i *)(dst + j), bf16x8(_mm256_loadu_ps(row + j)));
#endif
                for (; j < K; ++j) dst[j] = float_to_bf16(row[j]);
            }
            free(row);
        }
        first += P->rows;
    }
}

/* Row i (0..7) of an interleaved Q6_K group (K columns at wg) into out [K]: each weight (d sc) (q - 32),
   as kq_q6i_dequantize and kq_dequantize_row compute it, read back from kq_q6k_interleave's layout one
   byte at a time (an embedding row: 1/8 of the group's work). Not kq_q6i_dequantize into a scratch
   group: with this caller's constant arguments GCC 12.2 at -O3 specialized that function and its
   induction-variable pass wrote wrong addresses (kq_dequantize's runtime arguments are not affected;
   tests/quant/test_kquant.py checks both against the file's rows). */
static void kq_q6i_row(const uint8_t *wg, int64_t K, int i, float *out) {
    for (int64_t sb = 0; sb < K / 256; ++sb) {
        const uint8_t *o = wg + sb * KQ_Q6I_BYTES;
        const float d = kq_half(o + KQ_Q6I_D + 2 * i);
        for (int j = 0; j < 8; ++j)
            for (int w = 0; w < 32; ++w) {  /* weight w = 16 e + 4 c + u of block j: code register k = 2 c + e */
                const int e = w >> 4, c = (w >> 2) & 3, u = w & 3, k = 2 * c + e;
                const int low = (o[128 * j + 32 * c + 4 * i + u] >> (4 * e)) & 15;
                const int top = (o[KQ_Q6I_TOP + 64 * j + 32 * (k >> 2) + 4 * i + u] >> (2 * (k & 3))) & 3;
                const float ds = d * (float)(int8_t)o[KQ_Q6I_SC + 8 * (2 * j + e) + i];
                out[sb * 256 + 32 * j + w] = ds * (float)((low | top << 4) - 32);
            }
    }
}
/* Rows ids [count] of W as float32 into out [count, K], the values kq_dequantize gives: an
   embedding lookup in a K-quant table. Returns the first position whose id is outside W's rows,
   else -1 (nothing written past it). */
int64_t kq_take_rows(const KqMatrix *W, const int64_t *ids, int64_t count, float *out, int nthreads) {
    int64_t n = 0;
    for (int64_t p = 0; p < W->nparts; ++p) n += W->part[p].rows;
    for (int64_t i = 0; i < count; ++i)
        if (ids[i] < 0 || ids[i] >= n) return i;
    const int64_t K = W->k;
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (count >= TAKE_ROWS_THREADED)
    for (int64_t i = 0; i < count; ++i) {
        int64_t r = ids[i], p = 0;
        while (r >= W->part[p].rows) r -= W->part[p++].rows;
        const KqPart *P = W->part + p;
        const int64_t row_bytes = K / 256 * kq_block_bytes(P->qtype);
        if (P->qtype == KQ_Q6_KI) kq_q6i_row(P->data + (r / 8) * 8 * row_bytes, K, (int)(r % 8), out + i * K);
        else kq_dequantize_row(P->qtype, P->data + r * row_bytes, K, out + i * K);
    }
    return -1;
}

/* Prefill-sized batches on int8 activations (kq_linear_int8): the K-quant rows of 8 output rows
 * at a time (a group; every part's rows a multiple of 8) are decoded into a per-thread copy in
 * qmatmul's interleaved 8-bit layout, used by every token of the batch and then dropped, so no
 * second copy of the weight is kept and the copy stays in L2. Per 32-weight block a group holds 8
 * chunks of 32 bytes (chunk c's bytes 4 i + j: row i's code 4 c + j), the codes centred and signed
 * (q - 32 for Q6_K, q - 16 Q5_K, q - 8 Q4_K), their scale per 16-weight half (Q6_K's d sc of the
 * sub-block; Q4_K / Q5_K's d sc of the block, twice) and, for Q4_K / Q5_K, the block's offset
 * e = 8 d sc - dmin m (with 16 for Q5_K) against the exact float sum of x. Activations are int8 per
 * 32 values (scale amax / 127, as qmatmul's int8 codes) stored as unsigned bytes u = q + 128, so
 * vpdpbusd (or maddubs) takes them against the signed codes and each half's 128 sum(codes), kept
 * per row in the copy, is taken off its integer sum: per token and block 8 dpbusd, two
 * conversions, a multiply and two FMAs, against 1 byte per weight read from L2. Each token's sums do not
 * depend on the batch. */
#if defined(__AVX2__)
/* Block j (0..7) of a super-block blk: its 32 codes centred, in order, in a register. */
static inline __m256i kq8_codes(int64_t qtype, const uint8_t *blk, int j) {
    const __m256i m4 = _mm256_set1_epi8(15);
    if (qtype == KQ_Q6_K) {
        const int h = j / 4, s4 = j % 4;
        const __m256i l = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32 * (s4 & 1)));
        const __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
        return _mm256_sub_epi8(kq_q6k_codes(l, l, hb, s4), _mm256_set1_epi8(32));
    }
    const int has_qh = qtype == KQ_Q5_K;
    const __m256i v = _mm256_loadu_si256((const __m256i *)(blk + (has_qh ? 48 : 16) + 32 * (j / 2)));
    __m256i q = _mm256_and_si256(j & 1 ? _mm256_srli_epi16(v, 4) : v, m4);
    if (has_qh) {  /* bit j of qh[l] to bit 4: shifted in 16-bit lanes, then masked */
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(blk + 16));
        const __m256i top = j < 4 ? _mm256_slli_epi16(qh, 4 - j) : _mm256_srli_epi16(qh, j - 4);
        q = _mm256_or_si256(q, _mm256_and_si256(top, _mm256_set1_epi8(0x10)));
    }
    return _mm256_sub_epi8(q, _mm256_set1_epi8(has_qh ? 16 : 8));
}
/* Row i's scale of each 16-weight half (sc [16]) and offset of each block (e [8]) in super-block blk. */
static inline void kq8_scales(int64_t qtype, const uint8_t *blk, float sc[16], float e[8]) {
    if (qtype == KQ_Q6_K) {
        const float d = kq_half(blk + 208);
        for (int i = 0; i < 16; ++i) sc[i] = d * (float)(int8_t)blk[192 + i];
        for (int j = 0; j < 8; ++j) e[j] = 0.f;
        return;
    }
    const float centre = qtype == KQ_Q5_K ? 16.f : 8.f, d = kq_half(blk), dmin = kq_half(blk + 2);
    uint8_t s[8], m[8];
    kq_scale_min(blk + 4, s, m);
    for (int j = 0; j < 8; ++j) {
        sc[2 * j] = sc[2 * j + 1] = d * (float)s[j];
        e[j] = centre * sc[2 * j] - dmin * (float)m[j];
    }
}
/* A unit's copy (L rows: one group of 8, or two side by side for the 512-bit tile): per block, codes
   wg [nb][8 chunks][4 L], scales sg [nb][2][L], 128 x code sums cg [nb][2][L] (int32), offsets
   eg [nb][L]. Written here: group gh's 8 lanes (gh 0 or 1), from its rows (row_bytes apart). */
static void kq8_repack(int64_t qtype, const uint8_t *rows, int64_t row_bytes, int64_t K, int L, int gh, uint8_t *wg,
                       float *sg, int32_t *cg, float *eg) {
    const int64_t bytes = kq_block_bytes(qtype);
    const __m256i ones = _mm256_set1_epi8(1);
    const int il = qtype == KQ_Q6_KI;  /* rows: an interleaved group, already in chunks */
    for (int64_t sb = 0; sb < K / 256; ++sb) {
        float sc[8][16], e[8][8];
        const uint8_t *o = rows + sb * KQ_Q6I_BYTES;
        /* an interleaved group's scales are already 8 rows side by side: each sub-block's 8 (kq8_scales'
           Q6_K values, d sc, the same product) in one vector operation, where the rows of a plain part
           are decoded one by one (a scalar loop that cost the copy more than its codes did) */
        const __m256 D = il ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(o + KQ_Q6I_D))) : _mm256_setzero_ps();
        for (int i = 0; i < 8 && !il; ++i) kq8_scales(qtype, rows + i * row_bytes + sb * bytes, sc[i], e[i]);
        for (int j = 0; j < 8; ++j) {
            const int64_t b = sb * 8 + j;
            __m256 r[8];
            if (il)
                kq_q6i_chunks(o, j, (__m256i *)r);
            else {
                for (int i = 0; i < 8; ++i)
                    r[i] = _mm256_castsi256_ps(kq8_codes(qtype, rows + i * row_bytes + sb * bytes, j));
                transpose8(r);  /* r[c]: lane i = row i's codes 4c..4c+3 */
            }
            __m256i half[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
            for (int c = 0; c < 8; ++c) {
                const __m256i v = _mm256_castps_si256(r[c]);
                _mm256_storeu_si256((__m256i *)(wg + (b * 8 + c) * 4 * L + 32 * gh), v);
                half[c / 4] = _mm256_add_epi32(half[c / 4], _mm256_madd_epi16(_mm256_maddubs_epi16(ones, v),
                                                                              _mm256_set1_epi16(1)));
            }
            for (int h = 0; h < 2; ++h) {
                _mm256_storeu_si256((__m256i *)(cg + (2 * b + h) * L + 8 * gh), _mm256_slli_epi32(half[h], 7));
                if (il) {
                    const __m128i s8 = _mm_loadl_epi64((const __m128i *)(o + KQ_Q6I_SC + 8 * (2 * j + h)));
                    _mm256_storeu_ps(sg + (2 * b + h) * L + 8 * gh,
                                     _mm256_mul_ps(D, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s8))));
                } else
                    for (int i = 0; i < 8; ++i) sg[(2 * b + h) * L + 8 * gh + i] = sc[i][2 * j + h];
            }
            if (il)
                _mm256_storeu_ps(eg + b * L + 8 * gh, _mm256_setzero_ps());
            else
                for (int i = 0; i < 8; ++i) eg[b * L + 8 * gh + i] = e[i][j];
        }
    }
}
/* One 16-weight half's 8 row sums: 4 chunks of codes w against 4 x 4 activation bytes x4. Without
   VNNI two maddubs results are added in int16 before widening (each pair at most 2 x 255 x 32, two
   of them 32640 < 32767 for codes within [-32, 32]). The same integers either way. */
static inline __m256i kq8_half(const int32_t *x4, const __m256i *w) {
#if HAS_VNNI
    __m256i s = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) s = dpbusd(s, _mm256_set1_epi32(x4[c]), w[c]);
    return s;
#else
    const __m256i ones = _mm256_set1_epi16(1);
    const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_set1_epi32(x4[0]), w[0]),
                                       _mm256_maddubs_epi16(_mm256_set1_epi32(x4[1]), w[1]));
    const __m256i q = _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_set1_epi32(x4[2]), w[2]),
                                       _mm256_maddubs_epi16(_mm256_set1_epi32(x4[3]), w[3]));
    return _mm256_add_epi32(_mm256_madd_epi16(p, ones), _mm256_madd_epi16(q, ones));
#endif
}
/* Token t's share of block b into acc: two halves, each its integer sum less 128 sum(codes), by
   its scale, then by xd; then the offset against the exact sum. */
#define KQ8_TOKEN(t, acc) if (T > t) { \
        const int64_t i = b * T + t; \
        const int32_t *x4 = (const int32_t *)(xp + i * 32); \
        const __m256i s0 = kq8_half(x4, w), s1 = kq8_half(x4 + 4, w + 4); \
        const __m256 h_ = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(s1, c1)), d1, \
                                          _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(s0, c0)), d0)); \
        acc = _mm256_fmadd_ps(h_, _mm256_set1_ps(xd[i]), acc); \
        if (HAS_E) acc = _mm256_fmadd_ps(e, _mm256_set1_ps(xs[i]), acc); }
static inline __attribute__((always_inline)) void kq8_tile(
        const int T, const int HAS_E, const int L, const uint8_t *wg, const float *sg, const int32_t *cg, const float *eg,
        int64_t nb, const uint8_t *xp, const float *xd, const float *xs, __m256 *out) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t b = 0; b < nb; ++b) {
        __m256i w[8];
        for (int c = 0; c < 8; ++c) w[c] = _mm256_loadu_si256((const __m256i *)(wg + (b * 8 + c) * 4 * L));
        const __m256 d0 = _mm256_loadu_ps(sg + 2 * b * L), d1 = _mm256_loadu_ps(sg + (2 * b + 1) * L);
        const __m256i c0 = _mm256_loadu_si256((const __m256i *)(cg + 2 * b * L));
        const __m256i c1 = _mm256_loadu_si256((const __m256i *)(cg + (2 * b + 1) * L));
        const __m256 e = HAS_E ? _mm256_loadu_ps(eg + b * L) : _mm256_setzero_ps();
        KQ8_TOKEN(0, a0) KQ8_TOKEN(1, a1) KQ8_TOKEN(2, a2) KQ8_TOKEN(3, a3)
        KQ8_TOKEN(4, a4) KQ8_TOKEN(5, a5) KQ8_TOKEN(6, a6) KQ8_TOKEN(7, a7)
    }
    out[0] = a0; out[1] = a1; out[2] = a2; out[3] = a3; out[4] = a4; out[5] = a5; out[6] = a6; out[7] = a7;
}
/* A run of T tokens over a unit's copy (L lanes; the 256-bit tile reads lanes at + off), scales as above. */
#define KQ8_RUN(T, L, off) (has_e ? kq8_tile(T, 1, L, wg + 4 * (off), sg + (off), cg + (off), eg + (off), nb, xr, dr, sr, o) \
                              : kq8_tile(T, 0, L, wg + 4 * (off), sg + (off), cg + (off), eg + (off), nb, xr, dr, sr, o))
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#define HAS_KQ8Z 1
/* kq8_tile for two groups at once (L = 16: group g in the low half of each 512-bit register, g + 1 in
   the high one), 8 tokens: each broadcast of 4 activation bytes and each float step serves 16 rows.
   Every lane's operations are kq8_tile's, so a row's output has the same bits either way. */
#define KQ8Z_TOKEN(t, acc) { \
        const int64_t i = b * 8 + t; \
        const int32_t *x4 = (const int32_t *)(xp + i * 32); \
        __m512i s0 = _mm512_setzero_si512(), s1 = s0; \
        for (int c = 0; c < 4; ++c) { \
            s0 = _mm512_dpbusd_epi32(s0, _mm512_set1_epi32(x4[c]), w[c]); \
            s1 = _mm512_dpbusd_epi32(s1, _mm512_set1_epi32(x4[4 + c]), w[4 + c]); } \
        const __m512 h_ = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(s1, c1)), d1, \
                                          _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(s0, c0)), d0)); \
        acc = _mm512_fmadd_ps(h_, _mm512_set1_ps(xd[i]), acc); \
        if (HAS_E) acc = _mm512_fmadd_ps(e, _mm512_set1_ps(xs[i]), acc); }
static inline __attribute__((always_inline)) void kq8z_tile(
        const int HAS_E, const uint8_t *wg, const float *sg, const int32_t *cg, const float *eg, int64_t nb,
        const uint8_t *xp, const float *xd, const float *xs, __m512 *out) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t b = 0; b < nb; ++b) {
        __m512i w[8];
        for (int c = 0; c < 8; ++c) w[c] = _mm512_loadu_si512((const void *)(wg + (b * 8 + c) * 64));
        const __m512 d0 = _mm512_loadu_ps(sg + b * 32), d1 = _mm512_loadu_ps(sg + b * 32 + 16);
        const __m512i c0 = _mm512_loadu_si512((const void *)(cg + b * 32));
        const __m512i c1 = _mm512_loadu_si512((const void *)(cg + b * 32 + 16));
        const __m512 e = HAS_E ? _mm512_loadu_ps(eg + b * 16) : _mm512_setzero_ps();
        KQ8Z_TOKEN(0, a0) KQ8Z_TOKEN(1, a1) KQ8Z_TOKEN(2, a2) KQ8Z_TOKEN(3, a3)
        KQ8Z_TOKEN(4, a4) KQ8Z_TOKEN(5, a5) KQ8Z_TOKEN(6, a6) KQ8Z_TOKEN(7, a7)
    }
    out[0] = a0; out[1] = a1; out[2] = a2; out[3] = a3; out[4] = a4; out[5] = a5; out[6] = a6; out[7] = a7;
}
#else
#define HAS_KQ8Z 0
#endif
#endif

/* y = x @ W.T on int8 activations (above) for float32 x [M, K] (row stride ldx), y [M, N] (row
   stride ldy). 0, or -1 where it does not apply: no AVX2, or a part whose rows are not a multiple
   of 8 (nothing is written then). */
int kq_linear_int8(const KqMatrix *W, int64_t N, const float *x, int64_t ldx, int64_t M, float *y, int64_t ldy,
                   int nthreads) {
#if defined(__AVX2__)
    const int64_t K = W->k, nb = K / 32;
    for (int64_t p = 0; p < W->nparts; ++p)
        if (W->part[p].rows % 8) return -1;
    uint8_t *xp = malloc((size_t)(M * K) + 2 * sizeof(float) * (size_t)(M * nb));
    if (!xp) return -1;
    float *xd = (float *)(xp + M * K), *xs = xd + M * nb;
    quantize_runs(x, ldx, M, K, (int8_t *)xp, 1, 0, xd, xs, nthreads);  /* codes as q + 128, kq8_tile's runs */
    const int L = HAS_KQ8Z ? 16 : 8;  /* rows per unit: two groups where the 512-bit tile exists */
    const int64_t G = N / 8, units = (G + L / 8 - 1) / (L / 8);
    const size_t unit_bytes = (size_t)nb * (size_t)L * (32 + 5 * sizeof(float));
    int failed = 0;
    #pragma omp parallel num_threads(nthreads)
    {
        uint8_t *wg = kq_scratch(unit_bytes);
        if (!wg) {
            #pragma omp atomic write
            failed = 1;
        }
        float *sg = (float *)(wg + 32 * nb * L);
        int32_t *cg = (int32_t *)(sg + 2 * nb * L);
        float *eg = (float *)(cg + 2 * nb * L);
        #pragma omp for schedule(dynamic, 1)
        for (int64_t u = 0; u < units; ++u) {
            if (!wg) continue;
            const int64_t g0 = u * (L / 8), ng = G - g0 < L / 8 ? G - g0 : L / 8;
            int has_e = 0;
            for (int64_t gh = 0; gh < ng; ++gh) {  /* each group from its part (a pair may straddle two) */
                const int64_t g = g0 + gh;
                int64_t first = 0, p = 0;
                while (g * 8 >= first + W->part[p].rows) first += W->part[p++].rows;
                const KqPart *P = W->part + p;
                const int64_t row_bytes = K / 256 * kq_block_bytes(P->qtype);
                kq8_repack(P->qtype, P->data + (g * 8 - first) * row_bytes, row_bytes, K, L, (int)gh, wg, sg, cg, eg);
                has_e |= P->qtype != KQ_Q6_K && P->qtype != KQ_Q6_KI;  /* Q6_K lanes' offsets are 0: an FMA
                                                                          by them changes nothing */
            }
            for (int64_t t0 = 0, T; t0 < M; t0 += T) {
                T = M - t0 >= 8 ? 8 : M - t0 >= 4 ? 4 : M - t0 >= 2 ? 2 : 1;
                const uint8_t *xr = xp + t0 * K;
                const float *dr = xd + t0 * nb, *sr = xs + t0 * nb;
#if HAS_KQ8Z
                if (ng == 2 && T == 8) {
                    __m512 oz[8];
                    if (has_e) kq8z_tile(1, wg, sg, cg, eg, nb, xr, dr, sr, oz);
                    else kq8z_tile(0, wg, sg, cg, eg, nb, xr, dr, sr, oz);
                    for (int64_t t = 0; t < 8; ++t) _mm512_storeu_ps(y + (t0 + t) * ldy + g0 * 8, oz[t]);
                    continue;
                }
#endif
                for (int64_t gh = 0; gh < ng; ++gh) {
                    __m256 o[8];
                    if (T == 8) KQ8_RUN(8, L, 8 * gh);
                    else if (T == 4) KQ8_RUN(4, L, 8 * gh);
                    else if (T == 2) KQ8_RUN(2, L, 8 * gh);
                    else KQ8_RUN(1, L, 8 * gh);
                    for (int64_t t = 0; t < T; ++t) _mm256_storeu_ps(y + (t0 + t) * ldy + (g0 + gh) * 8, o[t]);
                }
            }
        }
    }
    free(xp);
    return failed ? -1 : 0;
#else
    (void)W; (void)N; (void)x; (void)ldx; (void)M; (void)y; (void)ldy; (void)nthreads;
    return -1;
#endif
}

/* A Q6_K part (rows a multiple of 8, K columns: raw [rows, K / 256 x 210]) rewritten as KQ_Q6_KI
   groups into out (the same size): 0, or -1 on a build without the AVX2 kernels that read them. */
int kq_q6k_interleave(const uint8_t *raw, int64_t rows, int64_t K, uint8_t *out, int nthreads) {
#if defined(__AVX2__)
    const int64_t nsb = K / 256, rb = nsb * 210;
    if (rows % 8 || K % 256) return -1;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t gs = 0; gs < rows / 8 * nsb; ++gs) {
        const int64_t g = gs / nsb, sb = gs % nsb;
        uint8_t *o = out + gs * KQ_Q6I_BYTES;
        for (int i = 0; i < 8; ++i) {
            const uint8_t *blk = raw + (g * 8 + i) * rb + sb * 210;
            uint8_t q[256];  /* the codes in order */
            float scale[16], mins[8];
            kq_decode(KQ_Q6_K, blk, q, scale, mins);
            for (int j = 0; j < 8; ++j)
                for (int c = 0; c < 4; ++c)
                    for (int u = 0; u < 4; ++u) {
                        const uint8_t *w = q + 32 * j + 4 * c + u;  /* weights 4c + u and 16 + 4c + u */
                        o[128 * j + 32 * c + 4 * i + u] = (uint8_t)((w[0] & 15) | (w[16] & 15) << 4);
                    }
            for (int j = 0; j < 8; ++j)
                for (int p = 0; p < 2; ++p)
                    for (int u = 0; u < 4; ++u) {
                        uint8_t v = 0;
                        for (int qq = 0; qq < 4; ++qq) {  /* code register k = 2c + e: weight 16e + 4c + u */
                            const int k = 4 * p + qq;
                            v |= (uint8_t)((q[32 * j + 16 * (k & 1) + 4 * (k >> 1) + u] >> 4) << (2 * qq));
                        }
                        o[KQ_Q6I_TOP + 64 * j + 32 * p + 4 * i + u] = v;
                    }
            for (int h = 0; h < 16; ++h) o[KQ_Q6I_SC + 8 * h + i] = blk[192 + h];
            memcpy(o + KQ_Q6I_D + 2 * i, blk + 208, 2);
        }
    }
    return 0;
#else
    (void)raw; (void)rows; (void)K; (void)out; (void)nthreads;
    return -1;
#endif
}
