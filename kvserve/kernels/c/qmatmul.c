/* Matmuls that read 4- and 8-bit weights in place (qmatmul.py has the layout and the modes). */
#include "common.h"
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define TILE 4
/* tile(MT, ...) for MT = mt (1 to TILE): a constant token count keeps the accumulators in registers. */
#define TILE_SWITCH(mt, tile, ...) do { switch (mt) { \
        case 4: tile(4, __VA_ARGS__); break; case 3: tile(3, __VA_ARGS__); break; \
        case 2: tile(2, __VA_ARGS__); break; default: tile(1, __VA_ARGS__); } } while (0)
/* From this many tokens float activations take the panel GEMM (qgemm_panels). */
#define PANEL_FROM 10
/* The signed codes of block b of a row: nibbles minus 8, or the int8 codes. */
static inline void codes_of(const uint8_t *wr, int64_t b, int bits, int8_t *out) {
    if (bits == 4) {
        for (int j = 0; j < 16; ++j) {
            out[j] = (int8_t)((wr[b * 16 + j] & 15) - 8);
            out[j + 16] = (int8_t)((wr[b * 16 + j] >> 4) - 8);
        }
    } else {
        memcpy(out, wr + b * 32, 32);
    }
}  /* tokens per pass over a weight row: its blocks are decoded once per TILE tokens */

/* Block i (of M x K / 32; token i / (K / 32)) of x [M, K] (row stride ldx): integer codes (int8:
   qmax 127, or int16: qmax 32767, 256 times finer, so a product's error is ~1e-5 of its size),
   scale xd = amax / qmax, the exact float sum xs, and xk = -8 xd sum(codes): what centring 4-bit
   codes (nibble - 8) subtracts, so the kernel can multiply the nibbles as they are (unsigned, as
   maddubs takes them) in the same integer math. Blocks are independent: callers share them
   between threads (prepare_act's loop, the decode stack's). */
static inline void quantize_block(const float *x, int64_t ldx, int64_t K, void *xq, int qmax, float *xd, float *xs,
                                  float *xk, int64_t i) {
    const int64_t nb = K / 32, m = i / nb, b = i % nb;
    const float *src = x + m * ldx + b * 32;
    float amax = 0.f, sum = 0.f;
    for (int j = 0; j < 32; ++j) { const float a = fabsf(src[j]); amax = a > amax ? a : amax; sum += src[j]; }
    const float d = amax / (float)qmax, id = d > 0.f ? (float)qmax / amax : 0.f;
    int32_t code[32], isum = 0;
    for (int j = 0; j < 32; ++j) {
        const float v = src[j] * id;
        code[j] = (int)(v + (v >= 0.f ? .5f : -.5f));
        isum += code[j];
    }
    if (qmax == 127)
        for (int j = 0; j < 32; ++j) ((int8_t *)xq)[m * K + b * 32 + j] = (int8_t)code[j];
    else
        for (int j = 0; j < 32; ++j) ((int16_t *)xq)[m * K + b * 32 + j] = (int16_t)code[j];
    xd[i] = d;
    xs[i] = sum;
    xk[i] = -8.f * d * (float)isum;
}

/* x [M, K] (row stride ldx) as int8 codes packed for il8_tile / il8b_tile (flip): quantize_runs's
   layout in one buffer xp, the codes [M K] followed by cp (int32), pd and ps ([M nb] each; packed_parts
   finds them). Each thread packed the whole batch for itself before. */
static void quantize_packed(const float *x, int64_t ldx, int64_t M, int64_t K, int8_t *xp, int flip, int nthreads) {
    const int64_t nb = K / 32;
    int32_t *cp = (int32_t *)(xp + M * K);
    float *pd = (float *)(cp + M * nb);
    quantize_runs(x, ldx, M, K, xp, flip, cp, pd, pd + M * nb, nthreads);
}

/* Sum of 32 floats' block: per token, per row. */
static void block_sums(const float *x, int64_t ldx, int64_t M, int64_t K, float *xs) {
    const int64_t nb = K / 32;
    for (int64_t m = 0; m < M; ++m)
        for (int64_t b = 0; b < nb; ++b) {
            float s = 0.f;
            for (int j = 0; j < 32; ++j) s += x[m * ldx + b * 32 + j];
            xs[m * nb + b] = s;
        }
}

#if defined(__AVX2__)
static inline void mul_f32(const float *a, const float *b, float *out, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
    for (; i < n; ++i) out[i] = a[i] * b[i];
}
/* The tail goes through a masked load, not a scalar loop: under -ffast-math the compiler may
   vectorize (reassociate) a scalar tail differently wherever this is inlined, and then one token's
   sum would differ in its last bits between a one-token call and a batch (seen with AVX-512). */
static inline float dot_f32(const float *a, const float *b, int64_t n) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    if (i < n) {
        const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - i)),
                                                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        acc = _mm256_fmadd_ps(_mm256_maskload_ps(a + i, mask), _mm256_maskload_ps(b + i, mask), acc);
    }
    return hsum8(acc);
}
/* 16 bytes of a 4-bit block -> its 32 codes in order: low nibbles are weights 0..15, high 16..31. */
static inline __m256i unpack_q4(const uint8_t *p) {
    const __m128i v = _mm_loadu_si128((const __m128i *)p), low = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), low), _mm_and_si128(v, low));
}
static inline __m256i load_codes(const uint8_t *wr, int64_t b, int bits) {
    if (bits == 4) return _mm256_sub_epi8(unpack_q4(wr + b * 16), _mm256_set1_epi8(8));
    return _mm256_loadu_si256((const __m256i *)(wr + b * 32));
}
/* 8 int32: each the sum of 4 adjacent u8 x s8 products (no product pair may exceed 32767). */
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if HAS_VNNI
    return dpbusd(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}
#endif

#if defined(__AVX2__)
/* A decode GEMV streams every weight once: asking for the bytes PREFETCH_AHEAD past the row being
   multiplied (~4 rows of a 2048-wide 4-bit weight) keeps more DRAM reads in flight than the
   hardware prefetcher does alone: +10-18% GB/s from DRAM on Zen 3 (interleaved A/B, 11264x2048
   Q4_0 weights ten times the L3). Past the weight's end a prefetch is a no-op, never a fault. */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 4096
#endif
/* The interleaved decode kernels ask for those bytes into L2 (T1), not L1: 1.1B Q4_K_M decode 41.4 /
   43.6 / 43.3 -> 46.7 / 44.9 / 48.5 tok/s, Q4_0 48.5 / 43.0 / 45.9 -> 48.8 / 45.9 / 47.5 (Zen 4, the
   builds alternating process by process); standalone, Q4_K groups from DRAM +3-10%. And from
   IL_AHEAD bytes ahead, not 4 KB: one token against 143 MB of 4-bit weights from DRAM, 2 threads, the
   two builds alternating in one process (Zen 4): Q4_0's form +4% and +14% (two sittings), Q4_K's
   factored +10%; under the AVX2 build +2-3%. 6, 16 and 32 KB measured as 8 (2 KB: -19%). End to end
   at the slower of the Zen 4 VM's two memory speeds, 6 KB here and for KQ_AHEAD against 8 KB (the
   decode stack's builds alternating reply by reply, scripts/ab_decode_stack.py, each against a
   second 8 KB build): 1.1B Q4_K_M +1.8% (60 replies), +1.5-3.7% (16-24), 1.1B Q4_0 +4%, 3B Q4_K_M
   +5%, the AVX2 build +1.4%; 4 KB 0.97x, 12 KB 0.97x. Non-temporal (NTA) hints here and in kquant.c:
   1.1B Q4_K_M decode 0.92x (Zen 4, scripts/ab_decode_stack.py). */
#ifndef IL_HINT
#define IL_HINT _MM_HINT_T1
#endif
#ifndef IL_AHEAD  /* (scripts/ab_decode_stack.py may set it) */
#define IL_AHEAD 6144
#endif
static inline void prefetch_ahead(const uint8_t *row, int64_t row_bytes) {
    for (int64_t o = 0; o < row_bytes; o += 64) _mm_prefetch((const char *)row + PREFETCH_AHEAD + o, _MM_HINT_T0);
}
/* Block b's 32 weights' codes as floats in w[0..3] (weights 0-7, 8-15, 16-23, 24-31): 4-bit nibbles
   as they are (0..15, not centred: callers take the 8 d off with the offsets), 8-bit codes signed.
   The bytes go to one int32 each by in-lane byte shuffles from a 16-byte load broadcast to both
   lanes: cross-lane widening (vpmovsx) took twice as long per block on Zen 3. */
/* The 32 nibbles of one 4-bit block's 16 bytes (in a register) as floats, in block_floats's order. */
static inline void nibble_floats(__m128i bytes, __m256 w[4]) {
    const __m256i i0 = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                        4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
    const __m256i i1 = _mm256_add_epi32(i0, _mm256_set1_epi32(8));  /* bytes 8-15 (-1 + 8 keeps bit 7 set) */
    const __m256i v = _mm256_broadcastsi128_si256(bytes);
    const __m256i m = _mm256_set1_epi32(15), a = _mm256_shuffle_epi8(v, i0), c = _mm256_shuffle_epi8(v, i1);
    w[0] = _mm256_cvtepi32_ps(_mm256_and_si256(a, m));
    w[1] = _mm256_cvtepi32_ps(_mm256_and_si256(c, m));
    w[2] = _mm256_cvtepi32_ps(_mm256_srli_epi32(a, 4));
    w[3] = _mm256_cvtepi32_ps(_mm256_srli_epi32(c, 4));
}
static inline void block_floats(const uint8_t *wr, int64_t b, int bits, __m256 w[4]) {
    const __m256i i0 = _mm256_setr_epi8(0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1, 3, -1, -1, -1,
                                        4, -1, -1, -1, 5, -1, -1, -1, 6, -1, -1, -1, 7, -1, -1, -1);
    const __m256i i1 = _mm256_add_epi32(i0, _mm256_set1_epi32(8));  /* bytes 8-15 (-1 + 8 keeps bit 7 set) */
    if (bits == 4) {
        nibble_floats(_mm_loadu_si128((const __m128i *)(wr + b * 16)), w);
    } else {  /* each byte into an int32's top byte, then an arithmetic shift sign-extends it */
        const __m256i j0 = _mm256_slli_epi32(i0, 24), j1 = _mm256_slli_epi32(i1, 24);
        const __m256i s0 = _mm256_or_si256(_mm256_srli_epi32(_mm256_set1_epi32(-1), 8), j0);
        const __m256i s1 = _mm256_or_si256(_mm256_srli_epi32(_mm256_set1_epi32(-1), 8), j1);
        for (int h = 0; h < 2; ++h) {
            const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(wr + b * 32 + h * 16)));
            w[2 * h] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_shuffle_epi8(v, s0), 24));
            w[2 * h + 1] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_shuffle_epi8(v, s1), 24));
        }
    }
}
static inline __m256 block_dot(const __m256 w[4], const float *xv) {
    __m256 p = _mm256_mul_ps(w[0], _mm256_loadu_ps(xv));
    p = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xv + 8), p);
    p = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xv + 16), p);
    return _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xv + 24), p);
}
/* The weight offsets' share of one output: sum_b c[b] xs[b], less 8 d[b] xs[b] for uncentred nibbles. */
static inline float offsets_dot(int bits, const float *c, const float *d, const float *xs, int64_t nb) {
    const float s = c ? dot_f32(c, xs, nb) : 0.f;  /* no offsets (symmetric codes): c is NULL */
    return bits == 4 ? s - 8.f * dot_f32(d, xs, nb) : s;
}
/* One weight row against MT tokens (x [MT, K] row stride ldx, y column stride ldy): the row's
   blocks are decoded once for the MT tokens. Each token sums as gemv_float does one token (even
   blocks into one accumulator, odd into another, added at the end), so a token's output is the
   same bits whatever else shares its batch: a verify step's rows (speculative decoding) equal
   one-token steps, and greedy outputs do not depend on the batch. The same holds for the int8
   and int16 tiles below. */
static inline __attribute__((always_inline)) void float_tile(
        const int MT, int bits, const uint8_t *wr, const float *d, const float *c, int64_t nb, const float *x,
        int64_t ldx, const float *xs, float *y, int64_t ldy) {
    /* Even blocks into a0, odd into a1, the loop unrolled by two: an accumulator picked by a runtime
       index (acc[b & 1]) lives on the stack, and each FMA then waits on a store (3x slower). */
    __m256 a0[TILE], a1[TILE];
    for (int t = 0; t < MT; ++t) a0[t] = a1[t] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b < nb; b += 2) {
        __m256 w[4];
        block_floats(wr, b, bits, w);
        const __m256 dv = _mm256_set1_ps(d[b]);
        for (int t = 0; t < MT; ++t) a0[t] = _mm256_fmadd_ps(block_dot(w, x + t * ldx + b * 32), dv, a0[t]);
        if (b + 1 == nb) break;
        block_floats(wr, b + 1, bits, w);
        const __m256 ev = _mm256_set1_ps(d[b + 1]);
        for (int t = 0; t < MT; ++t) a1[t] = _mm256_fmadd_ps(block_dot(w, x + t * ldx + b * 32 + 32), ev, a1[t]);
    }
    for (int t = 0; t < MT; ++t)
        y[t * ldy] = hsum8(_mm256_add_ps(a0[t], a1[t])) + offsets_dot(bits, c, d, xs + t * nb, nb);
}
/* One token (M = 1), row by row: the tiled loops below without their per-token bookkeeping. Two
   accumulators (even and odd blocks) halve the chain of dependent FMAs the loop waits on. */
static void gemv_float(int bits, const uint8_t *wq, const float *wd, const float *wc, int64_t K, const float *x,
                       const float *xs, float *y, int64_t n0, int64_t n1) {
    const int64_t nb = K / 32, row_bytes = bits == 4 ? K / 2 : K;
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t *wr = wq + n * row_bytes;
        const float *d = wd + n * nb;
        prefetch_ahead(wr, row_bytes);
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps(), w[4], v[4];
        int64_t b = 0;
        for (; b + 2 <= nb; b += 2) {
            block_floats(wr, b, bits, w);
            block_floats(wr, b + 1, bits, v);
            acc0 = _mm256_fmadd_ps(block_dot(w, x + b * 32), _mm256_set1_ps(d[b]), acc0);
            acc1 = _mm256_fmadd_ps(block_dot(v, x + b * 32 + 32), _mm256_set1_ps(d[b + 1]), acc1);
        }
        if (b < nb) {
            block_floats(wr, b, bits, w);
            acc0 = _mm256_fmadd_ps(block_dot(w, x + b * 32), _mm256_set1_ps(d[b]), acc0);
        }
        y[n] = hsum8(_mm256_add_ps(acc0, acc1)) + offsets_dot(bits, wc ? wc + n * nb : 0, d, xs, nb);
    }
}
/* Batches of PANEL_FROM tokens or more, as a dense GEMM does it: 16 weight rows at a time are
   decoded to floats once into a transposed panel wt [K][16] (a per-thread buffer), then every
   MR = 6 tokens take an outer-product register tile: per k, two 8-float loads of wt and six
   broadcasts of x feed 12 FMAs into 12 accumulators (y[t][0..15]). Tokens go in chunks of
   TOKEN_CHUNK so a chunk's activations stay in cache while each panel is swept. */
