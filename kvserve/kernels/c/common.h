/* Helpers every kernel source includes (the decode stack compiles several sources as one unit,
   hence the include guard): e^x that `omp simd` loops vectorize (libm's expf is one call per
   element, most of the time of a softmax or SiLU), an AVX2 horizontal sum, vpdpbusd where the
   ISA level has it (dpbusd, HAS_VNNI), two int16 dot products summed (VNNI where it exists),
   float32 -> bfloat16 as torch rounds it (the dense prefill paths' weights, dequantized straight
   into bfloat16), and an 8 x 8 transpose of 32-bit lanes. */
#ifndef KVSERVE_COMMON_H
#define KVSERVE_COMMON_H
#include <math.h>
#include <stdint.h>
#include <string.h>
/* From how many rows an embedding lookup (take_rows, kq_take_rows) is split between threads: a
   decode step's few rows are cheaper on the calling thread than waking the others. */
#define TAKE_ROWS_THREADED 64
#if defined(__AVX2__)
#include <immintrin.h>
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
/* VNNI (AVX512-VNNI with VL, or AVX-VNNI): acc + in each int32 lane the sum of its 4 u8 x s8
   products, in one instruction, exactly. */
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define HAS_VNNI 1
static inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#elif defined(__AVXVNNI__)
#define HAS_VNNI 1
static inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_avx_epi32(acc, u, s); }
#else
#define HAS_VNNI 0
#endif
#if HAS_VNNI
/* dpbusd(acc, u, the 4 bytes at s4 broadcast as the signed operand). With AVX512-VL the broadcast
   is folded into vpdpbusd ({1to8}): GCC 12 emits a separate vpbroadcastd for the intrinsics, one
   more instruction per dpbusd (without them, Zen 4, 1.1B shapes: int8 codes at 256 tokens 1.04-1.08x,
   int16 codes at 5 tokens 1.10x). */
static inline __m256i dpbusd_bcast(__m256i acc, __m256i u, const void *s4) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    __asm__("vpdpbusd %2%{1to8%}, %1, %0" : "+v"(acc) : "v"(u), "m"(*(const int32_t *)s4));
    return acc;
#else
    int32_t v;
    memcpy(&v, s4, 4);
    return dpbusd(acc, u, _mm256_set1_epi32(v));
#endif
}
#endif
/* a0 . x0 + a1 . x1 in 8 int32 lanes (each the sum of 4 int16 products): vpdpwssd adds the second
   pair's products straight into the first's sums where VNNI exists (AVX512-VNNI with VL, or
   AVX-VNNI), a madd and an add elsewhere. The same integers either way. */
static inline __m256i madd2_epi16(__m256i a0, __m256i x0, __m256i a1, __m256i x1) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpwssd_epi32(_mm256_madd_epi16(a0, x0), a1, x1);
#elif defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(_mm256_madd_epi16(a0, x0), a1, x1);
#else
    return _mm256_add_epi32(_mm256_madd_epi16(a0, x0), _mm256_madd_epi16(a1, x1));
#endif
}
/* r[i] (8 rows of 8 floats) -> r[j] = column j. */
static inline void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 4; ++i) {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i)
        for (int h = 0; h < 2; ++h) {
            u[4 * i + 2 * h] = _mm256_shuffle_ps(t[4 * i + h], t[4 * i + h + 2], 0x44);
            u[4 * i + 2 * h + 1] = _mm256_shuffle_ps(t[4 * i + h], t[4 * i + h + 2], 0xEE);
        }
    for (int j = 0; j < 4; ++j) {
        r[j] = _mm256_permute2f128_ps(u[j], u[j + 4], 0x20);
        r[j + 4] = _mm256_permute2f128_ps(u[j], u[j + 4], 0x31);
    }
}
/* float_to_bf16 of 8 floats at once. */
static inline __m128i bf16x8(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)), 16);
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}
#endif
/* float32 -> bfloat16 bits, rounded to nearest even as torch's conversion rounds (NaN: 0x7FC0). */
static inline uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#if defined(__AVX512F__) && defined(__linux__)
/* AMX (Sapphire Rapids and later Xeons): the tile instructions, enabled per function (the AVX-512
   levels' builds; used only where qmatmul.amx_ready). */
#define AMX_TARGET __attribute__((target("amx-tile,amx-bf16,avx512bf16,avx512f,avx512bw,avx512vl")))
/* This thread's 8 tiles, each 16 rows x 64 bytes (bfloat16 16 x 32, or float32 16 x 16). */
AMX_TARGET static inline void amx_tiles_16x64(void) {
    /* in memory the compiler cannot drop: GCC 12 treats a local's stores before ldtilecfg as dead */
    static const struct { uint8_t palette, start_row, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } cfg = {
        .palette = 1, .colsb = {64, 64, 64, 64, 64, 64, 64, 64}, .rows = {16, 16, 16, 16, 16, 16, 16, 16}};
    _tile_loadconfig(&cfg);
}
AMX_TARGET static inline void amx_tiles_release(void) { _tile_release(); }
/* A 16 x 16 block of 32-bit words (floats, or pairs of bfloat16) at in (row stride ldi) transposed
   into out's rows (stride ldo), the first `rows` of them: 4x4 blocks by 32- and 64-bit unpacks,
   then 128-bit lanes across registers. */
