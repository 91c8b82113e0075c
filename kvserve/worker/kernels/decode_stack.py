"""A decode step's decoder layers in one C call (Llama-family models, float32, one rank, a CPU).

A decode step of a small model on a CPU is mostly dispatch: per layer ~40 torch and ctypes calls,
each microseconds of Python for a few thousand multiply-adds. llama.cpp runs the whole step in C.
This does the same for the layers: one call runs every layer of the batch's decode tokens in one
OpenMP parallel region, the threads meeting at a barrier between ops:

  x = norm(h + res)            res = h + res (layer 0: res = h)
  qkv = x @ Wqkv.T (+ bias)    q/k per-head norm (Qwen3), rotary on q and k
  K, V written to the paged cache at each token's slot (float32, or fp8 codes with the layer's scale)
  attn = paged decode attention (one task per request and kv head)
  x = norm(attn @ Wo.T + res)  res = attn @ Wo.T + res
  h = silu_mul(x @ Wgu.T) @ Wdown.T

The ops are the ones the layers' Python path calls (qmatmul's blocks kernels, ops' rows, the cpu
attention backend's kernel), compiled into one library, so both paths compute the same sums in
the same order: outputs are bit-identical (tested). The embedding before and the final norm and
LM head after stay in Python.

It runs a step when every token is a decode and the batch is small enough that each quantized
linear would use its kernel rather than the dense path (`dense_from`, tuning.py); larger batches
and prefills take the Python path, where matmuls dominate. `build` returns None (the Python path
always) for what it does not model: other dtypes, tensor or pipeline parallelism, MoE layers,
linears other than dense float32 or blocks (qmatmul.Blocks) without an input permutation,
non-CPU devices, or no C compiler. `KVSERVE_DECODE_STACK=0` turns it off.
"""

from __future__ import annotations

import ctypes
import logging
import os
from typing import Any

import torch

from kvserve.attention import cpu_kernel
from kvserve.worker.kernels import build, kquant, ops, qmatmul

logger = logging.getLogger(__name__)

DENSE_MAX_ROWS = 8  # float32 weights: from here torch's GEMM beats this file's row-at-a-time dot products
LIN_KQUANT = 100  # _DRIVER's Lin kind for raw GGUF K-quant rows (kquant.c)

_DRIVER = r"""
/* else kind = bits (4 or 8) of a blocks weight; LIN_KQUANT: raw GGUF K-quant rows (kquant.c) whose
   parts may differ in type (a fused q/k/v of Q4_K and Q6_K), so the types live in its KqMatrix (w) */
enum { LIN_DENSE = 0, LIN_KQUANT = 100 };
typedef struct {
    int64_t kind, act, n, k;  /* act: qmatmul's ACT_FLOAT / ACT_INT8 / ACT_INT16 */
    const void *w;          /* dense: float [n, k]; blocks: codes */
    const void *d;          /* blocks: scales [n, k / 32], float32 or float16 (kind | HALF_SCALES) */
    const float *c;         /* blocks: offsets [n, k / 32], or NULL */
    const float *bias;      /* [n] or NULL */
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

/* One thread's share [n0, n1) of the n outputs. */
static inline void share(int64_t n, int64_t *n0, int64_t *n1) {
    const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
    *n0 = n * t / nt;
    *n1 = n * (t + 1) / nt;
}

/* y [m, L->n] (row stride ldy) = x [m, L->k] @ W.T + bias, by every thread of the region; x's
   block sums / int8 or int16 codes go into xs / xq first (thread 0). Ends at a barrier. */
static void lin_run(const Lin *L, const float *x, int64_t m, float *y, int64_t ldy, float *xs, void *xq) {
    const int act = act_for(L->act, m);  /* the rule qlinear applies, so both paths sum alike */
    const int64_t nb = L->k / 32;
    if (L->kind == LIN_KQUANT) {  /* int16 codes; scales xd [m nb] and half sums xh [2 m nb] in xs */
        #pragma omp single
        kq_quantize(x, L->k, m, L->k, (int16_t *)xq, xs, xs + m * nb, 1);  /* implicit barrier */
    } else if (L->kind != LIN_DENSE) {
        #pragma omp single
        prepare_act(act, x, L->k, m, L->k, xq, xs, 1);  /* implicit barrier */
    }
    int64_t n0, n1;
    share(L->n, &n0, &n1);
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
    #pragma omp barrier
}

/* Layers [0, nlayers) for B decode tokens. h [B, hidden]: in, the embeddings; out, the last layer's
   MLP output, with res [B, hidden] its residual. cos / sin: [max_pos, d / 2] tables, pos [B];
   slots [B]; tables [B, ts] block ids; lens [B] sequence lengths including this token. */
void decode_stack(const Layer *layers, int64_t nlayers, const Dims *dm, int64_t B, float *h, float *res,
                  const float *cos_, const float *sin_, const int64_t *pos, const int64_t *slots,
                  const int64_t *tables, int64_t ts, const int64_t *lens, int64_t max_len, int nthreads) {
    const int64_t H = dm->hidden, d = dm->d, qs = dm->hq * d, kvs = dm->hkv * d, wq = qs + 2 * kvs, I = dm->inter;
    const int64_t width = dm->hkv * d, g = dm->hq / dm->hkv;
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
            #pragma omp for schedule(static)
            for (int64_t t = 0; t < B; ++t) silu_mul_row(gu + t * 2 * I, act + t * I, I);
            lin_run(&L->down, act, B, h, H, xs, xq);
        }
        free(rows); free(buf); free(scores);
    }
    free(x); free(qkv); free(attn); free(gu); free(act); free(xs); free(xq);
}
"""


