"""The decode stack's C driver: a decode step's decoder layers in one C call, and the ctypes
structs it reads (kvserve/worker/decode_stack.py builds them from a model and runs it).

The library is qmatmul's, ops', paged attention's and kquant's sources compiled with the driver as
one unit, so the stack computes the same sums in the same order as the layer-by-layer path.
"""

from __future__ import annotations

import ctypes

from kvserve.kernels import build, kquant, layout

# c/decode_stack.c's Lin kinds besides a blocks weight's Blocks.kind: a dense float32 weight, raw
# GGUF K-quant rows (a KqMatrix, kquant.c). Both lie outside every Blocks.kind (bits 4 or 8 with
# qmatmul's flags or'ed in: below 128).
LIN_DENSE = 0
LIN_KQUANT = 256


class Lin(ctypes.Structure):
    """c/decode_stack.c's Lin: one linear, or the first rows of a stacked one whose `rest` points at the
    next part's Lin (checked against it when the library loads)."""
    _fields_ = [("kind", ctypes.c_int64), ("act", ctypes.c_int64), ("n", ctypes.c_int64), ("k", ctypes.c_int64),
                ("w", ctypes.c_void_p), ("d", ctypes.c_void_p), ("c", ctypes.c_void_p), ("bias", ctypes.c_void_p),
                ("rest", ctypes.c_void_p)]


class Layer(ctypes.Structure):
    """c/decode_stack.c's Layer: one decoder layer's weights and KV cache."""
    _fields_ = [("in_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("qkv", Lin), ("o", Lin), ("gate_up", Lin), ("down", Lin),
                ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p), ("k_scale", ctypes.c_float),
                ("v_scale", ctypes.c_float)]


class Dims(ctypes.Structure):
    """c/decode_stack.c's Dims: the model's sizes, the cache's block size and kind."""
    _fields_ = [(n, ctypes.c_int64) for n in ("hidden", "hq", "hkv", "d", "inter", "block_size", "kv_kind", "max_k")] \
        + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]


_vp, _i64, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
_SIGNATURES = {"decode_stack": [_vp, _i64, _vp, _i64, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _i64, _vp, _i64, _vp, _int]}


_checked = False


def check_layout(lib: ctypes.CDLL) -> None:
    """Lin, Layer, Dims (and kquant's KqPart, KqMatrix, compiled in too) against the C structs
    (ds_layout's and kq_layout's sizeof / offsetof): RuntimeError on a mismatch."""
    table = layout.c_layout(lib, "ds_layout")
    for structure in (Lin, Layer, Dims):
        layout.check(structure, table)
    kquant.check_layout(lib)


def load() -> ctypes.CDLL | None:
    """The compiled library (its structs checked once), or None (callers keep the Python path)."""
    global _checked
    lib = build.load_library("decode_stack", "decode_stack.c", _SIGNATURES)
    if lib is not None and not _checked:
        check_layout(lib)
        _checked = True
    return lib
