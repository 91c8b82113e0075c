/* A decode step's decoder layers in one C call (decode_stack.py; kvserve/worker/decode_stack.py
   builds the structs from a model). The ops are the layer-by-layer path's own, included here as
   one compilation unit, so both paths compute the same sums in the same order. */
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include "qmatmul.c"
#include "ops.c"
#include "paged_attention.c"
#include "kquant.c"
#include "layout.h"

/* else kind = a blocks weight's bits (4 or 8) with qmatmul.c's flags or'ed in (below 128, so never
   LIN_KQUANT: 4 | INTERLEAVED | KSCALES is 100); LIN_KQUANT: raw GGUF K-quant rows (kquant.c) whose
   parts may differ in type (a fused q/k/v of Q4_K and Q6_K), so the types live in its KqMatrix (w) */
enum { LIN_DENSE = 0, LIN_KQUANT = 256 };
typedef struct Lin {
    int64_t kind, act, n, k;  /* act: qmatmul's ACT_FLOAT / ACT_INT8 / ACT_INT16 */
    const void *w;          /* dense: float [n, k]; blocks: codes */
    const void *d;          /* blocks: scales [n, k / 32] (float32, float16) or scale codes (qmatmul.c's KSCALES) */
    const void *c;          /* blocks: offsets [n, k / 32] or NULL, or the codes' factors (KSCALES) */
    const float *bias;      /* [n] or NULL */
    const struct Lin *rest; /* the output rows after these n, another kind's (a stacked linear), or NULL */
} Lin;
typedef struct {
    const float *in_norm, *post_norm, *q_norm, *k_norm;  /* q_norm / k_norm NULL unless the model has them */
    Lin qkv, o, gate_up, down;
    void *k_cache, *v_cache;  /* [num_blocks, block_size, hkv, d] */
    float k_scale, v_scale;   /* what the cache's codes are multiplied by (1 unless fp8) */
} Layer;
typedef struct {
    int64_t hidden, hq, hkv, d, inter, block_size, kv_kind, max_k;
    float eps, scale;
} Dims;

/* The structs' layout, so the ctypes mirrors (decode_stack.py) are checked against them (layout.h). */
KV_LAYOUT_TABLE(ds_layout,
    KV_LAYOUT_STRUCT(Lin), KV_LAYOUT_FIELD(Lin, kind), KV_LAYOUT_FIELD(Lin, act), KV_LAYOUT_FIELD(Lin, n),
    KV_LAYOUT_FIELD(Lin, k), KV_LAYOUT_FIELD(Lin, w), KV_LAYOUT_FIELD(Lin, d), KV_LAYOUT_FIELD(Lin, c),
    KV_LAYOUT_FIELD(Lin, bias), KV_LAYOUT_FIELD(Lin, rest),
    KV_LAYOUT_STRUCT(Layer), KV_LAYOUT_FIELD(Layer, in_norm), KV_LAYOUT_FIELD(Layer, post_norm),
    KV_LAYOUT_FIELD(Layer, q_norm), KV_LAYOUT_FIELD(Layer, k_norm), KV_LAYOUT_FIELD(Layer, qkv),
    KV_LAYOUT_FIELD(Layer, o), KV_LAYOUT_FIELD(Layer, gate_up), KV_LAYOUT_FIELD(Layer, down),
    KV_LAYOUT_FIELD(Layer, k_cache), KV_LAYOUT_FIELD(Layer, v_cache), KV_LAYOUT_FIELD(Layer, k_scale),
    KV_LAYOUT_FIELD(Layer, v_scale),
    KV_LAYOUT_STRUCT(Dims), KV_LAYOUT_FIELD(Dims, hidden), KV_LAYOUT_FIELD(Dims, hq), KV_LAYOUT_FIELD(Dims, hkv),
    KV_LAYOUT_FIELD(Dims, d), KV_LAYOUT_FIELD(Dims, inter), KV_LAYOUT_FIELD(Dims, block_size),
    KV_LAYOUT_FIELD(Dims, kv_kind), KV_LAYOUT_FIELD(Dims, max_k), KV_LAYOUT_FIELD(Dims, eps),
    KV_LAYOUT_FIELD(Dims, scale))