static inline void transpose16(const float *in, int64_t ldi, float *out, int64_t ldo, int64_t rows) {
    __m512 r[16], t[16];
    for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(in + i * ldi);
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4)  /* r[i + j], lane l: column 4 l + j of rows i .. i + 3 */
        for (int j = 0; j < 2; ++j) {
            const __m512d a = _mm512_castps_pd(t[i + j]), b = _mm512_castps_pd(t[i + j + 2]);
            r[i + 2 * j] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
            r[i + 2 * j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        }
    for (int j = 0; j < 4; ++j) {  /* columns 4 l + j from the four row quarters' registers */
        const __m512 a = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x44);
        const __m512 b = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x44);
        const __m512 a2 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xEE);
        const __m512 b2 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xEE);
        const __m512 col[4] = {_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD),
                               _mm512_shuffle_f32x4(a2, b2, 0x88), _mm512_shuffle_f32x4(a2, b2, 0xDD)};
        for (int l = 0; l < 4; ++l)
            if (4 * l + j < rows) _mm512_storeu_ps(out + (4 * l + j) * ldo, col[l]);
    }
}
#endif

/* e^x, branch-free: n = round(x log2 e), r = x - n ln 2 in two parts (Cody-Waite), e^r by Cephes'
   degree-7 expf polynomial, times 2^n put into the exponent bits. Relative error ~2e-7 (a few
   float ulps); x is clamped to 88, so e^x never overflows, and below -87 it is exactly 0 (-inf too:
   a masked score's weight), so a result is 0 or normal (e^-87 ~ 1.6e-38): a denormal float costs
   an Intel core a microcode assist in each instruction that makes or reads it (~150 cycles), and
   a masked score's 1.6e-38 times a value made one in every such product. */
static inline float vexpf(float x) {
    const int below = x < -87.f;
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
    return below ? 0.f : e;
}
/* Token m of M in the runs a prefill's int8 kernels take tokens in (runs of 8 while 8 are left,
   then 4, 2 and 1 of the rest): the run's first token *s and length *T. */
static inline void token_run(int64_t m, int64_t M, int64_t *s, int64_t *T) {
    const int64_t whole = M & ~(int64_t)7;
    *s = m & ~(int64_t)7;
    *T = 8;
    if (m >= whole)
        for (*s = whole, *T = 4; *T; *T >>= 1)
            if ((M - whole) & *T) {
                if (m < *s + *T) return;
                *s += *T;
            }
}

/* One 32-value block of activations as int8 codes: scale *d = amax / 127, codes round(x 127 / amax)
   (halves away from zero) into dst, as unsigned bytes q + 128 with flip; *sum the block's exact float
   sum. Returns the sum of the codes. */
static inline int32_t block_codes8(const float *src, int8_t *dst, int flip, float *d, float *sum) {
#if defined(__AVX2__)
    const __m256 sign = _mm256_set1_ps(-0.f);
    __m256 v[4], mx = _mm256_setzero_ps(), sm = _mm256_setzero_ps();
    for (int c = 0; c < 4; ++c) {
        v[c] = _mm256_loadu_ps(src + 8 * c);
        mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[c]));
        sm = _mm256_add_ps(sm, v[c]);
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
    *sum = hsum8(sm);
    *d = amax / 127.f;
    const __m256 id = _mm256_set1_ps(*d > 0.f ? 127.f / amax : 0.f), half = _mm256_set1_ps(.5f);
    __m256i q[4], qs = _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) {
        const __m256 t = _mm256_mul_ps(v[c], id);
        q[c] = _mm256_cvttps_epi32(_mm256_add_ps(t, _mm256_or_ps(half, _mm256_and_ps(t, sign))));
        qs = _mm256_add_epi32(qs, q[c]);
    }
    /* packs work per 128-bit lane: 4-code pieces come out as q0 q1 q2 q3 (low halves), then the high halves */
    __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    if (flip) b = _mm256_xor_si256(b, _mm256_set1_epi8((char)0x80));
    _mm256_storeu_si256((__m256i *)dst, b);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(qs), _mm256_extracti128_si256(qs, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
    return _mm_cvtsi128_si32(s4);
#else
    float amax = 0.f, s = 0.f;
    for (int j = 0; j < 32; ++j) { const float a = fabsf(src[j]); amax = a > amax ? a : amax; s += src[j]; }
    *sum = s;
    *d = amax / 127.f;
    const float id = *d > 0.f ? 127.f / amax : 0.f;
    int32_t isum = 0;
    for (int j = 0; j < 32; ++j) {
        const float t = src[j] * id;
        const int q = (int)(t + (t >= 0.f ? .5f : -.5f));
        isum += q;
        dst[j] = (int8_t)(flip ? (uint8_t)(q + 128) : q);
    }
    return isum;
#endif
}
/* x [M, K] (row stride ldx) as int8 codes per 32-value block (block_codes8) in the layout the
   prefill int8 tiles read: tokens in runs of 8, then of 4, 2 and 1 (token_run), each run block by
   block: codes at xp + (t0 nb + b T + t) 32 for token t of the run from t0, block b, and at the same
   index t0 nb + b T + t the scale xd, the exact float sum xs and, where cp is given, 8 x the code
   sum (the centring of 4-bit codes); with flip, the codes as unsigned bytes q + 128. Written once
   per product by the threads together. */
static inline void quantize_runs(const float *x, int64_t ldx, int64_t M, int64_t K, int8_t *xp, int flip, int32_t *cp,
                                 float *xd, float *xs, int nthreads) {
    const int64_t nb = K / 32;
    #pragma omp parallel for num_threads(nthreads) schedule(static) if (M * K >= 65536)
    for (int64_t i = 0; i < M * nb; ++i) {
        const int64_t m = i / nb, b = i % nb;
        int64_t s, T;
        token_run(m, M, &s, &T);
        const int64_t o = s * nb + b * T + (m - s);
        const int32_t sum = block_codes8(x + m * ldx + b * 32, xp + o * 32, flip, xd + o, xs + o);
        if (cp) cp[o] = 8 * sum;
    }
}
#endif /* KVSERVE_COMMON_H */
