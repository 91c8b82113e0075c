"""GGUF K-quant weights (Q4_K, Q5_K, Q6_K) read in place: the kernels of c/kquant.c.

A weight is a `KqMatrix`: up to MAX_PARTS parts of consecutive output rows, each the raw GGUF rows
(uint8 [rows, bytes per row]) of one type, so a fused q/k/v or gate/up whose parts differ in type
(Q5_K beside Q6_K) is one matrix; a Q6_K part whose rows come in 8s is kept interleaved by 8
(`interleave`, type Q6_KI: the same bytes, read faster at decode). (The loader hands Q4_K to
qmatmul's blocks instead, which read it about twice as fast, and stacks the two kernels where a
fused linear mixes Q4_K with Q5_K / Q6_K: kvserve.quant.linear.StackedLinear.) `matmul` quantizes
the activations to int16 per 32-value block and multiplies in C (decode-sized batches); for prefill-sized batches, where the
matmul is compute-bound, `matmul_int8` multiplies int8 activations against the codes, or `dequantize`
writes W as float32 or bfloat16 for the caller's F.linear (tuning picks per shape).
"""

from __future__ import annotations

import ctypes

import torch

from kvserve.kernels import build, cpu, layout, qmatmul

Q4_K, Q5_K, Q6_K = 12, 13, 14  # GGMLQuantizationType values
# Q6_K rows interleaved by 8 (`interleave`; c/kquant.c's KQ_Q6_KI): not a GGML type, the same bytes
Q6_KI = 114
BLOCK_BYTES = {Q4_K: 144, Q5_K: 176, Q6_K: 210, Q6_KI: 210}  # per 256 weights
FILE_TYPES = frozenset({Q4_K, Q5_K, Q6_K})  # the GGUF types read here
MAX_PARTS = 4

_vp, _i64, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {
    "kq_linear": [_vp, _i64, _vp, _i64, _i64, _vp, _i64, _int],
    "kq_dequantize": [_vp, _vp, _int, _int],
    "kq_linear_int8": [_vp, _i64, _vp, _i64, _i64, _vp, _i64, _int],
    "kq_q6k_interleave": [_vp, _i64, _i64, _vp, _int],
    "kq_take_rows": [_vp, _vp, _i64, _vp, _int],
}


class KqPart(ctypes.Structure):
    _fields_ = [("qtype", ctypes.c_int64), ("rows", ctypes.c_int64), ("data", ctypes.c_void_p)]


class KqMatrix(ctypes.Structure):
    _fields_ = [("nparts", ctypes.c_int64), ("k", ctypes.c_int64), ("part", KqPart * MAX_PARTS)]


def check_layout(lib: ctypes.CDLL) -> None:
    """The ctypes structs against the C ones (kq_layout's sizeof / offsetof): RuntimeError on a mismatch."""
    table = layout.c_layout(lib, "kq_layout")
    for structure in (KqPart, KqMatrix):
        layout.check(structure, table)


_lib: ctypes.CDLL | None = None
_tried = False


def load() -> ctypes.CDLL | None:
    """The compiled library for this CPU's ISA level (build.load_library), or None: callers then
    dequantize with gguf's numpy code. Kept after the first call."""
    global _lib, _tried
    if not _tried:
        _lib = build.load_library("kquant", "kquant.c", _SIGNATURES)
        if _lib is not None:
            check_layout(_lib)
            _lib.kq_linear_int8.restype = ctypes.c_int  # 0, or -1: the int8 path does not apply
            _lib.kq_q6k_interleave.restype = ctypes.c_int  # 0, or -1: not on this build
            _lib.kq_take_rows.restype = ctypes.c_int64  # -1, or the first position of an id out of range
        _tried = True
    return _lib


def row_bytes(qtype: int, k: int) -> int:
    return k // 256 * BLOCK_BYTES[qtype]


def interleave(qtype: int, rows: torch.Tensor) -> tuple[int, torch.Tensor]:
    """A part as the kernels read it fastest: Q6_K rows [n, bytes] with n a multiple of 8 become
    (Q6_KI, the same bytes regrouped by 8 rows), which the one-token kernel multiplies 8 rows at a
    time against broadcast activations (1.3-1.5x the GB/s of the file's row order from DRAM on
    Zen 4); anything else, or a build without the AVX2 kernels, comes back as it is. A Q6_KI
    tensor's "rows" are no rows of W: only the C kernels (and `dequantize`) read it."""
    lib = load()
    if qtype != Q6_K or rows.shape[0] % 8 or lib is None or cpu.isa_level() == "generic":
        return qtype, rows
    rows = rows.contiguous()
    out = torch.empty_like(rows)
    k = rows.shape[1] // BLOCK_BYTES[Q6_K] * 256
    if lib.kq_q6k_interleave(rows.data_ptr(), rows.shape[0], k, out.data_ptr(), torch.get_num_threads()):
        return qtype, rows
    return Q6_KI, out