class _Lin(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int64), ("act", ctypes.c_int64), ("n", ctypes.c_int64), ("k", ctypes.c_int64),
                ("w", ctypes.c_void_p), ("d", ctypes.c_void_p), ("c", ctypes.c_void_p), ("bias", ctypes.c_void_p)]


class _Layer(ctypes.Structure):
    _fields_ = [("in_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("qkv", _Lin), ("o", _Lin), ("gate_up", _Lin), ("down", _Lin),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p), ("k_scale", ctypes.c_float),
                ("v_scale", ctypes.c_float)]


class _Dims(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in ("hidden", "hq", "hkv", "d", "inter", "block_size", "kv_kind", "max_k")] \
        + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]


_vp, _i64, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {"decode_stack": [_vp, _i64, _vp, _i64, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _i64, _vp, _i64, _int]}


def load() -> ctypes.CDLL | None:
    """The compiled library, or None (callers keep the Python path)."""
    source = "#include <omp.h>\n" + qmatmul.SOURCE + ops.SOURCE + cpu_kernel.SOURCE + kquant.source() + _DRIVER
    return build.load_library("decode_stack", source, _SIGNATURES)


class Unsupported(Exception):
    """What the stack does not model (the message says what)."""


def _lin(module: Any) -> tuple[_Lin, int, list[Any]]:
    """A ParallelLinear as the C struct, the most rows its kernel runs at, and the tensors (and C
    structs) it points into (kept alive by the stack)."""
    from kvserve.quant.kquant_linear import KQuantLinear
    from kvserve.quant.linear import _GroupCodes

    if module.tp.size != 1:
        raise Unsupported("tensor parallelism")
    kernel = module.kernel
    bias = kernel.bias if kernel is not None and kernel.bias is not None else module.bias
    if bias is not None and bias.dtype != torch.float32:
        raise Unsupported(f"a {bias.dtype} bias")
    keep = [] if bias is None else [bias]
    bias_ptr = None if bias is None else bias.data_ptr()
    if kernel is None:
        w = module.weight
        if w.dtype != torch.float32 or not w.is_contiguous() or w.device.type != "cpu":
            raise Unsupported(f"a {w.dtype} dense weight")
        return _Lin(0, 0, w.shape[0], w.shape[1], w.data_ptr(), None, None, bias_ptr), DENSE_MAX_ROWS, keep + [w]
    if isinstance(kernel, KQuantLinear) and kernel.path == "kquant":
        m = kquant.make_matrix(kernel.part_rows(), kernel.in_features)  # the stack's own copy, into `raw`
        lin = _Lin(LIN_KQUANT, 0, kernel.out_features, kernel.in_features, ctypes.addressof(m), None, None, bias_ptr)
        return lin, kernel.dense_from, keep + [kernel.raw, m]
    if not isinstance(kernel, _GroupCodes) or kernel.path != "blocks" or kernel.perm is not None:
        raise Unsupported(f"a {type(kernel).__name__} linear ({getattr(kernel, 'path', '?')} path)")
    b = kernel.blocks()
    n, k = b.shape
    lin = _Lin(b.kind, qmatmul.MODES.index(kernel.activations), n, k, b.codes.data_ptr(), b.d.data_ptr(),
               None if b.c is None else b.c.data_ptr(), bias_ptr)
    return lin, kernel.dense_from, keep + [t for t in (b.codes, b.d, b.c) if t is not None]