#define NR 16
#define MR 6
#define TOKEN_CHUNK 480
static inline __attribute__((always_inline)) void outer_tile(const int T, const float *wt, int64_t K,
        const float *x, int64_t ldx, float *y, int64_t ldy, int nr) {
    __m256 acc[MR][2];
    for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; ++k) {
        const __m256 b0 = _mm256_loadu_ps(wt + k * NR), b1 = _mm256_loadu_ps(wt + k * NR + 8);
        for (int t = 0; t < T; ++t) {
            const __m256 xv = _mm256_broadcast_ss(x + t * ldx + k);
            acc[t][0] = _mm256_fmadd_ps(xv, b0, acc[t][0]);
            acc[t][1] = _mm256_fmadd_ps(xv, b1, acc[t][1]);
        }
    }
    for (int t = 0; t < T; ++t) {
        if (nr == NR) {
            _mm256_storeu_ps(y + t * ldy, acc[t][0]);
            _mm256_storeu_ps(y + t * ldy + 8, acc[t][1]);
        } else {  /* the panel's last rows: zero-padded to NR, only nr outputs exist */
            float out[NR];
            _mm256_storeu_ps(out, acc[t][0]);
            _mm256_storeu_ps(out + 8, acc[t][1]);
            memcpy(y + t * ldy, out, sizeof(float) * nr);
        }
    }
}
/* Rows [n0, n0 + nr) of W (nr <= NR) as floats (weight = code d + c), transposed into wt [K][NR]
   (rows past nr are zeros): 8 rows' blocks at a time, by 8x8 register transposes. */
static void decode_panel(int bits, const uint8_t *wq, const float *wd, const float *wc, int64_t K, int64_t n0,
                         int nr, float *wt) {
    const int64_t nb = K / 32, row_bytes = bits == 4 ? K / 2 : K;
    for (int g = 0; g < NR; g += 8) {
        for (int64_t b = 0; b < nb; ++b) {
            __m256 v[4][8];  /* [8-weight group of the block][row] */
            for (int r = 0; r < 8; ++r) {
                const int64_t n = n0 + g + r;
                if (g + r >= nr) {
                    for (int i = 0; i < 4; ++i) v[i][r] = _mm256_setzero_ps();
                    continue;
                }
                __m256 w[4];
                const float d = wd[n * nb + b], c = wc ? wc[n * nb + b] : 0.f;
                block_floats(wq + n * row_bytes, b, bits, w);  /* uncentred nibbles: 8 d comes off c */
                const __m256 dv = _mm256_set1_ps(d), cv = _mm256_set1_ps(bits == 4 ? c - 8.f * d : c);
                for (int i = 0; i < 4; ++i) v[i][r] = _mm256_fmadd_ps(w[i], dv, cv);
            }
            for (int i = 0; i < 4; ++i) {
                transpose8(v[i]);
                for (int j = 0; j < 8; ++j) _mm256_storeu_ps(wt + (b * 32 + i * 8 + j) * NR + g, v[i][j]);
            }
        }
    }
}
/* A per-thread scratch buffer of at least n floats, kept between calls (OpenMP threads persist). */
static float *thread_scratch(size_t n) {
    static __thread float *buf;
    static __thread size_t cap;
    if (n > cap) {
        free(buf);
        buf = malloc(n * sizeof(float));
        cap = n;
    }
    return buf;
}
#define OUTER_TILE(T) case T: outer_tile(T, wt, K, xt, ldx, yt, ldy, nr); break;
static void qgemm_panels(int bits, const uint8_t *wq, const float *wd, const float *wc, int64_t K, const float *x,
                         int64_t ldx, int64_t M, float *y, int64_t ldy, int64_t n0, int64_t n1) {
    float *wt = thread_scratch((size_t)(K * NR));
    for (int64_t c0 = 0; c0 < M; c0 += TOKEN_CHUNK) {
        const int64_t c1 = c0 + TOKEN_CHUNK < M ? c0 + TOKEN_CHUNK : M;
        for (int64_t p0 = n0; p0 < n1; p0 += NR) {
            const int nr = n1 - p0 < NR ? (int)(n1 - p0) : NR;
            decode_panel(bits, wq, wd, wc, K, p0, nr, wt);
            for (int64_t m0 = c0; m0 < c1; m0 += MR) {
                const float *xt = x + m0 * ldx;
                float *yt = y + m0 * ldy + p0;
                switch (c1 - m0 < MR ? (int)(c1 - m0) : MR) {  /* constant token counts keep acc in registers */
                    OUTER_TILE(6) OUTER_TILE(5) OUTER_TILE(4) OUTER_TILE(3) OUTER_TILE(2) OUTER_TILE(1)
                }
            }
        }
    }
}
/* The same with int8 activations (quantize_block's xq / xd / xs / xk of the one token). */
static inline __m256i int8_block(const uint8_t *wr, int64_t b, int bits, const int8_t *xq) {
    const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + b * 32));
    if (bits == 4) return dot_u8s8(unpack_q4(wr + b * 16), xv);
    const __m256i sgn = _mm256_loadu_si256((const __m256i *)(wr + b * 32));
    return dot_u8s8(_mm256_sign_epi8(sgn, sgn), _mm256_sign_epi8(xv, sgn));
}
/* Block e's products with MT tokens of int8 activations into a[t] (the block's codes unpacked once);
   sc [MT, nb]: d[b] xd[t, b]. */
static inline __attribute__((always_inline)) void int8_block_tile(
        const int MT, int bits, const uint8_t *wr, int64_t e, const float *sc, int64_t nb, int64_t K,
        const int8_t *xq, __m256 *a) {
    if (bits == 4) {  /* nibbles 0..15 (unsigned) x int8; the centring comes from xk */
        const __m256i u = unpack_q4(wr + e * 16);
        for (int t = 0; t < MT; ++t) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + t * K + e * 32));
            a[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(u, xv)), _mm256_broadcast_ss(sc + t * nb + e), a[t]);
        }
    } else {  /* the code's sign moved onto x: u8 x s8 products, as maddubs / dpbusd take them */
        const __m256i sgn = _mm256_loadu_si256((const __m256i *)(wr + e * 32)), u = _mm256_sign_epi8(sgn, sgn);
        for (int t = 0; t < MT; ++t) {
            const __m256i xv = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xq + t * K + e * 32)), sgn);
            a[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u8s8(u, xv)), _mm256_broadcast_ss(sc + t * nb + e), a[t]);
        }
    }
}
/* One weight row against MT tokens of int8 activations; each token sums as gemv_int8 does (even
   and odd blocks, d[b] xd[b], then the centring and offset terms), unrolled by two as float_tile
   says why. */
static inline __attribute__((always_inline)) void int8_tile(
        const int MT, int bits, const uint8_t *wr, const float *d, const float *c, int64_t nb, int64_t K,
        const int8_t *xq, const float *xd, const float *xs, const float *xk, float *y, int64_t ldy) {
    float *sc = thread_scratch((size_t)(MT * nb));
    for (int t = 0; t < MT; ++t) mul_f32(d, xd + t * nb, sc + t * nb, nb);
    __m256 a0[TILE], a1[TILE];
    for (int t = 0; t < MT; ++t) a0[t] = a1[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b += 2) {
        int8_block_tile(MT, bits, wr, b, sc, nb, K, xq, a0);
        if (b + 1 == nb) break;
        int8_block_tile(MT, bits, wr, b + 1, sc, nb, K, xq, a1);
    }
    for (int t = 0; t < MT; ++t) {
        float cs = bits == 4 ? dot_f32(d, xk + t * nb, nb) : 0.f;
        if (c) cs += dot_f32(c, xs + t * nb, nb);
        y[t * ldy] = hsum8(_mm256_add_ps(a0[t], a1[t])) + cs;
    }
}
static void gemv_int8(int bits, const uint8_t *wq, const float *wd, const float *wc, int64_t K, const int8_t *xq,
                      const float *xd, const float *xs, const float *xk, float *y, int64_t n0, int64_t n1) {
    const int64_t nb = K / 32, row_bytes = bits == 4 ? K / 2 : K;
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t *wr = wq + n * row_bytes;
        const float *d = wd + n * nb;
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        int64_t b = 0;
        for (; b + 2 <= nb; b += 2) {
            acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(int8_block(wr, b, bits, xq)), _mm256_set1_ps(d[b] * xd[b]), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(int8_block(wr, b + 1, bits, xq)),
                                   _mm256_set1_ps(d[b + 1] * xd[b + 1]), acc1);
        }
        if (b < nb) acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(int8_block(wr, b, bits, xq)), _mm256_set1_ps(d[b] * xd[b]), acc0);
        float cs = bits == 4 ? dot_f32(d, xk, nb) : 0.f;
        if (wc) cs += dot_f32(wc + n * nb, xs, nb);
        y[n] = hsum8(_mm256_add_ps(acc0, acc1)) + cs;
    }
}
/* Block b's 32 codes as two vectors of 16 int16 (weights 0-15, 16-31), in order: the bytes go to
   int16 slots by an in-lane shuffle of a 16-byte broadcast (no cross-lane widening). 4-bit nibbles
   are unsigned (0..15: the centring comes from xk), 8-bit codes signed (the byte lands in the
   slot's high half and an arithmetic shift brings it down). */
static inline void block_i16(const uint8_t *wr, int64_t b, int bits, __m256i w[2]) {
    const __m256i lo = _mm256_setr_epi8(0, -1, 1, -1, 2, -1, 3, -1, 4, -1, 5, -1, 6, -1, 7, -1,
                                        8, -1, 9, -1, 10, -1, 11, -1, 12, -1, 13, -1, 14, -1, 15, -1);
    if (bits == 4) {
        const __m256i v = _mm256_shuffle_epi8(
            _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(wr + b * 16))), lo);
        w[0] = _mm256_and_si256(v, _mm256_set1_epi16(15));
        w[1] = _mm256_srli_epi16(v, 4);
    } else {
        const __m256i hi = _mm256_slli_epi16(lo, 8);  /* byte i into slot i's high half; -1 << 8 keeps bit 7 */
        const __m256i sel = _mm256_or_si256(hi, _mm256_set1_epi16(0x00ff));
        for (int h = 0; h < 2; ++h) {
            const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(wr + b * 32 + h * 16)));
            w[h] = _mm256_srai_epi16(_mm256_shuffle_epi8(v, sel), 8);
        }
    }
}
/* 8 int32 partial sums of a block's 32 products of int16 codes. */
static inline __m256i dot_i16(const __m256i w[2], const int16_t *xv) {
    return madd2_epi16(w[0], _mm256_loadu_si256((const __m256i *)xv), w[1], _mm256_loadu_si256((const __m256i *)(xv + 16)));
}
/* One weight row against MT tokens of int16 activations (xq [MT, K], per token and block the
   scale xd, sums xs and centring xk): the row's blocks are decoded once for the MT tokens. */
static inline __attribute__((always_inline)) void int16_tile(
        const int MT, int bits, const uint8_t *wr, const float *d, const float *c, int64_t nb, int64_t K,
        const int16_t *xq, const float *xd, const float *xs, const float *xk, float *y, int64_t ldy) {
    /* even and odd blocks, as gemv_int16 sums one token; unrolled by two as float_tile says why.
       d[b] xd[t, b] for the row comes first (one broadcast per block and token below). */
    float *sc = thread_scratch((size_t)(MT * nb));
    for (int t = 0; t < MT; ++t) mul_f32(d, xd + t * nb, sc + t * nb, nb);
    __m256 a0[TILE], a1[TILE];
    for (int t = 0; t < MT; ++t) a0[t] = a1[t] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b < nb; b += 2) {
        __m256i w[2];
        block_i16(wr, b, bits, w);
        for (int t = 0; t < MT; ++t)
            a0[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_i16(w, xq + t * K + b * 32)),
                                    _mm256_broadcast_ss(sc + t * nb + b), a0[t]);
        if (b + 1 == nb) break;
        block_i16(wr, b + 1, bits, w);
        for (int t = 0; t < MT; ++t)
            a1[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_i16(w, xq + t * K + b * 32 + 32)),
                                    _mm256_broadcast_ss(sc + t * nb + b + 1), a1[t]);
    }
    for (int t = 0; t < MT; ++t) {
        float cs = c ? dot_f32(c, xs + t * nb, nb) : 0.f;
        if (bits == 4) cs += dot_f32(d, xk + t * nb, nb);
        y[t * ldy] = hsum8(_mm256_add_ps(a0[t], a1[t])) + cs;
    }
}
/* One token, row by row, two accumulators (even and odd blocks) as gemv_float. */
static void gemv_int16(int bits, const uint8_t *wq, const float *wd, const float *wc, int64_t K, const int16_t *xq,
                       const float *xd, const float *xs, const float *xk, float *y, int64_t n0, int64_t n1) {
    const int64_t nb = K / 32, row_bytes = bits == 4 ? K / 2 : K;
    float *sc = thread_scratch((size_t)nb);
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t *wr = wq + n * row_bytes;
        const float *d = wd + n * nb;
        mul_f32(d, xd, sc, nb);
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        __m256i w[2], v[2];
        int64_t b = 0;
        prefetch_ahead(wr, row_bytes);
        for (; b + 2 <= nb; b += 2) {
            block_i16(wr, b, bits, w);
            block_i16(wr, b + 1, bits, v);
            acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_i16(w, xq + b * 32)), _mm256_broadcast_ss(sc + b), acc0);
            acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_i16(v, xq + b * 32 + 32)), _mm256_broadcast_ss(sc + b + 1),
                                   acc1);
        }
        if (b < nb) {
            block_i16(wr, b, bits, w);
            acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_i16(w, xq + b * 32)), _mm256_broadcast_ss(sc + b), acc0);
        }
        float cs = wc ? dot_f32(wc + n * nb, xs, nb) : 0.f;
        if (bits == 4) cs += dot_f32(d, xk, nb);
        y[n] = hsum8(_mm256_add_ps(acc0, acc1)) + cs;
    }
}
/* 4-bit weights with int16 activations, 8 rows interleaved (INTERLEAVED, qmatmul.py's layout): a
   group of 8 rows keeps, per 32-weight block, 4 chunks of 32 bytes; chunk c's byte 4 i + j is row i's
   GGUF-order byte 4 c + j (weights 4c + j in its low nibble, 16 + 4c + j in its high one). So each
   int32 lane of a chunk is one row, and one broadcast of 4 activation bytes serves 8 rows. The int16
   codes x = 256 hi + lo are split into bytes (hi signed, lo unsigned): maddubs takes nibbles x hi
   and lo x nibbles, 32 products each, and the block's sum over 8 rows stays exact in integers:
   sum(q x) = 256 sum(q hi) + sum(q lo). Per 8 rows and block: 16 maddubs, 3 maddwd, one
   conversion and one FMA, against 16 maddwd, 8 conversions and 8 FMAs row by row, and no
   horizontal sums: 1.2-1.5x the GB/s of the row-major kernel at one token from DRAM on Zen 3
   (scripts/bench_gemv_layout.py). The int16 sums (lo: at most 4 x 2 x 255 x 15 = 30600; hi:
   8 x 2 x 128 x 15 = 30720) cannot overflow. */
