"""Matmuls that read 4- and 8-bit weights in place: y = x @ W.T with W in blocks of 32 weights.

Layout (`Blocks`), one per weight [N, K], K a multiple of 32:
  codes  4-bit: uint8 [N, K/2]; in each 32-weight block byte j holds weight j (low nibble) and
         weight j+16 (high nibble), GGUF's Q4_0/Q4_1 order.  8-bit: int8 [N, K], signed codes.
  d, c   float32 [N, K/32]: weight = code * d + c with signed codes: a nibble minus 8 (-8..7),
         or the int8 (-128..127); c is None (NULL in C) where every offset is 0, as in the
         symmetric Q4_0 / Q8_0: a sixth fewer bytes per 4-bit weight. Centred codes halve the error of int8 activations against
         unsigned ones (each rounding error of x is weighted by the code).
Every GGUF Q4_0/Q4_1/Q8_0/Q4_K block and our int4/int8 group layouts (group sizes that are
multiples of 32, per-channel included) map onto it exactly.
Factored scales (KSCALES, found by `from_codes` where they hold exactly, as in a GGUF Q4_K: 6-bit
codes times a float16 per 256 weights): d is then uint8 [N, K/256, 2, 8] (8 scale codes, 8 offset
codes) and c float16 [N, K/256, 2] (their factors D, Dm): scale = D sc, offset = Dm m (+ 8 D sc
centred), exact products, so the kernels compute the float32 form's bits. 18.5 bytes per 32 4-bit
weights instead of 24 (the file's Q4_K: 18).

Three ways to multiply, all in C with one AVX2 body (VNNI dot products where the ISA level has
them, AVX-512VL+VNNI or AVX-VNNI) and a plain C body elsewhere:
  float activations ("float32"): codes become floats in registers (by in-lane byte shuffles;
    4-bit nibbles uncentred, their 8 d taken off with the offsets); exact up to summation order.
    Below PANEL_FROM tokens each weight row is decoded once per 4 tokens and dotted with them;
    from PANEL_FROM tokens on, 16 rows at a time are decoded into a transposed float panel that
    an outer-product register tile (6 tokens x 16 rows) sweeps, as a dense GEMM does: within a
    few percent of MKL on the dequantized weight, without writing the whole weight out.
  int16 activations ("int16"; a row-major weight's from PANEL_FROM tokens on take the float
    panels, an interleaved one's stay in int16 at every size, below): each token's
    32-value block becomes int16 codes and a scale (amax / 32767), and the weight's codes are
    widened to int16 in registers by one in-lane shuffle (no float conversion per weight): pairs
    of products summed by vpmaddwd (vpdpwssd with VNNI), one float FMA per block. ~1.6x the
    float path's speed at one token on Zen 3, with a relative error of ~2e-5 (int8's is ~5e-3).
  int8 activations ("int8"): each token's 32-value block becomes int8 codes and a scale, as
    llama.cpp's Q8 dot products do; the weight offset uses the block's exact float sum.
    Fewer instructions per weight; what it costs in perplexity is in BENCHMARKS.md. On interleaved
    4-bit rows (below) each block is unpacked once for 8 tokens and, on AVX-512 VNNI, two groups
    share a 512-bit register: ~1.9x the int16 kernel and ~1.9x a bfloat16 dense matmul at 256
    tokens (Zen 4), which is why tuning may give prefill-sized batches to it (tuning.PREFILL_INT8)
    while decode runs int16; as a decode mode it is a candidate where the kernels lack VNNI, or
    with tuning.INT8_ENV (tuning.int8_allowed).
`dequantize` writes W as float32 for the dense path (when tuning finds MKL faster).

Interleaved (`relayout`, for weights that run with int16 activations, or 4-bit ones with int8, and
8-bit ones with int8 where the CPU has VNNI; `interleaved_for`): rows in groups of 8, each
16 bytes of a row (a 4-bit block, half an 8-bit one) 4 chunks of 32 in its group: chunk c's byte
4 i + j is row i's byte 4 c + j, and the scales / offsets [N / 8, K / 32, 8] likewise (the tensors
keep their shapes). One broadcast of 4 activations then serves 8 rows, a lane per row: 4-bit codes
are multiplied with the int16 activations' two bytes by maddubs, 8-bit codes widened to int16 by
maddwd; 1.2-1.5x (4-bit) and ~1.3x (8-bit) the row-major int16 kernel's GB/s at one token from DRAM
(c/qmatmul.c, above il_block_sum and il8_block_sum). Several tokens (a verify step's rows, a decode
batch, a prefill chunk) take each group 8 at a time, its blocks unpacked once for the 8: at 16
tokens half the time of the float panels on row-major copies, and still faster at 128 (Zen 4;
BENCHMARKS.md), so interleaved weights stay in int16 at every batch size, and each token's output
is the same bits whatever shares its batch. Other modes read row-major copies made on the fly.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.kernels import build, cpu

logger = logging.getLogger(__name__)

HALF_SCALES = 16  # or'ed into Blocks.kind: float16 scales (c/qmatmul.c's HALF_SCALES)
INTERLEAVED = 32  # or'ed into Blocks.kind: rows interleaved by 8 (the module docstring)
KSCALES = 64  # or'ed into Blocks.kind: factored scales and offsets (the module docstring)
VNNI_LEVELS = ("avx512_vnni", "avx_vnni")  # cpu.isa_level()s whose kernels have vpdpbusd
MODES = ("float32", "int8", "int16")  # activations: exact floats, or int8 / int16 codes per 32-value block
_i64, _vp, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {  # the entry points; the rest of the source is static
    "dequantize": [_int, _vp, _vp, _vp, _i64, _i64, _vp, _int, _int],
    "take_rows": [_int, _vp, _vp, _vp, _i64, _i64, _vp, _i64, _vp, _int],
    "qlinear": [_int, _vp, _vp, _vp, _i64, _i64, _vp, _i64, _i64, _vp, _i64, _int, _int],
}
_lib: ctypes.CDLL | None = None


def load() -> ctypes.CDLL | None:
    """The compiled library (build.load_library), or None: callers then use torch ops."""
    global _lib
    _lib = build.load_library("qmatmul", "qmatmul.c", _SIGNATURES)
    if _lib is not None:
        _lib.take_rows.restype = ctypes.c_int64  # -1, or the first position of an id out of range
        if hasattr(_lib, "amx_linear"):  # built at the AVX-512 levels (c/qmatmul.c)
            _lib.amx_enable.restype, _lib.amx_enable.argtypes = ctypes.c_int, []
            _lib.amx_linear.restype = None
            _lib.amx_linear.argtypes = [_int, _vp, _vp, _vp, _i64, _i64, _vp, _i64, _vp, _i64, _vp, _int]
    return _lib


AMX_ENV = "KVSERVE_AMX"  # "0": no AMX tiles, for dense matmuls or prefill attention (amx_ready False)
_amx: bool | None = None


def amx_ready() -> bool:
    """Whether amx_linear runs here: the CPU has AMX-BF16, the kernels were built at an AVX-512
    level, Linux granted the tile state, and AMX_ENV is not "0"."""
    global _amx
    if _amx is None:
        lib = _lib or load()
        _amx = bool(lib is not None and hasattr(lib, "amx_linear") and os.environ.get(AMX_ENV) != "0"
                    and {"amx_bf16", "amx_tile"} <= cpu.cpu_flags() and lib.amx_enable())
    return _amx


def amx_fits(w: Blocks) -> bool:
    """Whether amx_linear takes W: 32 rows at a time (any layout; interleaved 4-bit rows dequantize
    fastest)."""
    return w.shape[0] % 32 == 0


def amx_linear(x: torch.Tensor, w: Blocks) -> torch.Tensor:
    """x [M, K] @ W.T in float32 [M, N], on the AMX tiles: x rounded to bfloat16, W dequantized to
    bfloat16 as `dequantize` does, a panel of rows per thread at a time (c/qmatmul.c), float32 sums
    (amx_ready and amx_fits hold)."""
    if not (amx_ready() and amx_fits(w)):  # without Linux's grant a tile instruction is SIGILL
        raise RuntimeError("amx_linear: no AMX tiles here, or a weight they do not take")
    n, k = w.shape
    x = x.float().contiguous()
    m = x.shape[0]
    y = torch.empty(m, n)
    xv = scratch(k * ((m + 31) // 32 * 32), torch.int16)  # the tokens' bfloat16 pairs
    _lib.amx_linear(w.kind, w.codes.data_ptr(), w.d.data_ptr(), _ptr(w.c), n, k, x.data_ptr(), m, y.data_ptr(), n,
                    xv.data_ptr(), torch.get_num_threads())
    return y


def dense_matmul(x: torch.Tensor, w: Blocks, dtype: torch.dtype) -> torch.Tensor:
    """x @ W.T as a dense matmul in `dtype` (prefill-sized batches), in x's dtype: W dequantized into
    this thread's scratch for torch's matmul, or, in bfloat16 where amx_ready and amx_fits, amx_linear
    (no whole dequantized copy: 1.9x at 256 rows of 11264x2048 interleaved 4-bit, BENCHMARKS.md)."""
    if dtype == torch.bfloat16 and amx_fits(w) and amx_ready():
        return amx_linear(x, w).to(x.dtype)
    return F.linear(x.to(dtype), dequantize(w, dtype, reuse=True)).to(x.dtype)


@dataclass
class Blocks:
    """A weight [N, K] in the layout of the module docstring (tensors on the CPU, contiguous)."""

    codes: torch.Tensor  # 4-bit: uint8 [N, K/2]; 8-bit: int8 [N, K]
    d: torch.Tensor  # float32 [N, K/32], or float16 where that holds every scale exactly, or factored codes (uint8)
    c: torch.Tensor | None  # float32 [N, K/32]; None where every offset is 0 (symmetric codes: Q4_0, Q8_0);
    #                         factored: the codes' float16 factors
    bits: int
    interleaved: bool = False  # rows interleaved by 8 (the module docstring)

    @property
    def kind(self) -> int:
        """`bits` as the C entry points take it: HALF_SCALES or'ed in when d is float16, KSCALES when
        the scales are factored, INTERLEAVED when the rows are."""
        return (self.bits | (HALF_SCALES if self.d.dtype == torch.float16 else 0)
                | (KSCALES if self.d.dtype == torch.uint8 else 0) | (INTERLEAVED if self.interleaved else 0))

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * (2 if self.bits == 4 else 1)

    @staticmethod
    def from_codes(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor, bits: int) -> Blocks:
        """Unsigned codes q [N, K] (0..2^bits-1) with per-group scale / offset [N, G], K / G a
        multiple of 32: weight = q * scale + offset."""
        n, k = q.shape
        if k % 32 or (k // scale.shape[1]) % 32:
            raise ValueError(f"blocks need groups of a multiple of 32 weights, got [{n}, {k}] in {scale.shape[1]} groups")
        f = k // 32 // scale.shape[1]
        d = scale.float().repeat_interleave(f, 1).contiguous()
        c = offset.float().repeat_interleave(f, 1)
        q = q.to(torch.int16)
        if bits == 4 and d.shape[1] % 8 == 0 and c.any():  # factored scales where they hold exactly (Q4_K)
            fd, fc = _factor(d), _factor(c)
            if fd is not None and fc is not None:
                b = q.to(torch.uint8).view(n, k // 32, 2, 16)
                codes = (b[:, :, 0] | (b[:, :, 1] << 4)).reshape(n, k // 2)
                sm = torch.stack([fd[0].view(n, -1, 8), fc[0].view(n, -1, 8)], 2).reshape(n, -1)
                return Blocks(codes.contiguous(), sm.contiguous(), torch.stack([fd[1], fc[1]], -1).reshape(n, -1), 4)
        if bits == 4:  # nibbles as they are; the offset absorbs the centring 8 * scale
            b = q.to(torch.uint8).view(n, k // 32, 2, 16)
            codes = (b[:, :, 0] | (b[:, :, 1] << 4)).reshape(n, k // 2)
            c = c + 8 * d
        else:  # signed codes q - 128: the offset absorbs 128 * scale
            codes = (q - 128).to(torch.int8)
            c = c + 128 * d
        # Symmetric codes (GGUF Q4_0 / Q8_0, symmetric int4 / int8) have no offsets: not storing
        # them saves a sixth of a 4-bit weight's bytes, and each row's offsets dot product.
        c = None if not c.any() else c.contiguous()
        # Scales that float16 holds exactly (a GGUF Q4_0 / Q8_0 scale is a float16) are kept so:
        # with no offsets, a 4-bit weight is 18 bytes per 32 weights, as in the file.
        half = d.to(torch.float16)
        if c is None and torch.equal(half.float(), d):
            d = half
        return Blocks(codes.contiguous(), d, c, bits)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.d, self.c) if t is not None)


_FACTOR_CODES = (63, *range(62, 0, -1), *range(64, 256))  # the largest code of 8, most likely first


def _factor_left(g: torch.Tensor, top: torch.Tensor, left: torch.Tensor, codes: torch.Tensor,
                 factor: torch.Tensor, tries: tuple[int, ...] = _FACTOR_CODES) -> torch.Tensor:
    """Rows `left` of g [R, 8] factored into codes / factor (see _factor); the rows that are not."""
    for s in tries:
        if len(left) == 0:
            break
        f = (top[left] / s).half()
        r = (g[left] / f.float()[:, None]).round()
        ok = ((r >= 0) & (r <= 255) & (f.float()[:, None] * r == g[left])).all(1)
        codes[left[ok]] = r[ok].to(torch.uint8)
        factor[left[ok]] = f[ok]
        left = left[~ok]
    return left


def _factor(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """t [N, nb] float32 (nb a multiple of 8) as uint8 codes [N, nb] times one float16 per 8 values
    [N, nb / 8], exactly; None where some 8 have no such factor. A GGUF Q4_K's scales and offsets
    are 6-bit codes times a float16: with s the largest code of 8 (63 from llama.cpp's reference
    quantizer, sometimes less from its importance-weighted one), the factor is the largest value
    over s, tried for each s in turn on the 8s still left. A sample of 256 is tried first, and given
    up if none of it factors with s from 63 to 56: a t without the structure (AWQ's or GPTQ's float
    scales) costs milliseconds."""
    n, nb = t.shape
    g = t.reshape(-1, 8)
    top = g.gather(1, g.abs().argmax(1, keepdim=True)).squeeze(1)  # each 8's value of largest magnitude
    codes = torch.zeros(g.shape, dtype=torch.uint8)
    factor = torch.zeros(len(g), dtype=torch.float16)
    left = top.ne(0).nonzero().squeeze(1)  # (all zero: codes 0 times 0)
    sample = left[::max(1, len(left) // 256)]
    rest = _factor_left(g, top, sample, codes, factor, _FACTOR_CODES[:8])
    if len(rest) == len(sample) > 0 or len(_factor_left(g, top, rest, codes, factor)):
        return None
    if len(_factor_left(g, top, left, codes, factor)):
        return None
    return codes.view(n, nb), factor.view(n, nb // 8)


def _float_scales(w: Blocks) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Row-major w's scales and (centred) offsets as float32 [N, K/32]: the stored ones, or the
    factored ones multiplied out as the kernels do."""
    if w.d.dtype != torch.uint8:
        return w.d.float(), w.c
    n = w.d.shape[0]
    codes, f = w.d.view(n, -1, 2, 8).float(), w.c.view(n, -1, 2).float()
    d = (codes[:, :, 0] * f[:, :, 0:1]).reshape(n, -1)
    return d, (codes[:, :, 1] * f[:, :, 1:2]).reshape(n, -1) + 8 * d