/* Rows [n0, n1) of y = x @ W.T + bias (act: the activations x was prepared in). */
static void lin_rows(const Lin *L, int act, const float *x, int64_t m, float *y, int64_t ldy, const float *xs,
                     const void *xq, int64_t n0, int64_t n1) {
    const int64_t nb = L->k / 32;
    if (L->kind == LIN_DENSE) {
        const float *w = (const float *)L->w;
        for (int64_t n = n0; n < n1; ++n)
            for (int64_t t = 0; t < m; ++t) {
                const float *wr = w + n * L->k, *xr = x + t * L->k;
                float s = 0.f;
                #pragma omp simd reduction(+:s)
                for (int64_t i = 0; i < L->k; ++i) s += wr[i] * xr[i];
                y[t * ldy + n] = s;
            }
    } else if (L->kind == LIN_KQUANT) {
        kq_rows((const KqMatrix *)L->w, (const int16_t *)xq, xs, xs + m * nb, m, y, ldy, n0, n1);
    } else {
        qgemm_rows(act, (int)L->kind, L->w, L->d, L->c, L->k, x, L->k, xq, xs, m, y, ldy, n0, n1);
    }
    if (L->bias)
        for (int64_t t = 0; t < m; ++t)
            for (int64_t n = n0; n < n1; ++n) y[t * ldy + n] += L->bias[n];
}

/* How many pieces per thread a linear's rows are cut into: the threads take them as they come
   free, so on a shared CPU a thread that lost time to another process (or a core that runs
   slower) leaves pieces to the others instead of holding every thread at the barrier after it.
   The pieces are whole groups of 8 rows (an interleaved weight's group is one piece's); each
   costs one kernel call (int16 activations split into bytes again: ~K operations). */
#ifndef LIN_PIECES_PER_THREAD
#define LIN_PIECES_PER_THREAD 4
#endif
/* SiLU-mul's columns per piece of work (a multiple of every vector width, so each value is computed
   as in the whole row, ops.c's silu_mul). */
#define SILU_SPAN 512

/* y [m, L->n] (row stride ldy) = x [m, L->k] @ W.T + bias, by every thread of the region; x's
   int8 or int16 codes go into xq / xs first, block by block and the blocks shared by the threads
   (other preparations by thread 0). Ends at a barrier; then the
   rows of L->rest, if any, the same way (each part prepares x as its kernel takes it). The rows
   are computed independently, so which thread takes a piece changes no output. */
static void lin_run(const Lin *L, const float *x, int64_t m, float *y, int64_t ldy, float *xs, void *xq) {
    const int act = act_for(L->act, (int)L->kind, m);  /* the rule qlinear applies, so both paths sum alike */
    const int64_t nb = L->k / 32;
    if (L->kind == LIN_KQUANT) {  /* int16 codes; scales xd [m nb] and half sums xh [2 m nb] in xs */
        #pragma omp for schedule(static)  /* the blocks shared by the threads; implicit barrier */
        for (int64_t i = 0; i < m * nb; ++i) kq_quantize_block(x, L->k, L->k, (int16_t *)xq, xs, xs + m * nb, i);
    } else if (L->kind != LIN_DENSE && act_by_blocks(act, (int)L->kind)) {
        #pragma omp for schedule(static)
        for (int64_t i = 0; i < m * nb; ++i) prepare_block(act, x, L->k, m, L->k, xq, xs, i);
    } else if (L->kind != LIN_DENSE) {
        #pragma omp single
        prepare_act(act, (int)L->kind, x, L->k, m, L->k, xq, xs, 1);  /* implicit barrier */
    }
    const int64_t unit = L->n % 8 == 0 ? 8 : 1, units = L->n / unit;
    int64_t pieces = (int64_t)omp_get_num_threads() * LIN_PIECES_PER_THREAD;
    if (pieces > units) pieces = units;
    #pragma omp for schedule(dynamic, 1)  /* its implicit barrier ends the linear */
    for (int64_t p = 0; p < pieces; ++p)
        lin_rows(L, act, x, m, y, ldy, xs, xq, units * p / pieces * unit, units * (p + 1) / pieces * unit);
    if (L->rest) lin_run(L->rest, x, m, y + L->n, ldy, xs, xq);
}

/* Layers [0, nlayers) and the final norm (weight final_norm) for B decode tokens. h [B, hidden]: in,
   the embeddings; out, the final norm of the last layer's output plus its residual, which res
   [B, hidden] holds. cos / sin: [max_pos, d / 2] tables, pos [B];
   slots [B]; tables [B, ts] block ids; lens [B] sequence lengths including this token. */