#if HAS_VNNI
/* With VNNI, vpdpbusd sums 4 byte products straight into int32 lanes: the nibbles are both
   unsigned bytes (against the signed hi bytes) and non-negative signed ones (against the unsigned
   lo bytes), so per chunk 4 dpbusd replace 4 maddubs and their int16 adds, and the final widening
   madds go. The same integers, so the same floats after: batch-invariant and equal to the path
   without VNNI. Four accumulators keep the dependency chains short. */
static inline __m256i il_sum_unpacked(const __m256i w[8], const uint8_t *lo, const int8_t *hi) {
    const int32_t *l4 = (const int32_t *)lo, *h4 = (const int32_t *)hi;
    __m256i sl0 = _mm256_setzero_si256(), sl1 = _mm256_setzero_si256();
    __m256i sh0 = _mm256_setzero_si256(), sh1 = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
        sl0 = dpbusd(sl0, _mm256_set1_epi32(l4[c]), w[2 * c]);
        sl1 = dpbusd(sl1, _mm256_set1_epi32(l4[4 + c]), w[2 * c + 1]);
        sh0 = dpbusd_bcast(sh0, w[2 * c], h4 + c);
        sh1 = dpbusd_bcast(sh1, w[2 * c + 1], h4 + 4 + c);
    }
    return _mm256_add_epi32(_mm256_add_epi32(sl0, sl1), _mm256_slli_epi32(_mm256_add_epi32(sh0, sh1), 8));
}
#else
static inline __m256i il_sum_unpacked(const __m256i w[8], const uint8_t *lo, const int8_t *hi) {
    const int32_t *l4 = (const int32_t *)lo, *h4 = (const int32_t *)hi;
    __m256i pl0 = _mm256_setzero_si256(), pl1 = _mm256_setzero_si256(), ph = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
        pl0 = _mm256_add_epi16(pl0, _mm256_maddubs_epi16(_mm256_set1_epi32(l4[c]), w[2 * c]));
        pl1 = _mm256_add_epi16(pl1, _mm256_maddubs_epi16(_mm256_set1_epi32(l4[4 + c]), w[2 * c + 1]));
        ph = _mm256_add_epi16(ph, _mm256_add_epi16(_mm256_maddubs_epi16(w[2 * c], _mm256_set1_epi32(h4[c])),
                                                  _mm256_maddubs_epi16(w[2 * c + 1], _mm256_set1_epi32(h4[4 + c]))));
    }
    const __m256i ones = _mm256_set1_epi16(1);
    return _mm256_add_epi32(_mm256_add_epi32(_mm256_madd_epi16(pl0, ones), _mm256_madd_epi16(pl1, ones)),
                            _mm256_madd_epi16(ph, _mm256_set1_epi16(256)));
}
#endif
/* The same block's 8 rows against one token's int8 codes x (a prefill's activations, opt-in
   decode's): the nibbles are the unsigned operand and x the signed one, so each chunk takes one
   dpbusd per nibble half, half the int16 codes' products. Without VNNI maddubs pairs (at most
   2 x 15 x 128) summed over the 8 stay under 32767 before one widening madd. */
#if HAS_VNNI
static inline __m256i il_sum_unpacked8(const __m256i w[8], const int8_t *x) {
    const int32_t *x4 = (const int32_t *)x;
    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
        s0 = dpbusd_bcast(s0, w[2 * c], x4 + c);
        s1 = dpbusd_bcast(s1, w[2 * c + 1], x4 + 4 + c);
    }
    return _mm256_add_epi32(s0, s1);
}
#else
static inline __m256i il_sum_unpacked8(const __m256i w[8], const int8_t *x) {
    const int32_t *x4 = (const int32_t *)x;
    __m256i p = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c)
        p = _mm256_add_epi16(p, _mm256_add_epi16(_mm256_maddubs_epi16(w[2 * c], _mm256_set1_epi32(x4[c])),
                                                 _mm256_maddubs_epi16(w[2 * c + 1], _mm256_set1_epi32(x4[4 + c]))));
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}
#endif
/* A block's 4 chunks of codes as bytes: w[2 c] the low nibbles of chunk c, w[2 c + 1] its high ones. */
static inline void il_unpack_block(const uint8_t *wb, __m256i w[8]) {
    const __m256i m4 = _mm256_set1_epi8(15);
    for (int c = 0; c < 4; ++c) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(wb + 32 * c));
        w[2 * c] = _mm256_and_si256(v, m4);
        w[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    }
}
/* Block b of a group (codes wg [nb][128]) unpacked as il_unpack_block, the bytes IL_AHEAD
   past it asked for: what each multi-token kernel does once per block. */
static inline void il_fetch_block(const uint8_t *wg, int64_t b, __m256i w[8]) {
    const uint8_t *wb = wg + b * 128;
    _mm_prefetch((const char *)wb + IL_AHEAD, IL_HINT);
    _mm_prefetch((const char *)wb + IL_AHEAD + 64, IL_HINT);
    il_unpack_block(wb, w);
}
static inline __m256i il_block_sum(const uint8_t *wb, const uint8_t *lo, const int8_t *hi) {
    __m256i w[8];
    il_unpack_block(wb, w);
    return il_sum_unpacked(w, lo, hi);
}
/* How a weight's scales are stored (qmatmul.py's Blocks.kind): float32, float16 (HALF_SCALES), or
   factored (KSCALES, il_group_k). */
enum { SC_F32 = 0, SC_F16 = 1, SC_K = 2 };
/* The group's 8 scales of block b: float16 read as they are (F16C), or float32. */
static inline __m256 il_scales(const void *dg, const int SCL, int64_t b) {
#if defined(__F16C__)  /* (no F16C: SC_F16 never reaches here) */
    if (SCL == SC_F16) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)dg + b * 8)));
#endif
    return _mm256_loadu_ps((const float *)dg + b * 8);
}
/* acc + (sum(q x) - 8 sum(x)) d xd: one block's integer sums (cs: sum(x); 0 for codes that are not
   centred, 8-bit) into a row's float accumulator. */
static inline __m256 il_scaled(__m256i sum, int32_t cs, __m256 d, float xd, __m256 acc) {
    const __m256i s = _mm256_sub_epi32(sum, _mm256_set1_epi32(8 * cs));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, _mm256_set1_ps(xd)), acc);
}
/* (a0 + a1) + ac in that order: the empty asm keeps -ffast-math from reassociating the sum one way
   in one kernel and another way in its multi-token twin (their bits must agree). */
static inline __m256 il_sum3(__m256 a0, __m256 a1, __m256 ac) {
    __m256 s = _mm256_add_ps(a0, a1);
    __asm__("" : "+x"(s));
    return _mm256_add_ps(s, ac);
}
/* A group's 8 outputs from its even- and odd-block accumulators and the offsets' sum c xs (cg
   [nb][8]; NULL: no offsets). */
static inline __m256 il_finish(__m256 a0, __m256 a1, const float *cg, int64_t nb, const float *xs) {
    __m256 ac = _mm256_setzero_ps();
    if (cg)
        for (int64_t b = 0; b < nb; ++b) ac = _mm256_fmadd_ps(_mm256_loadu_ps(cg + b * 8), _mm256_set1_ps(xs[b]), ac);
    return il_sum3(a0, a1, ac);
}
static inline __attribute__((always_inline)) __m256 il_block(
        const uint8_t *wg, const void *dg, const int SCL, int64_t b, const uint8_t *lo, const int8_t *hi,
        const int32_t *cs, const float *xd, __m256 acc) {
    const uint8_t *wb = wg + b * 128;
    _mm_prefetch((const char *)wb + IL_AHEAD, IL_HINT);
    _mm_prefetch((const char *)wb + IL_AHEAD + 64, IL_HINT);
    return il_scaled(il_block_sum(wb, lo + b * 32, hi + b * 32), cs[b], il_scales(dg, SCL, b), xd[b], acc);
}
/* One group (codes wg [nb][128]; scales dg [nb][8], float16 (SC_F16) or float32; offsets cg
   [nb][8], NULL without offsets) against one token: its 8 outputs. Per row: sum over blocks of d xd
   (sum(q x) - 8 sum(x)), even and odd blocks in two accumulators, then the offsets' sum c xs: the
   same arithmetic whichever tokens share the batch (tokens take the group one at a time), so
   outputs are batch-invariant. */
static inline __attribute__((always_inline)) __m256 il_group(
        const uint8_t *wg, const void *dg, const int SCL, const float *cg, int64_t nb, const uint8_t *lo,
        const int8_t *hi, const int32_t *cs, const float *xd, const float *xs) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {  /* unrolled by two, as float_tile says why */
        a0 = il_block(wg, dg, SCL, b, lo, hi, cs, xd, a0);
        a1 = il_block(wg, dg, SCL, b + 1, lo, hi, cs, xd, a1);
    }
    if (b < nb) a0 = il_block(wg, dg, SCL, b, lo, hi, cs, xd, a0);
    return il_finish(a0, a1, cg, nb, xs);
}
/* How many tokens share one unpacking of a block (il_group_m, il_group_k_m): a verify step's rows
   or a small decode batch. */
#define IL_TOKENS 8
/* il_group for T tokens (2 to IL_TOKENS; token t's lo / hi at + t K, cs / xd / xs at + t nb): each
   block is loaded and unpacked once for all of them, then each token's sums and float steps are
   il_group's, in its order (even blocks into a0, odd ones into a1), so every output is the bits
   il_group gives that token alone. At one token per group il_group does the unpacking beside the
   products; here it is paid once per T, which is most of what a second row cost (verify rows). */
static void il_group_m(const uint8_t *wg, const void *dg, const int SCL, const float *cg, int64_t nb, int64_t K,
                       const uint8_t *lo, const int8_t *hi, const int32_t *cs, const float *xd, const float *xs,
                       int T, __m256 *out) {
    __m256 acc[2][IL_TOKENS];
    for (int t = 0; t < T; ++t) acc[0][t] = acc[1][t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        __m256i w[8];
        il_fetch_block(wg, b, w);
        const __m256 d = il_scales(dg, SCL, b);
        __m256 *a = acc[b & 1];
        for (int t = 0; t < T; ++t)
            a[t] = il_scaled(il_sum_unpacked(w, lo + t * K + b * 32, hi + t * K + b * 32), cs[t * nb + b], d,
                             xd[t * nb + b], a[t]);
    }
    for (int t = 0; t < T; ++t) out[t] = il_finish(acc[0][t], acc[1][t], cg, nb, xs + t * nb);
}
/* 8 unsigned byte codes (a block's 6-bit scale or offset codes for 8 rows) as floats. */
static inline __m256 k_codes(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
/* acc + sum(q x) sc D xd: one block's integer sums into a row's float accumulator (factored scales).
   The empty asm keeps D xd as computed: under -ffast-math GCC may otherwise reassociate the
   product as (sc D) xd where sc D is loop-invariant (il_group_k_m's token loop) and not where it
   is not (il_group_k), and a token's bits would depend on its batch. */
static inline __m256 il_k_scaled(__m256i sum, __m256 sc, __m256 D, float xd, __m256 acc) {
    __m256 f = _mm256_mul_ps(D, _mm256_set1_ps(xd));
    __asm__("" : "+x"(f));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(sc, f), acc);
}
/* il_group for factored scales (KSCALES; dg: the group's codes [nb / 8][sc 8, m 8][8 rows], cg:
   their factors [nb / 8][D, Dm][8 rows] float16). The factors are read once per 256 weights and the
   nibbles stay uncentred: per row, sum over blocks of D sc xd sum(q x), plus Dm times the offset
   codes' sum m xs over the 256. Turning the codes into floats costs operations per block that
   float scales do not, and at one token this kernel is bound by operations rather than bytes: 3B
   shapes from DRAM (scripts/bench_gemv_layout.py) 6.5 ms against 7.2 for il_group on scales widened
   per block, 7.0 on float32 scales (a third more bytes) and 5.3 for Q4_0's form (no offsets).
   Batch-invariant as il_group. */
static inline __m256 il_group_k(const uint8_t *wg, const uint8_t *dg, const uint16_t *cg, int64_t nb,
                                const uint8_t *lo, const int8_t *hi, const float *xd, const float *xs) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), ac = _mm256_setzero_ps();
    for (int64_t s = 0; s < nb / 8; ++s) {
        const __m256 D = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(cg + s * 16)));
        const __m256 Dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(cg + s * 16 + 8)));
        const uint8_t *sc = dg + s * 128, *m = sc + 64;
        __m256 ms = _mm256_setzero_ps();
        for (int64_t j = 0; j < 8; j += 2) {
            const int64_t b = s * 8 + j;
            const uint8_t *wb = wg + b * 128;
            _mm_prefetch((const char *)wb + IL_AHEAD, IL_HINT);
            _mm_prefetch((const char *)wb + IL_AHEAD + 64, IL_HINT);
            _mm_prefetch((const char *)wb + IL_AHEAD + 128, IL_HINT);
            _mm_prefetch((const char *)wb + IL_AHEAD + 192, IL_HINT);
            a0 = il_k_scaled(il_block_sum(wb, lo + b * 32, hi + b * 32), k_codes(sc + j * 8), D, xd[b], a0);
            a1 = il_k_scaled(il_block_sum(wb + 128, lo + b * 32 + 32, hi + b * 32 + 32), k_codes(sc + j * 8 + 8), D,
                             xd[b + 1], a1);
            ms = _mm256_fmadd_ps(k_codes(m + j * 8 + 8), _mm256_set1_ps(xs[b + 1]),
                                 _mm256_fmadd_ps(k_codes(m + j * 8), _mm256_set1_ps(xs[b]), ms));
        }
        ac = _mm256_fmadd_ps(Dm, ms, ac);
    }
    return il_sum3(a0, a1, ac);
}
/* il_group_k for T tokens (as il_group_m: each block unpacked once, each token's operations those
   of il_group_k in its order, so the same bits as alone). */