def can_interleave(w: Blocks) -> bool:
    return w.shape[0] % 8 == 0


def interleaved_for(mode: str, bits: int) -> bool:
    """Whether weights of `bits` run `mode` activations on rows interleaved by 8: int16 always, int8
    with 4-bit codes (read in place by il8_tile) and, where the kernels' ISA level has VNNI, with
    8-bit ones (il8b_tile; without VNNI they stay row-major: maddubs would saturate on them)."""
    if mode == "int16" or (mode == "int8" and bits == 4):
        return True
    return mode == "int8" and bits == 8 and cpu.isa_level() in VNNI_LEVELS


def _groups(t: torch.Tensor, forward: bool) -> torch.Tensor:
    """Scales t [N, nb] with rows interleaved by 8 (forward: [G, 8, nb] -> [G, nb, 8]) or back."""
    n, nb = t.shape
    if forward:
        return t.reshape(n // 8, 8, nb).transpose(1, 2).contiguous().view(n, nb)
    return t.reshape(n // 8, nb, 8).transpose(1, 2).contiguous().view(n, nb)


def relayout(w: Blocks, interleaved: bool) -> Blocks:
    """w with its rows interleaved by 8 or row-major (the module docstring); w itself if it is already
    so, or if it cannot be interleaved (rows not a multiple of 8)."""
    if w.interleaved == interleaved or (interleaved and not can_interleave(w)):
        return w
    # scales / offsets: [G, 8, nb] <-> [G, nb, 8]; codes in units of 16 row bytes (a 4-bit block, half
    # an 8-bit one): [G, 8, units, 4 chunks, 4] <-> [G, units, 4 chunks, 8, 4]
    d, c = (None if t is None else _groups(t, interleaved) for t in (w.d, w.c))
    n, half = w.codes.shape
    if interleaved:
        codes = w.codes.reshape(n // 8, 8, half // 16, 4, 4).permute(0, 2, 3, 1, 4)
    else:
        codes = w.codes.reshape(n // 8, half // 16, 4, 8, 4).permute(0, 3, 1, 2, 4)
    codes = codes.contiguous().view(n, half)
    return Blocks(codes, d, c, w.bits, interleaved)


def rows(w: Blocks, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of W, float32 [len(ids), K] (an embedding lookup in a compressed table): the
    values `dequantize` gives, only those rows computed (a decode step's few on the calling
    thread). IndexError for an id outside [0, N)."""
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    n, k = w.shape
    lib = _lib or load()
    if lib is None:  # (Blocks are only built where the library loads: `supports`)
        return reference(w)[ids]
    out = torch.empty(ids.numel(), k)
    bad = lib.take_rows(w.kind, w.codes.data_ptr(), w.d.data_ptr(), _ptr(w.c), n, k, ids.data_ptr(), ids.numel(),
                        out.data_ptr(), torch.get_num_threads())
    if bad >= 0:
        raise IndexError(f"token id {int(ids[bad])} out of range [0, {n})")
    return out


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def matmul(x: torch.Tensor, w: Blocks, mode: str) -> torch.Tensor:
    """x [M, K] float32 (rows may be strided, elements dense) -> x @ W.T [M, N] float32."""
    if x.stride(1) != 1:
        x = x.contiguous()
    m, k = x.shape
    n = w.d.shape[0]
    y = torch.empty(m, n)
    (_lib or load()).qlinear(w.kind, w.codes.data_ptr(), w.d.data_ptr(), _ptr(w.c), n, k, x.data_ptr(), x.stride(0), m,
                 y.data_ptr(), n, MODES.index(mode), torch.get_num_threads())
    return y


def dequantize(w: Blocks, dtype: torch.dtype = torch.float32, reuse: bool = False) -> torch.Tensor:
    """W [N, K] in `dtype`: float32, or bfloat16 written directly (the float32 value rounded to
    nearest even, as `.bfloat16()` would), other dtypes converted from float32.

    reuse: into this thread's scratch buffer, valid until its next reuse call (a prefill-sized
    dense matmul's weight, used once and dropped). A fresh buffer of tens of MB costs more than
    the dequantization: the kernel maps its pages anew and faults on each (46 MB: 14 ms against
    3 ms of dequantizing, 2 threads, Zen 4)."""
    lib = load()
    assert lib is not None
    n, k = w.shape
    bf16 = dtype == torch.bfloat16
    kind = torch.bfloat16 if bf16 else torch.float32
    out = scratch(n * k, kind).view(n, k) if reuse else torch.empty(n, k, dtype=kind)
    lib.dequantize(w.kind, w.codes.data_ptr(), w.d.data_ptr(), _ptr(w.c), n, k, out.data_ptr(), int(bf16),
                   torch.get_num_threads())
    return out.to(dtype)


_scratch_of = threading.local()


def scratch(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """This thread's buffer of at least `numel` elements of `dtype`, kept between calls (it grows
    to the largest weight dequantized with reuse)."""
    bufs = _scratch_of.__dict__.setdefault("bufs", {})
    buf = bufs.get(dtype)
    if buf is None or buf.numel() < numel:
        buf = bufs[dtype] = torch.empty(numel, dtype=dtype)
    return buf[:numel]


def release_scratch() -> None:
    """Drop this thread's scratch buffers (tuning times the dense path of every shape, the LM head's
    too: its buffers would otherwise stay at that size for the process's life)."""
    _scratch_of.__dict__.pop("bufs", None)


def reference(w: Blocks) -> torch.Tensor:
    """W [N, K] float32 from torch ops alone (tests, and machines without a compiler)."""
    w = relayout(w, False)
    n, k = w.shape
    if w.bits == 4:
        b = w.codes.view(n, k // 32, 16)
        q = torch.cat([b & 15, b >> 4], -1).float() - 8
    else:
        q = w.codes.view(n, k // 32, 32).float()
    d, c = _float_scales(w)
    w8 = q * d[..., None]
    return (w8 if c is None else w8 + c[..., None]).view(n, k)


def supports(in_features: int, group_size: int, device: torch.device) -> bool:
    """A weight with this input size and group size can be stored as Blocks and run here."""
    return (device.type == "cpu" and in_features % 32 == 0 and group_size % 32 == 0
            and load() is not None)