void decode_stack(const Layer *layers, int64_t nlayers, const Dims *dm, int64_t B, float *h, float *res,
                  const float *cos_, const float *sin_, const int64_t *pos, const int64_t *slots,
                  const int64_t *tables, int64_t ts, const int64_t *lens, int64_t max_len, const float *final_norm,
                  int nthreads) {
    const int64_t H = dm->hidden, d = dm->d, qs = dm->hq * d, kvs = dm->hkv * d, wq = qs + 2 * kvs, I = dm->inter;
    const int64_t width = dm->hkv * d, g = dm->hq / dm->hkv, spans = (I + SILU_SPAN - 1) / SILU_SPAN;
    float *x = malloc(sizeof(float) * B * H), *qkv = malloc(sizeof(float) * B * wq);
    float *attn = malloc(sizeof(float) * B * qs), *gu = malloc(sizeof(float) * B * 2 * I);
    float *act = malloc(sizeof(float) * B * I), *xs = malloc(sizeof(float) * B * (dm->max_k / 32) * 3);
    void *xq = malloc((size_t)(B * dm->max_k) * sizeof(int16_t));  /* int8 or int16 codes */
    const float fp8 = dm->kv_kind == ROW_FP8 ? 256.f : 1.f;  /* attend_heads' fp8 convention */
    #pragma omp parallel num_threads(nthreads)
    {
        const float **rows = malloc(sizeof(float *) * ROWS_CHUNK);
        float *buf = malloc(sizeof(float) * (attend_buf_floats((int)dm->kv_kind, d) + 1));
        float *scores = malloc(sizeof(float) * g * max_len);
        for (int64_t l = 0; l < nlayers; ++l) {
            const Layer *L = layers + l;
            #pragma omp for schedule(static)
            for (int64_t t = 0; t < B; ++t)
                norm_row(h + t * H, l ? res + t * H : 0, res + t * H, L->in_norm, x + t * H, H, dm->eps);
            if (l == 0) {
                #pragma omp for schedule(static)
                for (int64_t t = 0; t < B; ++t) memcpy(res + t * H, h + t * H, sizeof(float) * H);
            }
            lin_run(&L->qkv, x, B, qkv, wq, xs, xq);
            #pragma omp for schedule(static)
            for (int64_t t = 0; t < B; ++t) {
                float *q = qkv + t * wq, *k = q + qs, *v = k + kvs;
                if (L->q_norm) {
                    for (int64_t j = 0; j < dm->hq; ++j) norm_row(q + j * d, 0, 0, L->q_norm, q + j * d, d, dm->eps);
                    for (int64_t j = 0; j < dm->hkv; ++j) norm_row(k + j * d, 0, 0, L->k_norm, k + j * d, d, dm->eps);
                }
                const float *c = cos_ + pos[t] * (d / 2), *s = sin_ + pos[t] * (d / 2);
                rotary_row(q, dm->hq, d, c, s);
                rotary_row(k, dm->hkv, d, c, s);
                if (dm->kv_kind == ROW_FP8) {
                    write_fp8(k, 0, 0, slots + t, 1, width, 1.f / L->k_scale, L->k_cache);
                    write_fp8(v, 0, 0, slots + t, 1, width, 1.f / L->v_scale, L->v_cache);
                } else if (dm->kv_kind == ROW_BF16) {  /* rounded as torch's .to(torch.bfloat16) */
                    uint16_t *kc = (uint16_t *)L->k_cache + slots[t] * width, *vc = (uint16_t *)L->v_cache + slots[t] * width;
                    for (int64_t e = 0; e < width; ++e) { kc[e] = f32_to_bf16(k[e]); vc[e] = f32_to_bf16(v[e]); }
                } else {
                    memcpy((float *)L->k_cache + slots[t] * width, k, sizeof(float) * width);
                    memcpy((float *)L->v_cache + slots[t] * width, v, sizeof(float) * width);
                }
            }
            #pragma omp for schedule(dynamic, 1)
            for (int64_t i = 0; i < B * dm->hkv; ++i) {
                const int64_t t = i / dm->hkv, kh = i % dm->hkv;
                attend_heads(qkv + t * wq, L->k_cache, L->v_cache, tables + t * ts, lens[t], dm->hq, dm->hkv, d,
                             dm->block_size, (int)dm->kv_kind, dm->scale * L->k_scale * fp8, L->v_scale * fp8,
                             kh, kh + 1, attn + t * qs, rows, buf, scores);
            }
            lin_run(&L->o, attn, B, h, H, xs, xq);
            #pragma omp for schedule(static)
            for (int64_t t = 0; t < B; ++t)
                norm_row(h + t * H, res + t * H, res + t * H, L->post_norm, x + t * H, H, dm->eps);
            lin_run(&L->gate_up, x, B, gu, 2 * I, xs, xq);
            #pragma omp for schedule(static)  /* in spans of SILU_SPAN columns: one token's row is shared too */
            for (int64_t i = 0; i < B * spans; ++i) {
                const int64_t t = i / spans, j = i % spans * SILU_SPAN, n = I - j < SILU_SPAN ? I - j : SILU_SPAN;
                silu_mul_span(gu + t * 2 * I + j, gu + t * 2 * I + I + j, act + t * I + j, n);
            }
            lin_run(&L->down, act, B, h, H, xs, xq);
        }
        #pragma omp for schedule(static)  /* the model's final norm, into h */
        for (int64_t t = 0; t < B; ++t)
            norm_row(h + t * H, res + t * H, res + t * H, final_norm, h + t * H, H, dm->eps);
        free(rows); free(buf); free(scores);
    }
    free(x); free(qkv); free(attn); free(gu); free(act); free(xs); free(xq);
}