static void il_group_k_m(const uint8_t *wg, const uint8_t *dg, const uint16_t *cg, int64_t nb, int64_t K,
                         const uint8_t *lo, const int8_t *hi, const float *xd, const float *xs, int T, __m256 *out) {
    __m256 acc[2][IL_TOKENS], ac[IL_TOKENS], ms[IL_TOKENS];
    for (int t = 0; t < T; ++t) acc[0][t] = acc[1][t] = ac[t] = _mm256_setzero_ps();
    for (int64_t s = 0; s < nb / 8; ++s) {
        const __m256 D = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(cg + s * 16)));
        const __m256 Dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(cg + s * 16 + 8)));
        const uint8_t *sc = dg + s * 128, *m = sc + 64;
        for (int t = 0; t < T; ++t) ms[t] = _mm256_setzero_ps();
        for (int64_t j = 0; j < 8; ++j) {
            const int64_t b = s * 8 + j;
            __m256i w[8];
            il_fetch_block(wg, b, w);
            const __m256 c = k_codes(sc + j * 8), mc = k_codes(m + j * 8);
            __m256 *a = acc[j & 1];
            for (int t = 0; t < T; ++t) {
                a[t] = il_k_scaled(il_sum_unpacked(w, lo + t * K + b * 32, hi + t * K + b * 32), c, D,
                                   xd[t * nb + b], a[t]);
                ms[t] = _mm256_fmadd_ps(mc, _mm256_set1_ps(xs[t * nb + b]), ms[t]);
            }
        }
        for (int t = 0; t < T; ++t) ac[t] = _mm256_fmadd_ps(Dm, ms[t], ac[t]);
    }
    for (int t = 0; t < T; ++t) out[t] = il_sum3(acc[0][t], acc[1][t], ac[t]);
}
/* 4-bit interleaved weights against int8 codes (a prefill's activations; decode's where int8 is
   chosen), T tokens (1, 2, 4 or 8: a constant, so the accumulators stay in registers) packed block
   by block: codes xp [nb][T][32], 8 x their sums cp, scales xd and exact sums xs [nb][T] (one
   pointer walks every token's block). Per token and row, one accumulator over the blocks: d xd
   (sum(q x) - 8 cs), then the block's offset coefficient e against the exact sum xs (e = c, or
   for factored scales (SC_K) d = D sc and e = Dm m + 8 D sc: the nibbles centred as in the other
   scales; uncentred, an int8 rounding error of x would be weighted by a code up to 15, not 8).
   Each token's operations do not depend on T (batch-invariant). Per block and token: 8 dpbusd,
   half the int16 codes' 16 (two bytes per activation). */
/* Token t's share of block b (i: its place in the packed run) into acc. */
#define IL8_TOKEN(t, acc) if (T > t) { \
        const int64_t i = b * T + t; \
        const __m256i s_ = _mm256_sub_epi32(il_sum_unpacked8(w, xp + i * 32), _mm256_set1_epi32(cp[i])); \
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s_), _mm256_mul_ps(d, _mm256_set1_ps(xd[i])), acc); \
        if (SCL == SC_K || cg) acc = _mm256_fmadd_ps(e, _mm256_set1_ps(xs[i]), acc); }
static inline __attribute__((always_inline)) void il8_tile(
        const int T, const int SCL, const uint8_t *wg, const void *dg, const void *cg, int64_t nb,
        const int8_t *xp, const int32_t *cp, const float *xd, const float *xs, __m256 *out) {
    /* eight named accumulators: an array of them stayed in memory (GCC 12) */
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t b = 0; b < nb; ++b) {
        __m256i w[8];
        il_fetch_block(wg, b, w);
        __m256 d, e = _mm256_setzero_ps();
        if (SCL == SC_K) {  /* factored: codes [nb / 8][sc 8, m 8][8 rows], factors [nb / 8][D, Dm][8 rows] */
            const uint16_t *f = (const uint16_t *)cg + b / 8 * 16;
            const uint8_t *sc = (const uint8_t *)dg + b / 8 * 128 + b % 8 * 8;
            const __m256 D = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)f));
            const __m256 Dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(f + 8)));
            d = _mm256_mul_ps(D, k_codes(sc));
            e = _mm256_fmadd_ps(Dm, k_codes(sc + 64), _mm256_mul_ps(d, _mm256_set1_ps(8.f)));
        } else {
            d = il_scales(dg, SCL, b);
            if (cg) e = _mm256_loadu_ps((const float *)cg + b * 8);
        }
        IL8_TOKEN(0, a0) IL8_TOKEN(1, a1) IL8_TOKEN(2, a2) IL8_TOKEN(3, a3)
        IL8_TOKEN(4, a4) IL8_TOKEN(5, a5) IL8_TOKEN(6, a6) IL8_TOKEN(7, a7)
    }
    out[0] = a0; out[1] = a1; out[2] = a2; out[3] = a3; out[4] = a4; out[5] = a5; out[6] = a6; out[7] = a7;
}
#define IL8_TILE(T) do { \
        if (scl == SC_K) il8_tile(T, SC_K, wg, dg, cg, nb, xp, cp, pd, ps, o); \
        else if (scl == SC_F16) il8_tile(T, SC_F16, wg, dg, cg, nb, xp, cp, pd, ps, o); \
        else il8_tile(T, SC_F32, wg, dg, cg, nb, xp, cp, pd, ps, o); } while (0)
/* 8-bit weights with int16 activations, 8 rows interleaved (INTERLEAVED): the same permutation of
   4-byte words as 4-bit, a block of 32 signed codes being 2 units of 16 row bytes, so a group's block
   is 256 bytes, 8 chunks of 32: chunk c's bytes 4 i + j are row i's weight 4 c + j. The codes are
   widened to int16 (vpmovsxbw, 16 bytes: 4 rows x 4 weights) and multiplied by the 4 activations
   broadcast (vpmaddwd: a lane holds one row's two products), the int16 activations taken whole (no
   byte split: a byte code times an activation byte overflows maddubs's int16 pairs). Per 8 rows and
   block: 16 widenings, 16 maddwd, 16 adds, one horizontal add, permute, conversion and FMA, against
   the row-major kernel's 8 x (4 shuffles and shifts, 2 maddwd, add, conversion, FMA) and 8
   horizontal sums: ~1.3x its GB/s at one token from DRAM on Zen 3. Sums stay in int32 (32 x 128 x
   32767 < 2^31). */
/* A block's codes widened to int16: w[2 c] and w[2 c + 1] the two halves of chunk c (rows 0-3 and 4-7). */
static inline void il8_widen(const uint8_t *wb, __m256i w[16]) {
    for (int c = 0; c < 8; ++c) {
        w[2 * c] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wb + 32 * c)));
        w[2 * c + 1] = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wb + 32 * c + 16)));
    }
}
static inline __m256i il8_sum_widened(const __m256i w[16], const int16_t *xv) {
    __m256i a = _mm256_setzero_si256(), b = _mm256_setzero_si256();
    for (int c = 0; c < 8; ++c) {
        int64_t x4;
        memcpy(&x4, xv + 4 * c, 8);
        const __m256i xb = _mm256_set1_epi64x(x4);
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
        a = _mm256_dpwssd_epi32(a, xb, w[2 * c]);
        b = _mm256_dpwssd_epi32(b, xb, w[2 * c + 1]);
#elif defined(__AVXVNNI__)
        a = _mm256_dpwssd_avx_epi32(a, xb, w[2 * c]);
        b = _mm256_dpwssd_avx_epi32(b, xb, w[2 * c + 1]);
#else
        a = _mm256_add_epi32(a, _mm256_madd_epi16(w[2 * c], xb));  /* rows 0-3, two lanes each */
        b = _mm256_add_epi32(b, _mm256_madd_epi16(w[2 * c + 1], xb));  /* rows 4-7 */
#endif
    }
    /* hadd: rows [0 1 4 5 | 2 3 6 7]; the 64-bit permute puts them in order */
    return _mm256_permute4x64_epi64(_mm256_hadd_epi32(a, b), 0xD8);
}
static inline __m256i il8_block_sum(const uint8_t *wb, const int16_t *xv) {
    __m256i w[16];
    il8_widen(wb, w);
    return il8_sum_widened(w, xv);
}
/* il_group for 8-bit codes (group wg [nb][256]) and one token's int16 codes x: per row, sum over
   blocks of d xd sum(q x), then the offsets' c xs. Batch-invariant as il_group. */
static inline __m256 il8_group(const uint8_t *wg, const void *dg, const int SCL, const float *cg, int64_t nb,
                               const int16_t *x, const float *xd, const float *xs) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *wb = wg + b * 256;
        for (int l = 0; l < 4; ++l) _mm_prefetch((const char *)wb + IL_AHEAD + 64 * l, IL_HINT);
        const __m256i s = il8_block_sum(wb, x + b * 32);
        if (b & 1) a1 = il_scaled(s, 0, il_scales(dg, SCL, b), xd[b], a1);  /* even and odd blocks, as il_group */
        else a0 = il_scaled(s, 0, il_scales(dg, SCL, b), xd[b], a0);
    }
    return il_finish(a0, a1, cg, nb, xs);
}
/* il8_group for T tokens (2 to IL_TOKENS; token t's x at + t K, xd / xs at + t nb): each block
   widened once for all of them (il_group_m), each token's operations il8_group's in its order. */
static void il8_group_m(const uint8_t *wg, const void *dg, const int SCL, const float *cg, int64_t nb, int64_t K,
                        const int16_t *x, const float *xd, const float *xs, int T, __m256 *out) {
    __m256 acc[2][IL_TOKENS];
    for (int t = 0; t < T; ++t) acc[0][t] = acc[1][t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *wb = wg + b * 256;
        for (int l = 0; l < 4; ++l) _mm_prefetch((const char *)wb + IL_AHEAD + 64 * l, IL_HINT);
        __m256i w[16];
        il8_widen(wb, w);
        const __m256 d = il_scales(dg, SCL, b);
        __m256 *a = acc[b & 1];
        for (int t = 0; t < T; ++t)
            a[t] = il_scaled(il8_sum_widened(w, x + t * K + b * 32), 0, d, xd[t * nb + b], a[t]);
    }
    for (int t = 0; t < T; ++t) out[t] = il_finish(acc[0][t], acc[1][t], cg, nb, xs + t * nb);
}
#endif

/* A per-thread byte buffer kept between calls, 64-byte aligned: il_int16's split codes, il_chunk's
   row-major copies or amx_linear's panels. */
static uint8_t *split_scratch(size_t n) {
    static __thread uint8_t *buf;
    static __thread size_t cap;
    if (n > cap) {
        free(buf);
        cap = (n + 63) & ~(size_t)63;
        buf = aligned_alloc(64, cap);
    }
    return buf;
}
#if defined(__AVX2__)
/* Per token, int16 codes xq [M, K] as bytes: lo (unsigned) and hi (signed), x = 256 hi + lo, and
   each block's code sum cs [M, K/32]. */
static void split_codes(const int16_t *xq, int64_t M, int64_t K, uint8_t *lo, int8_t *hi, int32_t *cs) {
    for (int64_t i = 0; i < M * K; ++i) {
        lo[i] = (uint8_t)(xq[i] & 255);
        hi[i] = (int8_t)(xq[i] >> 8);
    }
    for (int64_t i = 0; i < M * K / 32; ++i) {
        int32_t s = 0;
        for (int j = 0; j < 32; ++j) s += xq[i * 32 + j];
        cs[i] = s;
    }
}
#endif
#if defined(__AVX2__)
/* One unit of 16 row bytes of a group of 8 interleaved rows (4 chunks of 32 bytes at src, a 4-byte
   word per row in each): r[i] holds rows i (low half) and i + 4 (high half), each its 4 words in
   chunk order, by a 4 x 8 transpose of 32-bit words. */
static inline void il_rows_of_unit(const uint8_t *src, __m256i r[4]) {
    const __m256i c0 = _mm256_loadu_si256((const __m256i *)src);
    const __m256i c1 = _mm256_loadu_si256((const __m256i *)(src + 32));
    const __m256i c2 = _mm256_loadu_si256((const __m256i *)(src + 64));
    const __m256i c3 = _mm256_loadu_si256((const __m256i *)(src + 96));
    const __m256i t0 = _mm256_unpacklo_epi32(c0, c1), t1 = _mm256_unpackhi_epi32(c0, c1);
    const __m256i t2 = _mm256_unpacklo_epi32(c2, c3), t3 = _mm256_unpackhi_epi32(c2, c3);
    r[0] = _mm256_unpacklo_epi64(t0, t2);
    r[1] = _mm256_unpackhi_epi64(t0, t2);
    r[2] = _mm256_unpacklo_epi64(t1, t3);
    r[3] = _mm256_unpackhi_epi64(t1, t3);
}
#endif
/* The row-major copy of interleaved rows [a, e) (codes [e - a, row bytes], scales and offsets
   [e - a, K / 32]): what every other kernel reads. The codes are units of 16 row bytes (a 4-bit
   block, half an 8-bit one), each 4 chunks of 32 bytes in a group; whole groups go by a 4 x 8
   transpose of 32-bit words per unit (AVX2); a group cut by a or e, row by row. */
static void il_unpack(int bits, const uint8_t *wq, const float *wd, const float *wc, int64_t K, int64_t a, int64_t e,
                      uint8_t *codes, float *d, float *c) {
    const int64_t nb = K / 32, rb = bits == 4 ? K / 2 : K, nu = rb / 16;
    for (int64_t g0 = a & ~(int64_t)7; g0 < e; g0 += 8) {
        const int64_t g = g0 >> 3;
        const float *dg = wd + g * nb * 8, *cg = wc ? wc + g * nb * 8 : 0;
#if defined(__AVX2__)
        if (g0 >= a && g0 + 8 <= e) {
            uint8_t *out = codes + (g0 - a) * rb;
            for (int64_t u = 0; u < nu; ++u) {
                __m256i r[4];
                il_rows_of_unit(wq + (g * nu + u) * 128, r);
                for (int i = 0; i < 4; ++i) {  /* rows i and i + 4 */
                    _mm_storeu_si128((__m128i *)(out + i * rb + u * 16), _mm256_castsi256_si128(r[i]));
                    _mm_storeu_si128((__m128i *)(out + (i + 4) * rb + u * 16), _mm256_extracti128_si256(r[i], 1));
                }
            }
            for (int i = 0; i < 8; ++i)
                for (int64_t b = 0; b < nb; ++b) {
                    d[(g0 - a + i) * nb + b] = dg[b * 8 + i];
                    if (c) c[(g0 - a + i) * nb + b] = cg[b * 8 + i];
                }
            continue;
        }
#endif
        for (int64_t n = g0 > a ? g0 : a; n < g0 + 8 && n < e; ++n) {
            const int64_t i = n & 7;
            for (int64_t u = 0; u < nu; ++u)
                for (int ch = 0; ch < 4; ++ch)
                    memcpy(codes + (n - a) * rb + u * 16 + 4 * ch, wq + (g * nu + u) * 128 + 32 * ch + 4 * i, 4);
            for (int64_t b = 0; b < nb; ++b) {
                d[(n - a) * nb + b] = dg[b * 8 + i];
                if (c) c[(n - a) * nb + b] = cg[b * 8 + i];
            }
        }
    }
}