def make_matrix(parts: list[tuple[int, torch.Tensor]], k: int) -> KqMatrix:
    """The C view of parts (qtype, uint8 [rows, row_bytes(qtype, k)] contiguous CPU tensors); the
    caller keeps the tensors alive as long as the matrix is used."""
    if not 0 < len(parts) <= MAX_PARTS:
        raise ValueError(f"a K-quant weight has 1 to {MAX_PARTS} parts, got {len(parts)}")
    m = KqMatrix(len(parts), k)
    for i, (qtype, rows) in enumerate(parts):
        if qtype not in BLOCK_BYTES or k % 256:
            raise ValueError(f"K-quant part of type {qtype} and {k} columns: needs Q4_K/Q5_K/Q6_K and 256 | k")
        if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != row_bytes(qtype, k) \
                or not rows.is_contiguous() or rows.device.type != "cpu":
            raise ValueError(f"K-quant part of type {qtype}: rows {tuple(rows.shape)} {rows.dtype} on "
                             f"{rows.device}, expected contiguous uint8 [n, {row_bytes(qtype, k)}] on the CPU")
        if qtype == Q6_KI and rows.shape[0] % 8:
            raise ValueError(f"an interleaved Q6_K part has rows in groups of 8, got {rows.shape[0]}")
        m.part[i] = KqPart(qtype, rows.shape[0], rows.data_ptr())
    return m


def num_rows(m: KqMatrix) -> int:
    return sum(m.part[i].rows for i in range(m.nparts))


def _linear(fn: str, x: torch.Tensor, m: KqMatrix) -> torch.Tensor:
    """y [M, N] float32 from the C function `fn` (kq_linear's signature) for x [M, K] float32 (rows
    may be strided, elements dense); a nonzero return raises."""
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, k = x.shape
    if k != m.k:
        raise ValueError(f"x has {k} columns, the weight {m.k}")
    n = num_rows(m)
    y = torch.empty(rows, n)
    if getattr(_lib or load(), fn)(ctypes.addressof(m), n, x.data_ptr(), x.stride(0), rows, y.data_ptr(), n,
                                   torch.get_num_threads()):
        raise RuntimeError(f"{fn} does not apply to this weight (int8_applies) or ran out of memory")
    return y


def matmul(x: torch.Tensor, m: KqMatrix) -> torch.Tensor:
    """x [M, K] float32 (rows may be strided, elements dense) -> x @ W.T [M, N] float32."""
    return _linear("kq_linear", x, m)


def int8_applies(m: KqMatrix) -> bool:
    """Whether `matmul_int8` runs for this weight: an AVX2 (or higher) build, every part's rows a
    multiple of 8 (the kernel's groups)."""
    return load() is not None and cpu.isa_level() != "generic" and \
        all(m.part[i].rows % 8 == 0 for i in range(m.nparts))


def matmul_int8(x: torch.Tensor, m: KqMatrix) -> torch.Tensor:
    """x @ W.T as `matmul`, on int8 activations (per 32 values, as qmatmul's int8 codes) against the
    weight's codes, 8 rows at a time decoded into an interleaved copy that every token uses (c/kquant.c,
    kq_linear_int8): prefill-sized batches, where int8 products run at twice bfloat16's rate.
    Requires int8_applies(m)."""
    return _linear("kq_linear_int8", x, m)


def dequantize(m: KqMatrix, dtype: torch.dtype = torch.float32, reuse: bool = False) -> torch.Tensor:
    """W [N, K] in `dtype`: float32, or bfloat16 written directly (each float32 value rounded to
    nearest even, as `.bfloat16()` would), other dtypes converted from float32. reuse: into this
    thread's scratch buffer, as qmatmul.dequantize."""
    lib = load()
    assert lib is not None
    n = num_rows(m)
    bf16 = dtype == torch.bfloat16
    kind = torch.bfloat16 if bf16 else torch.float32
    out = qmatmul.scratch(n * m.k, kind).view(n, m.k) if reuse else torch.empty(n, m.k, dtype=kind)
    lib.kq_dequantize(ctypes.addressof(m), out.data_ptr(), int(bf16), torch.get_num_threads())
    return out.to(dtype)


def take_rows(m: KqMatrix, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of W, float32 [len(ids), K]: the values `dequantize` gives, only those rows
    computed (a decode step's few on the calling thread): an embedding lookup in a K-quant table.
    IndexError for an id outside W's rows."""
    lib = load()
    assert lib is not None
    ids = ids.reshape(-1).to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), m.k)
    bad = lib.kq_take_rows(ctypes.addressof(m), ids.data_ptr(), ids.numel(), out.data_ptr(), torch.get_num_threads())
    if bad >= 0:
        raise IndexError(f"token id {int(ids[bad])} out of range [0, {num_rows(m)})")
    return out


def reference(qtype: int, rows: torch.Tensor) -> torch.Tensor:
    """uint8 rows [n, bytes] -> W [n, K] float32 by gguf's numpy dequantizer (no compiler needed;
    the file's types only, not Q6_KI)."""
    from gguf.quants import GGMLQuantizationType
    from gguf.quants import dequantize as gguf_dequantize

    n = rows.shape[0]
    w = gguf_dequantize(rows.cpu().numpy(), GGMLQuantizationType(qtype))
    return torch.from_numpy(w.reshape(n, -1).copy())