class DecodeStack:
    """The C decode path of one LlamaModel (see the module docstring); `build` makes one."""

    def __init__(self, lib: ctypes.CDLL, layers: list[_Layer], dims: _Dims, max_rows: int,
                 keep: list[torch.Tensor], attns: list[Any]) -> None:
        self.lib, self.dims, self.max_rows = lib, dims, max_rows
        self.layers = (_Layer * len(layers))(*layers)
        self._keep, self._attns = keep, attns
        self._caches: list | None = None  # the kv_caches list the layers point into

    @classmethod
    def build(cls, model: Any, dtype: torch.dtype, attention_backend: str) -> DecodeStack | None:
        """The stack for `model` (a LlamaModel), or None when it cannot run it (logged once)."""
        if os.environ.get("KVSERVE_DECODE_STACK", "1") == "0":
            return None
        try:
            return cls._build(model, dtype, attention_backend)
        except Unsupported as e:
            logger.info("decode stack off: %s; decode steps run layer by layer", e)
            return None

    @classmethod
    def _build(cls, model: Any, dtype: torch.dtype, attention_backend: str) -> DecodeStack:
        from kvserve.models.llama import LlamaMLP

        if dtype != torch.float32:
            raise Unsupported(f"dtype {dtype} (it runs float32 models)")
        if attention_backend not in ("cpu", "torch"):
            raise Unsupported(f"the {attention_backend} attention backend")
        if model.start != 0 or not model.pp.is_last or model.embed_tokens is None:
            raise Unsupported("pipeline parallelism")
        rot = model.rotary_emb
        if rot.cos_cache.dtype != torch.float32 or rot.cos_cache.device.type != "cpu":
            raise Unsupported("rotary tables not float32 on the CPU")
        lib = load()
        if lib is None:
            raise Unsupported("no C compiler")
        layers, keep, attns, max_rows = [], [rot.cos_cache, rot.sin_cache], [], 1 << 30
        first = model.layers[0]
        a0 = first.self_attn
        eps = first.input_layernorm.eps
        for layer in model.layers:
            a, mlp = layer.self_attn, layer.mlp
            if type(mlp) is not LlamaMLP:
                raise Unsupported(f"{type(mlp).__name__} feed-forward layers")
            lins = []
            for mod in (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj):
                lin, rows, tensors = _lin(mod)
                lins.append(lin)
                keep += tensors
                max_rows = min(max_rows, rows)
            norms = [layer.input_layernorm, layer.post_attention_layernorm] + (
                [a.q_norm, a.k_norm] if a.q_norm is not None else [])
            if any(n.eps != eps or n.weight.dtype != torch.float32 for n in norms):
                raise Unsupported("norms of different eps or dtype")
            keep += [n.weight for n in norms]
            ptrs = [n.weight.data_ptr() for n in norms] + [None] * (4 - len(norms))
            layers.append(_Layer(*ptrs, *lins))  # caches and their scales: _point_at
            attns.append(a.attn)
        mlp0 = first.mlp
        dims = _Dims(hidden=first.input_layernorm.weight.shape[0], hq=a0.num_heads, hkv=a0.num_kv_heads,
                     d=a0.head_dim, inter=mlp0.down_proj.in_features, block_size=0, kv_kind=0,
                     max_k=max(lin.k for layer in layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)),
                     eps=eps, scale=a0.attn.scale)
        if dims.hq % dims.hkv or dims.d % 2:
            raise Unsupported("heads that do not group evenly")
        return cls(lib, layers, dims, max_rows, keep, attns)

    def runs(self, num_tokens: int, meta: Any, kv_caches: list) -> bool:
        """Whether this step's layers run here: every token a decode, a small batch, caches it handles."""
        return (meta.num_decodes == num_tokens < self.max_rows and meta.query_positions is None
                and (kv_caches is self._caches or self._point_at(kv_caches)))

    def _point_at(self, kv_caches: list) -> bool:
        """Point the layers at these caches; False if the stack cannot read or write them."""
        k0 = kv_caches[0][0]
        kind = cpu_kernel._ROW_KIND.get(k0.dtype)
        if kind not in (0, 2) or k0.device.type != "cpu" or any(a.kv_amax is not None for a in self._attns):
            return False
        if k0.dim() != 4 or k0.shape[2] != self.dims.hkv or k0.shape[3] != self.dims.d:
            return False
        if len(kv_caches) != len(self.layers) or not all(
                k.is_contiguous() and v.is_contiguous() and k.dtype == v.dtype == k0.dtype and k.shape == k0.shape
                for k, v in kv_caches):
            return False
        for layer, (k, v), a in zip(self.layers, kv_caches, self._attns):
            layer.k_cache, layer.v_cache = k.data_ptr(), v.data_ptr()
            layer.k_scale, layer.v_scale = a.k_scale, a.v_scale
        self.dims.block_size, self.dims.kv_kind = k0.shape[1], kind
        self._caches = kv_caches
        return True

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, meta: Any, rotary: Any
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run every layer on the embeddings h [B, hidden] (written in place); (hidden, residual)."""
        b = h.shape[0]
        h = h.contiguous()
        res = torch.empty_like(h)
        tables = meta.block_tables[:b].to(torch.int64).contiguous()
        lens = meta.seq_lens_tensor[:b].to(torch.int64).contiguous()
        pos = positions.to(torch.int64).contiguous()
        slots = meta.slot_mapping.to(torch.int64).contiguous()
        self.lib.decode_stack(ctypes.addressof(self.layers), len(self.layers), ctypes.addressof(self.dims), b,
                              h.data_ptr(), res.data_ptr(), rotary.cos_cache.data_ptr(),
                              rotary.sin_cache.data_ptr(), pos.data_ptr(), slots.data_ptr(), tables.data_ptr(),
                              tables.shape[1], lens.data_ptr(), max(meta.seq_lens[:b]), torch.get_num_threads())
        return h, res