/* y[m, n] (row stride ldy) for rows n in [n0, n1), x given as quantize_block's int16 xq / xd / xs / xk. */
static void qgemm_int16act(int bits, const uint8_t *wq, const float *wd, const float *wc, int64_t K,
                           const int16_t *xq, const float *xd, const float *xs, const float *xk, int64_t M, float *y,
                           int64_t ldy, int64_t n0, int64_t n1) {
    const int64_t nb = K / 32, row_bytes = bits == 4 ? K / 2 : K;
#if defined(__AVX2__)
    if (M == 1) { gemv_int16(bits, wq, wd, wc, K, xq, xd, xs, xk, y, n0, n1); return; }
#endif
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t *wr = wq + n * row_bytes;
        const float *d = wd + n * nb, *c = wc ? wc + n * nb : 0;
        for (int64_t m0 = 0; m0 < M; m0 += TILE) {
            const int mt = M - m0 < TILE ? (int)(M - m0) : TILE;
#if defined(__AVX2__)
            if (m0 == 0) prefetch_ahead(wr, row_bytes);
            const int16_t *xt = xq + m0 * K;
            const float *xdt = xd + m0 * nb, *xst = xs + m0 * nb, *xkt = xk + m0 * nb;
            float *yt = y + m0 * ldy + n;
            TILE_SWITCH(mt, int16_tile, bits, wr, d, c, nb, K, xt, xdt, xst, xkt, yt, ldy);
#else
            for (int t = 0; t < mt; ++t) {
                float acc = 0.f, cs = 0.f;
                for (int64_t b = 0; b < nb; ++b) {
                    const int64_t r = (m0 + t) * nb + b;
                    const int16_t *xv = xq + (m0 + t) * K + b * 32;
                    int32_t s = 0;
                    if (bits == 4)  /* unsigned nibbles, centred by xk below */
                        for (int j = 0; j < 16; ++j) s += (wr[b * 16 + j] & 15) * xv[j] + (wr[b * 16 + j] >> 4) * xv[j + 16];
                    else
                        for (int j = 0; j < 32; ++j) s += (int32_t)(int8_t)wr[b * 32 + j] * xv[j];
                    acc += (float)s * d[b] * xd[r];
                    cs += (c ? c[b] * xs[r] : 0.f) + (bits == 4 ? d[b] * xk[r] : 0.f);
                }
                y[(m0 + t) * ldy + n] = acc + cs;
            }
#endif
        }
    }
}

/* y[m, n] (row stride ldy) = sum_k x[m, k] w[n, k] for rows n in [n0, n1), x given as
   quantize_block's xq / xd / xs. */
static void qgemm_int8act(int bits, const uint8_t *wq, const float *wd, const float *wc, int64_t K,
                   const int8_t *xq, const float *xd, const float *xs, const float *xk, int64_t M, float *y,
                   int64_t ldy, int64_t n0, int64_t n1) {
    const int64_t nb = K / 32, row_bytes = bits == 4 ? K / 2 : K;
#if defined(__AVX2__)
    if (M == 1) { gemv_int8(bits, wq, wd, wc, K, xq, xd, xs, xk, y, n0, n1); return; }
#endif
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t *wr = wq + n * row_bytes;
        const float *d = wd + n * nb, *c = wc ? wc + n * nb : 0;
        for (int64_t m0 = 0; m0 < M; m0 += TILE) {
            const int mt = M - m0 < TILE ? (int)(M - m0) : TILE;
#if defined(__AVX2__)
            const int8_t *xt = xq + m0 * K;
            const float *xdt = xd + m0 * nb, *xst = xs + m0 * nb, *xkt = xk + m0 * nb;
            float *yt = y + m0 * ldy + n;
            TILE_SWITCH(mt, int8_tile, bits, wr, d, c, nb, K, xt, xdt, xst, xkt, yt, ldy);
#else
            float acc[TILE] = {0.f, 0.f, 0.f, 0.f}, cs[TILE] = {0.f, 0.f, 0.f, 0.f};
            for (int64_t b = 0; b < nb; ++b) {
                int8_t w[32];
                codes_of(wr, b, bits, w);
                for (int t = 0; t < mt; ++t) {
                    const int64_t r = (m0 + t) * nb + b;
                    const int8_t *xv = xq + (m0 + t) * K + b * 32;
                    int32_t s = 0;
                    for (int j = 0; j < 32; ++j) s += (int32_t)w[j] * (int32_t)xv[j];
                    acc[t] += (float)s * d[b] * xd[r];
                    if (c) cs[t] += c[b] * xs[r];
                }
            }
            for (int t = 0; t < mt; ++t) y[(m0 + t) * ldy + n] = acc[t] + cs[t];
#endif
        }
    }
}

/* The same with float activations x [M, K] (row stride ldx) and their block sums xs [M, K/32]. */
static void qgemm_floatact(int bits, const uint8_t *wq, const float *wd, const float *wc, int64_t K,
                    const float *x, int64_t ldx, const float *xs, int64_t M, float *y, int64_t ldy, int64_t n0,
                    int64_t n1) {
    const int64_t nb = K / 32, row_bytes = bits == 4 ? K / 2 : K;
#if defined(__AVX2__)
    if (M == 1) { gemv_float(bits, wq, wd, wc, K, x, xs, y, n0, n1); return; }
    if (M >= PANEL_FROM) { qgemm_panels(bits, wq, wd, wc, K, x, ldx, M, y, ldy, n0, n1); return; }
#endif
    for (int64_t n = n0; n < n1; ++n) {
        const uint8_t *wr = wq + n * row_bytes;
        const float *d = wd + n * nb, *c = wc ? wc + n * nb : 0;
        for (int64_t m0 = 0; m0 < M; m0 += TILE) {
            const int mt = M - m0 < TILE ? (int)(M - m0) : TILE;
            float cs[TILE] = {0.f, 0.f, 0.f, 0.f};
#if defined(__AVX2__)
            (void)cs;
            const float *xt = x + m0 * ldx, *xst = xs + m0 * nb;
            float *yt = y + m0 * ldy + n;
            TILE_SWITCH(mt, float_tile, bits, wr, d, c, nb, xt, ldx, xst, yt, ldy);
#else
            float acc[TILE] = {0.f, 0.f, 0.f, 0.f};
            for (int64_t b = 0; b < nb; ++b) {
                int8_t code[32];
                float w[32];
                codes_of(wr, b, bits, code);
                for (int j = 0; j < 32; ++j) w[j] = code[j];
                for (int t = 0; t < mt; ++t) {
                    const float *xv = x + (m0 + t) * ldx + b * 32;
                    float s = 0.f;
                    for (int j = 0; j < 32; ++j) s += w[j] * xv[j];
                    acc[t] += s * d[b];
                    if (c) cs[t] += c[b] * xs[(m0 + t) * nb + b];
                }
            }
            for (int t = 0; t < mt; ++t) y[(m0 + t) * ldy + n] = acc[t] + cs[t];
#endif
        }
    }
}

/* float16 <-> float32 for scales: F16C 8 at a time where the ISA level has it, else bit by bit. */
static inline float half_to_float(uint16_t h) {
    const uint32_t exp = (h >> 10) & 31, man = h & 1023;
    uint32_t u;
    float f;
    if (exp == 0) {  /* zero and subnormals: man * 2^-24 */
        f = ldexpf((float)man, -24);
        memcpy(&u, &f, 4);
    } else {
        u = exp == 31 ? 0x7f800000u | (man << 13) : ((exp + 112) << 23) | (man << 13);
    }
    u |= (uint32_t)(h & 0x8000) << 16;
    memcpy(&f, &u, 4);
    return f;
}
static void halves_to_floats(const uint16_t *h, float *f, int64_t n) {
    int64_t i = 0;
#if defined(__F16C__) && defined(__AVX2__)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(f + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(h + i))));
#endif
    for (; i < n; ++i) f[i] = half_to_float(h[i]);
}
/* A per-thread buffer for widened scales, apart from the panels' thread_scratch. */
static float *scale_scratch(size_t n) {
    static __thread float *buf;
    static __thread size_t cap;
    if (n > cap) {
        free(buf);
        buf = malloc(n * sizeof(float));
        cap = n;
    }
    return buf;
}

/* Activations: exact floats, or int8 / int16 codes per 32-value block (quantize_block). */
enum { ACT_FLOAT = 0, ACT_INT8 = 1, ACT_INT16 = 2 };
/* Or'ed into `bits`: the scales d are float16 [N, K/32] (a GGUF Q4_0 / Q8_0 scale is one, exactly):
   a 4-bit weight then takes 18 bytes per 32 weights, as in the file, instead of 20. */
#define HALF_SCALES 16
/* Or'ed into `bits` (N a multiple of 8): the rows are interleaved by 8, codes and scales / offsets
   alike (qmatmul.py's `relayout`; the layouts above il_block_sum and il8_block_sum). */
#define INTERLEAVED 32
/* Rows whose float16 scales are widened at a time into a float buffer the kernels read: 256 rows
   of a 2048-wide weight is 16 KB, so the widened copy never leaves the core's cache. */
#define SCALE_ROWS 256
/* Or'ed into `bits` (4-bit codes, K a multiple of 256): factored scales, as a GGUF Q4_K stores
   them (qmatmul.py's Blocks.from_codes finds them): wd holds uint8 codes [N, K / 256][sc 8, m 8]
   and wc float16 factors [N, K / 256][D, Dm]; interleaved, [N / 8, K / 256][16][8 rows] and
   [N / 8, K / 256][2][8 rows]. Block b's scale is D sc[b], its offset Dm m[b] (+ 8 D sc[b]
   centred): 18.5 bytes per 32 weights against float32's 24 (the file's: 18). */
#define KSCALES 64

/* Row n's block b of a KSCALES weight (codes sm, factors sup; il: interleaved): its scale and
   centred offset, as k_widen computes them. */
static inline void k_scale_at(const uint8_t *sm, const uint16_t *sup, int64_t nb, int il, int64_t n, int64_t b,
                              float *d, float *c) {
    const int64_t q = (il ? n >> 3 : n) * (nb / 8) + b / 8, w = il ? 8 : 1, i = il ? n & 7 : 0;
    const float D = half_to_float(sup[q * 2 * w + i]), Dm = half_to_float(sup[(q * 2 + 1) * w + i]);
    *d = D * (float)sm[(q * 16 + b % 8) * w + i];
    *c = Dm * (float)sm[(q * 16 + 8 + b % 8) * w + i] + 8.f * *d;  /* Dm m exact: contracted or not, one rounding */
}

/* KSCALES: rows [0, rows) of codes sm and factors sup as float32 scales d and centred offsets c
   [rows, K / 32] in the same layout (il: interleaved by 8, rows a multiple of 8): what every kernel
   but il_group_k reads, the float32 form's very bits (k_scale_at's arithmetic, 8 outputs at once). */
static void k_widen(const uint8_t *sm, const uint16_t *sup, int64_t rows, int64_t nb, int il, float *d, float *c) {
    const int64_t nsb = nb / 8;
    /* units of 8 outputs: row-major, a row's 8 blocks of one 256 (one D); interleaved, a group's
       8 rows of one block (8 D) */
    for (int64_t u = 0; u < rows * nsb; ++u) {
        const int64_t q = il ? u / 8 : u, bb = il ? u % 8 : 0;  /* (row or group, 256) and the block in it */
        float *dd = d + u * 8, *cc = c + u * 8;
#if defined(__AVX2__) && defined(__F16C__)
        const uint8_t *sc = sm + q * 16 * (il ? 8 : 1) + bb * 8, *m = sc + (il ? 64 : 8);
        const uint16_t *D = sup + q * 2 * (il ? 8 : 1), *Dm = D + (il ? 8 : 1);
        const __m256 Dv = il ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)D)) : _mm256_set1_ps(_cvtsh_ss(*D));
        const __m256 Dmv = il ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)Dm)) : _mm256_set1_ps(_cvtsh_ss(*Dm));
        const __m256 dv = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)sc))), Dv);
        const __m256 mv = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)m)));
        _mm256_storeu_ps(dd, dv);
        _mm256_storeu_ps(cc, _mm256_fmadd_ps(mv, Dmv, _mm256_mul_ps(dv, _mm256_set1_ps(8.f))));
#else
        for (int i = 0; i < 8; ++i)  /* output i: row 8 g + i of block bb (il), or block i of the row */
            k_scale_at(sm, sup, nb, il, il ? q / nsb * 8 + i : q / nsb, q % nsb * 8 + (il ? bb : i), dd + i, cc + i);
#endif
    }
}

static void qgemm_dispatch(int act, int bits, const uint8_t *wq, const float *wd, const float *wc, int64_t K,
                           const float *x, int64_t ldx, const void *xq, const float *xs, int64_t M, float *y,
                           int64_t ldy, int64_t n0, int64_t n1) {
    const int64_t nb = K / 32;
    if (act == ACT_INT8)
        qgemm_int8act(bits, wq, wd, wc, K, xq, xs + M * nb, xs, xs + 2 * M * nb, M, y, ldy, n0, n1);
    else if (act == ACT_INT16)
        qgemm_int16act(bits, wq, wd, wc, K, xq, xs + M * nb, xs, xs + 2 * M * nb, M, y, ldy, n0, n1);
    else
        qgemm_floatact(bits, wq, wd, wc, K, x, ldx, xs, M, y, ldy, n0, n1);
}

#if defined(__AVX2__)
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__F16C__)
#define HAS_IL8Z 1
/* il8_tile for two adjacent groups at once in 512-bit registers (group g in the low half, g + 1
   in the high one) and 8 tokens: each broadcast of 4 activation bytes and each float step then
   serves 16 rows. Every lane's operations are il8_tile's (exact integer sums, then the same
   float steps in the same order), so a row's output has the same bits either way. 1.1B shapes at
   256 tokens: ~1.2x il8_tile's speed (Zen 4, which splits a 512-bit operation in two). */
static inline __m512i il8z_pair(const void *a, const void *b) {  /* 32 bytes of each group */
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}
static inline __m512 il8z_halves(const uint16_t *a, const uint16_t *b) {  /* 8 float16 of each group */
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)a)),
                                                   _mm_loadu_si128((const __m128i *)b), 1));
}
static inline __m512 il8z_floats(const float *a, const float *b) {  /* 8 float32 of each group */
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_loadu_pd((const double *)a)),
                                               _mm256_loadu_pd((const double *)b), 1));
}
static inline __m512 il8z_codes(const uint8_t *a, const uint8_t *b) {  /* 8 byte codes of each group */
    const __m128i v = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)a), _mm_loadl_epi64((const __m128i *)b));
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v));
}
/* dpbusd_bcast (common.h) in 512 bits */
static inline __m512i il8z_dp(__m512i acc, __m512i w, const int32_t *x) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
    return acc;
}
#define IL8Z_TOKEN(t, acc) { \
        const int64_t i = b * 8 + t; \
        const int32_t *x4 = (const int32_t *)(xp + i * 32); \
        __m512i s0 = _mm512_setzero_si512(), s1 = s0; \
        for (int c = 0; c < 4; ++c) { \
            s0 = il8z_dp(s0, w[2 * c], x4 + c); \
            s1 = il8z_dp(s1, w[2 * c + 1], x4 + 4 + c); } \
        const __m512i s_ = _mm512_sub_epi32(_mm512_add_epi32(s0, s1), _mm512_set1_epi32(cp[i])); \
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s_), _mm512_mul_ps(d, _mm512_set1_ps(xd[i])), acc); \
        if (SCL == SC_K || cg) acc = _mm512_fmadd_ps(e, _mm512_set1_ps(xs[i]), acc); }
static inline __attribute__((always_inline)) void il8z_tile(
        const int SCL, const uint8_t *wg, const void *dg, const void *cg, int64_t nb,
        const int8_t *xp, const int32_t *cp, const float *xd, const float *xs, __m512 *out) {
    const uint8_t *wg2 = wg + nb * 128;
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    const __m512i m4 = _mm512_set1_epi8(15);
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *wb = wg + b * 128, *wb2 = wg2 + b * 128;
        _mm_prefetch((const char *)wb + PREFETCH_AHEAD, _MM_HINT_T0);
        _mm_prefetch((const char *)wb + PREFETCH_AHEAD + 64, _MM_HINT_T0);
        _mm_prefetch((const char *)wb2 + PREFETCH_AHEAD, _MM_HINT_T0);
        _mm_prefetch((const char *)wb2 + PREFETCH_AHEAD + 64, _MM_HINT_T0);
        __m512i w[8];
        for (int c = 0; c < 4; ++c) {
            const __m512i v = il8z_pair(wb + 32 * c, wb2 + 32 * c);
            w[2 * c] = _mm512_and_si512(v, m4);
            w[2 * c + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
        }
        __m512 d, e = _mm512_setzero_ps();
        if (SCL == SC_K) {
            const uint16_t *f = (const uint16_t *)cg + b / 8 * 16, *f2 = f + nb * 2;
            const uint8_t *sc = (const uint8_t *)dg + b / 8 * 128 + b % 8 * 8, *sc2 = sc + nb * 16;
            d = _mm512_mul_ps(il8z_halves(f, f2), il8z_codes(sc, sc2));
            e = _mm512_fmadd_ps(il8z_halves(f + 8, f2 + 8), il8z_codes(sc + 64, sc2 + 64),
                                _mm512_mul_ps(d, _mm512_set1_ps(8.f)));
        } else {
            if (SCL == SC_F16) d = il8z_halves((const uint16_t *)dg + b * 8, (const uint16_t *)dg + nb * 8 + b * 8);
            else d = il8z_floats((const float *)dg + b * 8, (const float *)dg + nb * 8 + b * 8);
            if (cg) e = il8z_floats((const float *)cg + b * 8, (const float *)cg + nb * 8 + b * 8);
        }
        IL8Z_TOKEN(0, a0) IL8Z_TOKEN(1, a1) IL8Z_TOKEN(2, a2) IL8Z_TOKEN(3, a3)
        IL8Z_TOKEN(4, a4) IL8Z_TOKEN(5, a5) IL8Z_TOKEN(6, a6) IL8Z_TOKEN(7, a7)
    }
    out[0] = a0; out[1] = a1; out[2] = a2; out[3] = a3; out[4] = a4; out[5] = a5; out[6] = a6; out[7] = a7;
}
#else
#define HAS_IL8Z 0
#endif
/* il8_tile for a run of T tokens (8, 4, 2 or 1), scales as stored. */
static void il8_run(int64_t T, int scl, const uint8_t *wg, const void *dg, const void *cg, int64_t nb,
                    const int8_t *xp, const int32_t *cp, const float *pd, const float *ps, __m256 *o) {
    if (T == 8) IL8_TILE(8);
    else if (T == 4) IL8_TILE(4);
    else if (T == 2) IL8_TILE(2);
    else IL8_TILE(1);
}
/* The outputs of group g's rows (lanes: 8, or 16 for groups g and g + 1) that fall in this
   share [n0, n1) into a token's output row yt (a share may start or end inside a group). */
static inline void il_store(const float *out, int lanes, int64_t g, int64_t n0, int64_t n1, float *yt) {
    for (int i = 0; i < lanes; ++i)
        if (g * 8 + i >= n0 && g * 8 + i < n1) yt[g * 8 + i] = out[i];
}
/* Group g's scales *dg and offsets *cg (NULL without offsets) as stored (scl). */
static inline void il_group_scales(const void *wd, const void *wc, int scl, int64_t g, int64_t nb, const void **dg,
                                   const void **cg) {
    *dg = scl == SC_K ? (const void *)((const uint8_t *)wd + g * nb * 16)
          : scl == SC_F16 ? (const void *)((const uint16_t *)wd + g * nb * 8)
          : (const void *)((const float *)wd + g * nb * 8);
    *cg = !wc ? 0 : scl == SC_K ? (const void *)((const uint16_t *)wc + g * nb * 2)
          : (const void *)((const float *)wc + g * nb * 8);
}
/* quantize_packed's cp, pd and ps beside its codes xp. */
static void packed_parts(const int8_t *xp, int64_t M, int64_t K, const int32_t **cp, const float **pd,
                         const float **ps) {
    const int64_t nb = K / 32;
    *cp = (const int32_t *)(xp + M * K);
    *pd = (const float *)(*cp + M * nb);
    *ps = *pd + M * nb;
}
/* Interleaved 4-bit rows [n0, n1) for M tokens of int8 codes packed by quantize_packed (il8_tile). */
static void il_int8(const uint8_t *wq, const void *wd, int scl, const void *wc, int64_t K, const int8_t *xp,
                    int64_t M, float *y, int64_t ldy, int64_t n0, int64_t n1) {
    const int64_t nb = K / 32;
    const int32_t *cpk;
    const float *pdk, *psk;
    packed_parts(xp, M, K, &cpk, &pdk, &psk);
    /* Factored scales (SC_K) are widened once per group (or pair) into float32 scales and centred
       offsets, k_widen's bits, which are the tiles' own arithmetic, and every run of tokens reads
       them (SC_F32) instead of computing them again: ~1.05x at 256 tokens on 1.1B shapes (Zen 4). */
    float *wide = scl == SC_K && M > 8 ? scale_scratch((size_t)(32 * nb)) : 0;
    for (int64_t g = n0 >> 3, step; g * 8 < n1; g += step) {
        const uint8_t *wg = wq + g * nb * 128;
        const void *dg, *cg;
        il_group_scales(wd, wc, scl, g, nb, &dg, &cg);
        /* two groups at a time in 512-bit registers where both are this share's, for runs of 8 */
        const int pair = HAS_IL8Z && (g + 1) * 8 < n1;
        step = pair ? 2 : 1;
        int gscl = scl;  /* the scales as this group's tiles read them */
        if (wide) {  /* [group][block][8 rows], d then c: group g + 1's at nb * 8 */
            k_widen((const uint8_t *)dg, (const uint16_t *)cg, 8 * step, nb, 1, wide, wide + 16 * nb);
            dg = wide;
            cg = wide + 16 * nb;
            gscl = SC_F32;
        }
        for (int64_t t0 = 0, T; t0 < M; t0 += T) {
            T = M - t0 >= 8 ? 8 : M - t0 >= 4 ? 4 : M - t0 >= 2 ? 2 : 1;
            const int8_t *xt = xp + t0 * K;  /* this run's packed codes */
            const int32_t *cp = cpk + t0 * nb;
            const float *pd = pdk + t0 * nb, *ps = psk + t0 * nb;
#if HAS_IL8Z
            if (pair) {
                __m512 oz[8];
                if (T == 8) {
                    if (gscl == SC_K) il8z_tile(SC_K, wg, dg, cg, nb, xt, cp, pd, ps, oz);
                    else if (gscl == SC_F16) il8z_tile(SC_F16, wg, dg, cg, nb, xt, cp, pd, ps, oz);
                    else il8z_tile(SC_F32, wg, dg, cg, nb, xt, cp, pd, ps, oz);
                } else {  /* the last few tokens: each group as below */
                    __m256 lo[8], hi[8];
                    const void *dg2, *cg2;
                    if (wide) {
                        dg2 = (const float *)dg + nb * 8;
                        cg2 = (const float *)cg + nb * 8;
                    } else il_group_scales(wd, wc, scl, g + 1, nb, &dg2, &cg2);
                    il8_run(T, gscl, wg, dg, cg, nb, xt, cp, pd, ps, lo);
                    il8_run(T, gscl, wg + nb * 128, dg2, cg2, nb, xt, cp, pd, ps, hi);
                    for (int t = 0; t < T; ++t)
                        oz[t] = _mm512_insertf32x8(_mm512_castps256_ps512(lo[t]), hi[t], 1);
                }
                for (int t = 0; t < T; ++t) {
                    float out[16];
                    _mm512_storeu_ps(out, oz[t]);
                    il_store(out, 16, g, n0, n1, y + (t0 + t) * ldy);
                }
                continue;
            }
#endif
            __m256 o[8];
            il8_run(T, gscl, wg, dg, cg, nb, xt, cp, pd, ps, o);
            for (int t = 0; t < T; ++t) {
                float out[8];
                _mm256_storeu_ps(out, o[t]);
                il_store(out, 8, g, n0, n1, y + (t0 + t) * ldy);
            }
        }
    }
}
#if HAS_VNNI
/* 8-bit interleaved rows (INTERLEAVED: chunk c of a block holds row i's codes 4 c .. 4 c + 3 in
   lane i) against int8 activations: vpdpbusd takes the activations as unsigned bytes (q + 128,
   packed so by quantize_packed) against the signed codes, and 128 x each row's block code sum,
   computed once per group for every token, is taken off the integer sum. Per token and block:
   8 dpbusd and one float step, no widening (the int16 activations' kernel widens every code to
   int16 and runs 16 vpdpwssd). Without VNNI maddubs would saturate on 255 x 127 pairs, so those
   CPUs keep 8-bit rows row-major in int8 mode (qmatmul.interleaved_for). */
#define IL8B_TOKEN(t, acc) if (T > t) { \
        const int64_t i = b * T + t; \
        const int32_t *x4 = (const int32_t *)(xp + i * 32); \
        __m256i s0 = _mm256_setzero_si256(), s1 = s0; \
        for (int c = 0; c < 4; ++c) { \
            s0 = dpbusd(s0, _mm256_set1_epi32(x4[c]), w[c]); \
            s1 = dpbusd(s1, _mm256_set1_epi32(x4[4 + c]), w[4 + c]); } \
        const __m256i s_ = _mm256_sub_epi32(_mm256_add_epi32(s0, s1), k128); \
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s_), _mm256_mul_ps(d, _mm256_set1_ps(xd[i])), acc); \
        if (cg) acc = _mm256_fmadd_ps(e, _mm256_set1_ps(xs[i]), acc); }
static inline __attribute__((always_inline)) void il8b_tile(
        const int T, const int SCL, const uint8_t *wg, const void *dg, const float *cg, const int32_t *corr,
        int64_t nb, const int8_t *xp, const float *xd, const float *xs, __m256 *out) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int64_t b = 0; b < nb; ++b) {
        const uint8_t *wb = wg + b * 256;
        for (int l = 0; l < 4; ++l) _mm_prefetch((const char *)wb + PREFETCH_AHEAD + 64 * l, _MM_HINT_T0);
        __m256i w[8];
        for (int c = 0; c < 8; ++c) w[c] = _mm256_loadu_si256((const __m256i *)(wb + 32 * c));
        const __m256 d = il_scales(dg, SCL, b), e = cg ? _mm256_loadu_ps(cg + b * 8) : _mm256_setzero_ps();
        const __m256i k128 = _mm256_loadu_si256((const __m256i *)(corr + b * 8));
        IL8B_TOKEN(0, a0) IL8B_TOKEN(1, a1) IL8B_TOKEN(2, a2) IL8B_TOKEN(3, a3)
        IL8B_TOKEN(4, a4) IL8B_TOKEN(5, a5) IL8B_TOKEN(6, a6) IL8B_TOKEN(7, a7)
    }
    out[0] = a0; out[1] = a1; out[2] = a2; out[3] = a3; out[4] = a4; out[5] = a5; out[6] = a6; out[7] = a7;
}
#define IL8B_RUN(T) do { \
        if (scl == SC_F16) il8b_tile(T, SC_F16, wg, dg, (const float *)cg, corr, nb, xt, pd, ps, o); \
        else il8b_tile(T, SC_F32, wg, dg, (const float *)cg, corr, nb, xt, pd, ps, o); } while (0)
/* Interleaved 8-bit rows [n0, n1) for M tokens of int8 codes packed by quantize_packed with flip (il8b_tile). */
static void il8b_int8(const uint8_t *wq, const void *wd, int scl, const void *wc, int64_t K, const int8_t *xp,
                      int64_t M, float *y, int64_t ldy, int64_t n0, int64_t n1) {
    const int64_t nb = K / 32;
    const int32_t *cpk;
    const float *pdk, *psk;
    packed_parts(xp, M, K, &cpk, &pdk, &psk);
    int32_t *corr = (int32_t *)thread_scratch((size_t)(8 * nb));
    const __m256i ones = _mm256_set1_epi8(1);
    for (int64_t g = n0 >> 3; g * 8 < n1; ++g) {
        const uint8_t *wg = wq + g * nb * 256;
        const void *dg, *cg;
        il_group_scales(wd, wc, scl, g, nb, &dg, &cg);
        for (int64_t b = 0; b < nb; ++b) {  /* 128 x each row's code sum, per block */
            __m256i sum = _mm256_setzero_si256();
            for (int c = 0; c < 8; ++c) sum = dpbusd(sum, ones, _mm256_loadu_si256((const __m256i *)(wg + b * 256 + 32 * c)));
            _mm256_storeu_si256((__m256i *)(corr + b * 8), _mm256_slli_epi32(sum, 7));
        }
        for (int64_t t0 = 0, T; t0 < M; t0 += T) {
            T = M - t0 >= 8 ? 8 : M - t0 >= 4 ? 4 : M - t0 >= 2 ? 2 : 1;
            const int8_t *xt = xp + t0 * K;
            const float *pd = pdk + t0 * nb, *ps = psk + t0 * nb;
            __m256 o[8];
            if (T == 8) IL8B_RUN(8);
            else if (T == 4) IL8B_RUN(4);
            else if (T == 2) IL8B_RUN(2);
            else IL8B_RUN(1);
            for (int t = 0; t < T; ++t) {
                float out[8];
                _mm256_storeu_ps(out, o[t]);
                il_store(out, 8, g, n0, n1, y + (t0 + t) * ldy);
            }
        }
    }
}
#endif
/* Interleaved rows [n0, n1) for M tokens of int16 activations, scales as stored (scl: SC_F32,
   SC_F16 or SC_K): group by group, up to IL_TOKENS tokens at a time (each block's codes unpacked
   once for them). */
static void il_int16(int bits, const uint8_t *wq, const void *wd, int scl, const void *wc, int64_t K,
                     const int16_t *xq, const float *xd, const float *xs, int64_t M, float *y, int64_t ldy, int64_t n0,
                     int64_t n1) {
    const int64_t nb = K / 32;
    uint8_t *lo = 0;
    int8_t *hi = 0;
    int32_t *cs = 0;
    if (bits == 4) {  /* 8-bit codes take the int16 activations whole */
        uint8_t *sp = split_scratch((size_t)(2 * M * K + 4 * M * nb));
        lo = sp;
        hi = (int8_t *)(sp + M * K);
        cs = (int32_t *)(sp + 2 * M * K);
        split_codes(xq, M, K, lo, hi, cs);
    }
    for (int64_t g = n0 >> 3; g * 8 < n1; ++g) {
        const uint8_t *wg = wq + g * nb * (bits == 8 ? 256 : 128);
        const void *dg, *cg;
        il_group_scales(wd, wc, scl, g, nb, &dg, &cg);
        for (int64_t t0 = 0; t0 < M; t0 += IL_TOKENS) {
            const int T = M - t0 < IL_TOKENS ? (int)(M - t0) : IL_TOKENS;
            const uint8_t *l = lo ? lo + t0 * K : 0;
            const int8_t *h = hi ? hi + t0 * K : 0;
            const int32_t *c = cs ? cs + t0 * nb : 0;
            const float *d = xd + t0 * nb, *s = xs + t0 * nb;
            __m256 o[IL_TOKENS];
            if (bits == 8) {
                const int16_t *x = xq + t0 * K;
                if (T > 1) il8_group_m(wg, dg, scl, cg, nb, K, x, d, s, T, o);
                else o[0] = scl == SC_F16 ? il8_group(wg, dg, SC_F16, cg, nb, x, d, s)
                                          : il8_group(wg, dg, SC_F32, cg, nb, x, d, s);
            } else if (T > 1) {  /* each block unpacked once for the T tokens */
                if (scl == SC_K) il_group_k_m(wg, dg, cg, nb, K, l, h, d, s, T, o);
                else if (scl == SC_F16) il_group_m(wg, dg, SC_F16, cg, nb, K, l, h, c, d, s, T, o);
                else il_group_m(wg, dg, SC_F32, cg, nb, K, l, h, c, d, s, T, o);
            } else if (scl == SC_K) {  /* per group: codes [2 nb][8] bytes, factors [nb / 4][8] float16 */
                o[0] = il_group_k(wg, dg, cg, nb, l, h, d, s);
            } else {
                o[0] = scl == SC_F16 ? il_group(wg, dg, SC_F16, cg, nb, l, h, c, d, s)
                                     : il_group(wg, dg, SC_F32, cg, nb, l, h, c, d, s);
            }
            for (int t = 0; t < T; ++t) {
                float out[8];
                _mm256_storeu_ps(out, o[t]);
                il_store(out, 8, g, n0, n1, y + (t0 + t) * ldy);
            }
        }
    }
}
#endif
/* Interleaved rows [r0, r1) of a chunk whose row 0 starts a group, float scales, for modes other
   than int16: the row-major kernels on row-major copies of 64 rows at a time (the panels of a
   prefill, where decoding the weight is shared by many tokens anyway). */
#define IL_COPY_ROWS 64
static void il_chunk(int act, int bits, const uint8_t *wq, const float *wd, const float *wc, int64_t K,
                     const float *x, int64_t ldx, const void *xq, const float *xs, int64_t M, float *y, int64_t ldy,
                     int64_t r0, int64_t r1) {
    const int64_t nb = K / 32, rb = bits == 4 ? K / 2 : K;
    uint8_t *codes = split_scratch((size_t)(IL_COPY_ROWS * rb + 2 * IL_COPY_ROWS * nb * sizeof(float)));
    float *d = (float *)(codes + IL_COPY_ROWS * rb), *c = d + IL_COPY_ROWS * nb;
    for (int64_t a = r0; a < r1; a += IL_COPY_ROWS) {
        const int64_t e = a + IL_COPY_ROWS < r1 ? a + IL_COPY_ROWS : r1;
        il_unpack(bits, wq, wd, wc, K, a, e, codes, d, wc ? c : 0);
        qgemm_dispatch(act, bits, codes, d, wc ? c : 0, K, x, ldx, xq, xs, M, y + a, ldy, 0, e - a);
    }
}
/* Interleaved weights: rows [n0, n1) by their groups (a share may start or end inside a group: the
   group is computed, only the share's rows are written). int16 activations read them as stored;
   other modes widen float16 scales SCALE_ROWS rows at a time for il_chunk's copies. */
#if defined(__F16C__)
#define HAS_F16C 1
#else
#define HAS_F16C 0
#endif

/* Whether a weight of kind `bits` takes int8 activations (act) packed by quantize_packed: its rows
   interleaved, run by il_int8 (4-bit) or il8b_int8 (8-bit, with VNNI). */
static inline int packed_int8(int act, int bits) {
    const int half = bits & HALF_SCALES, ks = bits & KSCALES, b = bits & ~(HALF_SCALES | INTERLEAVED | KSCALES);
    if (act != ACT_INT8 || !(bits & INTERLEAVED)) return 0;
#if defined(__AVX2__)
    if (b == 4) return !(half || ks) || HAS_F16C;
#if HAS_VNNI
    if (b == 8) return !half || HAS_F16C;
#endif
#endif
    (void)half; (void)ks; (void)b;
    return 0;
}
static void il_rows(int act, int bits, const uint8_t *wq, const void *wd, const void *wc, int64_t K,
                    const float *x, int64_t ldx, const void *xq, const float *xs, int64_t M, float *y, int64_t ldy,
                    int64_t n0, int64_t n1) {
    const int half = bits & HALF_SCALES, ks = bits & KSCALES, packed = packed_int8(act, bits);
    bits &= ~(HALF_SCALES | INTERLEAVED | KSCALES);
    const int64_t nb = K / 32, row_bytes = bits == 4 ? K / 2 : K;
    (void)packed;
#if defined(__AVX2__)
    if (packed && bits == 4) {
        il_int8(wq, wd, ks ? SC_K : half ? SC_F16 : SC_F32, wc, K, (const int8_t *)xq, M, y, ldy, n0, n1);
        return;
    }
#if HAS_VNNI
    if (packed) {
        il8b_int8(wq, wd, half ? SC_F16 : SC_F32, wc, K, (const int8_t *)xq, M, y, ldy, n0, n1);
        return;
    }
#endif
    if (act == ACT_INT16 && (!(half || ks) || HAS_F16C)) {
        il_int16(bits, wq, wd, ks ? SC_K : half ? SC_F16 : SC_F32, wc, K, (const int16_t *)xq, xs + M * nb, xs, M, y, ldy,
                 n0, n1);
        return;
    }
#endif
    float *buf = half || ks ? scale_scratch((size_t)(2 * SCALE_ROWS * nb)) : 0;
    for (int64_t a = n0 & ~(int64_t)7; a < n1; a += SCALE_ROWS) {
        const int64_t e = a + SCALE_ROWS < n1 ? a + SCALE_ROWS : n1, whole = (e + 7) & ~(int64_t)7;
        const float *d = (const float *)wd + a * nb, *c = wc ? (const float *)wc + a * nb : 0;
        if (ks) {
            k_widen((const uint8_t *)wd + a * nb * 2, (const uint16_t *)wc + a * nb / 4, whole - a, nb, 1, buf,
                    buf + SCALE_ROWS * nb);
            d = buf;
            c = buf + SCALE_ROWS * nb;
        } else if (half) {
            halves_to_floats((const uint16_t *)wd + a * nb, buf, (whole - a) * nb);
            d = buf;
        }
        il_chunk(act, bits, wq + a * row_bytes, d, c, K, x, ldx, xq, xs, M, y + a, ldy, n0 > a ? n0 - a : 0, e - a);
    }
}

/* Thread t's share [n0, n1) of N output rows: whole groups of 8 where N is a multiple of 8 (an
   interleaved weight's group is then one thread's), else an even split. */
static inline void row_share(int64_t N, int64_t t, int64_t nt, int64_t *n0, int64_t *n1) {
    const int64_t unit = N % 8 == 0 ? 8 : 1, u = N / unit;
    *n0 = u * t / nt * unit;
    *n1 = u * (t + 1) / nt * unit;
}

/* Outputs [n0, n1) of y = x @ W.T, x given as floats (x, ldx) and as prepared by prepare_act (xq,
   xs: sums, then scales and centring terms for int codes). One thread's share; no barrier. */
static void qgemm_rows(int act, int bits, const uint8_t *wq, const void *wd, const void *wc, int64_t K,
                       const float *x, int64_t ldx, const void *xq, const float *xs, int64_t M, float *y,
                       int64_t ldy, int64_t n0, int64_t n1) {
    if (bits & INTERLEAVED) {
        il_rows(act, bits, wq, wd, wc, K, x, ldx, xq, xs, M, y, ldy, n0, n1);
        return;
    }
    if (!(bits & (HALF_SCALES | KSCALES))) {
        qgemm_dispatch(act, bits, wq, wd, wc, K, x, ldx, xq, xs, M, y, ldy, n0, n1);
        return;
    }
    const int ks = bits & KSCALES;
    bits &= ~(HALF_SCALES | KSCALES);
    const int64_t nb = K / 32, row_bytes = bits == 4 ? K / 2 : K;
    float *buf = scale_scratch((size_t)(2 * SCALE_ROWS * nb)), *cbuf = buf + SCALE_ROWS * nb;
    for (int64_t a = n0; a < n1; a += SCALE_ROWS) {
        const int64_t e = a + SCALE_ROWS < n1 ? a + SCALE_ROWS : n1;
        if (ks)
            k_widen((const uint8_t *)wd + a * nb * 2, (const uint16_t *)wc + a * nb / 4, e - a, nb, 0, buf, cbuf);
        else
            halves_to_floats((const uint16_t *)wd + a * nb, buf, (e - a) * nb);
        qgemm_dispatch(act, bits, wq + a * row_bytes, buf, ks ? cbuf : wc ? (const float *)wc + a * nb : 0, K, x, ldx,
                       xq, xs, M, y + a, ldy, 0, e - a);
    }
}

/* The activations a batch of M tokens runs with on a weight of kind `bits`: row-major int16 only
   below PANEL_FROM, interleaved int16 at every size (see qlinear). */
static inline int act_for(int act, int bits, int64_t M) {
    return act == ACT_INT16 && M >= PANEL_FROM && !(bits & INTERLEAVED) ? ACT_FLOAT : act;
}

/* The bytes of int codes xq that prepare_act writes for M tokens of K values (or more). */
static inline size_t act_bytes(int act, int64_t M, int64_t K) {
    return act == ACT_FLOAT ? 0 : (size_t)(M * K) * (act == ACT_INT16 ? 2 : 1) + (act == ACT_INT8 ? 12 * (size_t)(M * K / 32) : 0);
}
/* Whether prepare_act quantizes x block by block: then prepare_block(i) for each i < M K / 32
   writes what it does (int codes in xq; scales, sums and centring terms in xs [3, M, K/32]), and a
   caller's threads can share the blocks (the decode stack). */
static inline int act_by_blocks(int act, int bits) { return act != ACT_FLOAT && !packed_int8(act, bits); }
static inline void prepare_block(int act, const float *x, int64_t ldx, int64_t M, int64_t K, void *xq, float *xs,
                                 int64_t i) {
    const int64_t nb = K / 32;
    quantize_block(x, ldx, K, xq, act == ACT_INT8 ? 127 : 32767, xs + M * nb, xs, xs + 2 * M * nb, i);
}
/* x's side of the product with a weight of kind `bits`: block sums xs [M, K/32] (floats), or int
   codes xq with sums, scales and centring terms in xs [3, M, K/32] (prepare_block), or, for the
   interleaved int8 kernels (packed_int8), xq as quantize_packed writes it (xq sized by act_bytes). */
static void prepare_act(int act, int bits, const float *x, int64_t ldx, int64_t M, int64_t K, void *xq, float *xs,
                        int nthreads) {
    if (packed_int8(act, bits))
        quantize_packed(x, ldx, M, K, (int8_t *)xq, (bits & ~(HALF_SCALES | INTERLEAVED | KSCALES)) == 8, nthreads);
    else if (act != ACT_FLOAT) {
        #pragma omp parallel for num_threads(nthreads) schedule(static) if (M * K >= 65536)
        for (int64_t i = 0; i < M * (K / 32); ++i) prepare_block(act, x, ldx, M, K, xq, xs, i);
    } else block_sums(x, ldx, M, K, xs);
}

/* y = x @ W.T for float32 x [M, K] (row stride ldx); bits may carry HALF_SCALES. ACT_INT8 /
   ACT_INT16 quantize x per 32-value block first (scratch from malloc). From PANEL_FROM tokens a
   row-major weight's int16 takes the float panels instead: there the weight decode is shared by
   many tokens, and exact floats cost nothing more. An interleaved weight stays in int16 at every
   size: its kernel unpacks a block once for 8 tokens (il_group_m), and the float panels would first
   copy its rows back to row-major; 1.1B shapes (Zen 4, 2 threads): 16 tokens 16.7 ms against 31.0,
   128 tokens 131 against 146 (AVX-512 VNNI build); 64 tokens 99 against 156 (AVX2 build). */
void qlinear(int bits, const uint8_t *wq, const void *wd, const void *wc, int64_t N, int64_t K,
             const float *x, int64_t ldx, int64_t M, float *y, int64_t ldy, int act, int nthreads) {
    const int64_t nb = K / 32;
    act = act_for(act, bits, M);
    float *xs = malloc(sizeof(float) * M * nb * 3);
    void *xq = act != ACT_FLOAT ? malloc(act_bytes(act, M, K)) : 0;
    prepare_act(act, bits, x, ldx, M, K, xq, xs, nthreads);
    #pragma omp parallel num_threads(nthreads)
    {
        int64_t n0, n1;
        row_share(N, omp_get_thread_num(), omp_get_num_threads(), &n0, &n1);
        qgemm_rows(act, bits, wq, wd, wc, K, x, ldx, xq, xs, M, y, ldy, n0, n1);
    }
    free(xq);
    free(xs);
}

/* Row n's block b: its scale d and offset c (KSCALES: from the factored codes; else the float or
   half scale at `at`, the offset too where there are offsets). */
static inline void block_scale(int half, int ks, int il, const void *wd, const void *wc, int64_t nb, int64_t n,
                               int64_t b, int64_t at, float *d, float *c) {
    if (ks) k_scale_at(wd, wc, nb, il, n, b, d, c);
    else {
        *d = half ? half_to_float(((const uint16_t *)wd)[at]) : ((const float *)wd)[at];
        *c = wc ? ((const float *)wc)[at] : 0.f;
    }
}
#if defined(__AVX2__)
/* One block's 32 codes wv as code * d + c (4-bit: the nibbles centred first, exact in float, as
   codes_of does) into dst + o: float32, or bfloat16 when bf16. */
static inline void store_block(const __m256 wv[4], int bits, float d, float c, void *dst, int64_t o, int bf16) {
    for (int q = 0; q < 4; ++q) {
        const __m256 code = bits == 4 ? _mm256_sub_ps(wv[q], _mm256_set1_ps(8.f)) : wv[q];
        const __m256 v = _mm256_fmadd_ps(code, _mm256_set1_ps(d), _mm256_set1_ps(c));
        if (bf16) _mm_storeu_si128((__m128i *)((uint16_t *)dst + o + 8 * q), bf16x8(v));
        else _mm256_storeu_ps((float *)dst + o + 8 * q, v);
    }
}
#endif
/* Row n of W [N, K] (bits may carry HALF_SCALES, KSCALES, INTERLEAVED) into dst [K]: float32, or
   bfloat16 when bf16, float32's value rounded once. */
static void dequantize_row(int bits, const uint8_t *wq, const void *wd, const void *wc, int64_t K, int64_t n,
                           void *dst, int bf16) {
    const int half = bits & HALF_SCALES, il = bits & INTERLEAVED, ks = bits & KSCALES;
    bits &= ~(HALF_SCALES | INTERLEAVED | KSCALES);
    const int64_t nb = K / 32, row_bytes = bits == 4 ? K / 2 : K;
    const uint8_t *wr = wq + n * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
        /* where row n's block b is: its bytes, or (interleaved) its chunks' lanes: 4-bit 4, 8-bit 8 */
        const int64_t at = il ? ((n >> 3) * nb + b) * 8 + (n & 7) : n * nb + b, bb = bits == 4 ? 16 : 32;
        uint8_t blk[32];  /* (4-bit: 16 bytes) */
        if (il)
            for (int ch = 0; ch < bb / 4; ++ch)
                memcpy(blk + 4 * ch, wq + ((n >> 3) * nb + b) * 8 * bb + 32 * ch + 4 * (n & 7), 4);
        float d, c;
        block_scale(half, ks, il, wd, wc, nb, n, b, at, &d, &c);
        const int64_t o = b * 32;
#if defined(__AVX2__)
        __m256 wv[4];
        block_floats(il ? blk : wr, il ? 0 : b, bits, wv);
        store_block(wv, bits, d, c, dst, o, bf16);
        continue;
#endif
        int8_t code[32];
        if (il) codes_of(blk, 0, bits, code);
        else codes_of(wr, b, bits, code);
        float v[32];
        for (int j = 0; j < 32; ++j) v[j] = (float)code[j] * d + c;
        if (bf16)
            for (int j = 0; j < 32; ++j) ((uint16_t *)dst)[o + j] = float_to_bf16(v[j]);
        else
            memcpy((float *)dst + o, v, sizeof v);
    }
}

/* Whether W's rows are interleaved 4-bit codes (scales in any form): dequantize_group_il4's weights. */
static inline int il4_bits(int bits) {
    return (bits & INTERLEAVED) && (bits & ~(HALF_SCALES | INTERLEAVED | KSCALES)) == 4;
}
#if defined(__AVX2__)
/* Rows [8 g, 8 g + 8) of an interleaved 4-bit W (bits may carry HALF_SCALES, KSCALES) into dst,
   the values dequantize_row gives: each block's 4 chunks loaded once and transposed in registers
   into the 8 rows' 16 bytes (il_rows_of_unit, as il_unpack does), where dequantize_row gathers a
   row's words one by one through memory (4 narrow stores, then a wide load that cannot forward them). */
static void dequantize_group_il4(int bits, const uint8_t *wq, const void *wd, const void *wc, int64_t K, int64_t g,
                                 void *dst, int bf16) {
    const int half = bits & HALF_SCALES, ks = bits & KSCALES;
    const int64_t nb = K / 32;
    for (int64_t b = 0; b < nb; ++b) {
        __m256i u[4];  /* rows j (low half) and j + 4 (high half) */
        il_rows_of_unit(wq + (g * nb + b) * 8 * 16, u);
        for (int i = 0; i < 8; ++i) {
            const int64_t n = 8 * g + i, at = (g * nb + b) * 8 + i;
            float d, c;
            block_scale(half, ks, 1, wd, wc, nb, n, b, at, &d, &c);
            __m256 wv[4];
            nibble_floats(i < 4 ? _mm256_castsi256_si128(u[i]) : _mm256_extracti128_si256(u[i - 4], 1), wv);
            store_block(wv, 4, d, c, dst, n * K + b * 32, bf16);
        }
    }
}
#endif

/* W [N, K] as float32, or bfloat16 when bf16 (bits may carry HALF_SCALES, KSCALES, INTERLEAVED).
   bfloat16 is float32's value rounded once: the same bits as converting the float32 result,
   without writing and reading it (a prefill's dense bfloat16 matmul dequantizes its weight on
   every call). */
void dequantize(int bits, const uint8_t *wq, const void *wd, const void *wc, int64_t N, int64_t K, void *w,
                int bf16, int nthreads) {
#if defined(__AVX2__)
    if (il4_bits(bits) && N % 8 == 0) {
        #pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int64_t g = 0; g < N / 8; ++g) dequantize_group_il4(bits, wq, wd, wc, K, g, w, bf16);
        return;
    }
#endif
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t n = 0; n < N; ++n)
        dequantize_row(bits, wq, wd, wc, K, n, bf16 ? (void *)((uint16_t *)w + n * K) : (void *)((float *)w + n * K),
                       bf16);
}

#if defined(__AVX512F__) && defined(__linux__)
/* AMX (Sapphire Rapids and later): a dense bfloat16 matmul on the tile unit whose weight is never
   written out whole. A thread takes a panel of W's rows at a time (as many as fit AMX_PANEL_BYTES,
   up to 512), dequantizes it to bfloat16 as `dequantize` would, and runs every token against it;
   torch's path wrote the whole weight (46 MB for a 1.1B model's gate/up) and oneDNN read it back on
   every call. Tiles (common.h: 16 rows x 64 bytes): A = 16 of the panel's rows x 32 values (the
   panel stored tile by tile: each A tile 1 KB in a row), B = 16 tokens' bfloat16 pairs (xv
   [Mp / 16][K / 2][16] pairs: B's row p holds the tokens' values k0 + 2p and k0 + 2p + 1, as
   TDPBF16PS reads them), C = float32 sums [16 rows][16 tokens], written to y transposed; 2 x 2
   tiles of C per step (32 rows x 32 tokens), each over the whole K. Linux grants a process the
   tile state on request (amx_enable). */
#include <sys/syscall.h>
#include <unistd.h>
#define XFEATURE_XTILEDATA 18
#define AMX_PANEL_BYTES (768 << 10)  /* a thread's dequantized rows at a time: in L2 */

/* Ask Linux for the tile state (once per process; torch's oneDNN may have asked already): 1 when
   this process may use the tiles. */
int amx_enable(void) {
    unsigned long mask = 0;
    if (syscall(SYS_arch_prctl, 0x1022 /* ARCH_GET_XCOMP_PERM */, &mask) == 0 && (mask >> XFEATURE_XTILEDATA & 1))
        return 1;
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, XFEATURE_XTILEDATA) == 0;
}

/* Where a panel of amx_linear holds its row r's block b (16 rows x 32 values per A tile, 1 KB in a row). */
static inline int64_t amx_panel_at(int64_t r, int64_t b, int64_t K) { return r / 16 * 16 * K + r % 16 * 32 + b * 512; }

/* dequantize_group_il4's bfloat16 for group g into amx_linear's panel (rows from n0), 32 values at a
   time in 512-bit registers (AVX512-BF16, which every AMX CPU has): the same bits (code - 8 exact,
   one FMA, rounded to nearest even). */
AMX_TARGET static void amx_dequant_group(int bits, const uint8_t *wq, const void *wd, const void *wc, int64_t K,
                                         int64_t g, int64_t n0, uint16_t *panel) {
    const int half = bits & HALF_SCALES, ks = bits & KSCALES;
    const int64_t nb = K / 32;
    const __m512i low = _mm512_set1_epi32(0xF), eight = _mm512_set1_epi32(8);
    for (int64_t b = 0; b < nb; ++b) {
        __m256i u[4];  /* rows j (low half) and j + 4 (high half) */
        il_rows_of_unit(wq + (g * nb + b) * 8 * 16, u);
        for (int i = 0; i < 8; ++i) {
            const int64_t n = 8 * g + i, r = n - n0;
            float d, c;
            block_scale(half, ks, 1, wd, wc, nb, n, b, (g * nb + b) * 8 + i, &d, &c);
            const __m512i v = _mm512_cvtepu8_epi32(i < 4 ? _mm256_castsi256_si128(u[i])
                                                         : _mm256_extracti128_si256(u[i - 4], 1));
            const __m512 dv = _mm512_set1_ps(d), cv = _mm512_set1_ps(c);
            const __m512i lo = _mm512_sub_epi32(_mm512_and_si512(v, low), eight);
            const __m512i hi = _mm512_sub_epi32(_mm512_srli_epi32(v, 4), eight);
            const __m512 w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(lo), dv, cv);
            const __m512 w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(hi), dv, cv);
            _mm512_store_si512(panel + amx_panel_at(r, b, K), (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
        }
    }
}

/* y [M, N] (row stride ldy) = x [M, K] W^T (bits as `dequantize` takes them; N a multiple of 32),
   on the AMX tiles in bfloat16 with float32 sums; interleaved 4-bit rows dequantize fastest. xv:
   scratch of K Mp bfloat16, Mp = M rounded up to 32. */
AMX_TARGET void amx_linear(int bits, const uint8_t *wq, const void *wd, const void *wc, int64_t N, int64_t K,
                           const float *x, int64_t M, float *y, int64_t ldy, uint16_t *xv, int nthreads) {
    const int64_t Mp = (M + 31) / 32 * 32;
    const int il4 = il4_bits(bits);
    int64_t np = 512;  /* rows per panel: as many as fit AMX_PANEL_BYTES, 2 panels per thread at least */
    while (np > 32 && (np * K * 2 > AMX_PANEL_BYTES || np * 2 * nthreads > N)) np /= 2;
    #pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t mb = 0; mb < Mp / 16; ++mb)  /* xv [Mp / 16][K / 2][16] pairs: each B tile 1 KB in a row */
        for (int64_t p0 = 0; p0 < K / 2; p0 += 16) {  /* 16 tokens' 16 pairs, transposed as C tiles are */
            float t[16][16] __attribute__((aligned(64)));
            for (int i = 0; i < 16; ++i) {
                const int64_t m = 16 * mb + i;
                const __m512i pairs = m < M ? (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + m * K + 2 * p0 + 16),
                                                                         _mm512_loadu_ps(x + m * K + 2 * p0))
                                            : _mm512_setzero_si512();
                _mm512_store_si512(t[i], pairs);
            }
            transpose16(t[0], 16, (float *)xv + (mb * (K / 2) + p0) * 16, 16, 16);
        }
    #pragma omp parallel num_threads(nthreads)
    {
        amx_tiles_16x64();
        uint16_t *panel = (uint16_t *)split_scratch(np * K * sizeof(uint16_t)), *row = (uint16_t *)thread_scratch(K);
        float c[4][256] __attribute__((aligned(64)));
        #pragma omp for schedule(static)
        for (int64_t pn = 0; pn < (N + np - 1) / np; ++pn) {
            const int64_t n0 = pn * np, rows = N - n0 < np ? N - n0 : np;
            if (il4)
                for (int64_t g = 0; g < rows / 8; ++g) amx_dequant_group(bits, wq, wd, wc, K, n0 / 8 + g, n0, panel);
            else  /* other layouts row by row, as dequantize does, then into the tiles' places */
                for (int64_t r = 0; r < rows; ++r) {
                    dequantize_row(bits, wq, wd, wc, K, n0 + r, row, 1);
                    for (int64_t b = 0; b < K / 32; ++b)
                        memcpy(panel + amx_panel_at(r, b, K), row + 32 * b, 64);
                }
            for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
                const uint16_t *x0 = xv + m0 / 16 * (K / 2) * 32, *x1 = x0 + (K / 2) * 32;
                for (int64_t r0 = 0; r0 < rows; r0 += 32) {  /* the tokens' slab (L2) for each 32 rows */
                    const uint16_t *a = panel + r0 * K;  /* 2 x 16 rows, each [K / 32][16][32] */
                    _tile_zero(4); _tile_zero(5); _tile_zero(6); _tile_zero(7);
                    for (int64_t k0 = 0; k0 < K; k0 += 32) {
                        _tile_loadd(0, a + k0 * 16, 64);
                        _tile_loadd(1, a + 16 * K + k0 * 16, 64);
                        _tile_loadd(2, x0 + k0 * 16, 64);
                        _tile_loadd(3, x1 + k0 * 16, 64);
                        _tile_dpbf16ps(4, 0, 2); _tile_dpbf16ps(5, 0, 3);
                        _tile_dpbf16ps(6, 1, 2); _tile_dpbf16ps(7, 1, 3);
                    }
                    _tile_stored(4, c[0], 64); _tile_stored(5, c[1], 64);
                    _tile_stored(6, c[2], 64); _tile_stored(7, c[3], 64);
                    for (int q = 0; q < 4; ++q) {  /* tile q: rows 16 (q / 2), tokens 16 (q % 2) */
                        const int64_t t0 = m0 + 16 * (q % 2);
                        if (t0 < M) transpose16(c[q], 16, y + t0 * ldy + n0 + r0 + 16 * (q / 2), ldy, M - t0);
                    }
                }
            }
        }
        amx_tiles_release();
    }
}
#endif

/* Rows ids [count] of W [N, K] as float32 into out [count, K], the values dequantize gives: an
   embedding lookup. A few rows (a decode step's) on the calling thread: no threads to wake.
   Returns the first position whose id is outside [0, N), else -1 (nothing written past it). */
int64_t take_rows(int bits, const uint8_t *wq, const void *wd, const void *wc, int64_t N, int64_t K,
                  const int64_t *ids, int64_t count, float *out, int nthreads) {
    for (int64_t i = 0; i < count; ++i)
        if (ids[i] < 0 || ids[i] >= N) return i;
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (count >= TAKE_ROWS_THREADED)
    for (int64_t i = 0; i < count; ++i) dequantize_row(bits, wq, wd, wc, K, ids[i], out + i * K, 0);
    return -1;
}
