"""Fused float32 CPU ops for the decode step: fewer torch calls per layer.

A decode step of a small model is dozens of tiny ops per layer, each a few microseconds of
dispatch for a few hundred floats of work. These do in one C call what took several:
  rms_norm: (x + residual) -> residual, RMSNorm(x + residual) * weight      (6-8 torch ops)
  rotary:   q and k rotated in place inside the fused qkv output             (2 x 6 torch ops)
  silu_mul: silu(gate) * up from the fused gate_up output                    (3 torch ops)
The same math as the torch code they replace (float32 throughout; only summation order
differs). Used for float32 tensors on the CPU when the library builds; torch ops otherwise.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from kvserve.kernels import build

logger = logging.getLogger(__name__)


_i64, _vp, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {
    "rms_norm": [_vp, _i64, _vp, _vp, _vp, _vp, _i64, _i64, ctypes.c_float, _int],
    "rotary": [_vp, _i64, _i64, _i64, _i64, _vp, _vp, _int],
    "silu_mul": [_vp, _vp, _i64, _i64, _int],
}
_lib: ctypes.CDLL | None = None


def load() -> ctypes.CDLL | None:
    """The compiled library (build.load_library), or None: callers then use torch ops."""
    global _lib
    _lib = build.load_library("ops", "ops.c", _SIGNATURES)
    return _lib


def usable(*tensors: torch.Tensor) -> bool:
    """Every tensor is float32 on the CPU, and the library is built."""
    return (all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors)
            and (_lib is not None or load() is not None))


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [T, n] with dense rows (a view when it already is)."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x) * weight; with residual: (norm(x + residual) * weight, x + residual), as RMSNorm."""
    x2 = _rows(x)
    t, n = x2.shape
    out = torch.empty(x.shape)
    if residual is None:
        _lib.rms_norm(x2.data_ptr(), x2.stride(0), None, None, weight.data_ptr(), out.data_ptr(), t, n, eps,
                      torch.get_num_threads())
        return out
    r_in = _rows(residual)
    if r_in.stride(0) != n:
        r_in = r_in.contiguous()
    r_out = torch.empty(x.shape)
    _lib.rms_norm(x2.data_ptr(), x2.stride(0), r_in.data_ptr(), r_out.data_ptr(), weight.data_ptr(), out.data_ptr(),
                  t, n, eps, torch.get_num_threads())
    return out, r_out


def rotary_(x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate x [T, heads * head_dim] (rows may be strided, e.g. a column slice of qkv) in place;
    cos / sin hold [T, head_dim / 2] contiguous values."""
    assert x.stride(-1) == 1 and cos.is_contiguous() and sin.is_contiguous()
    _lib.rotary(x.data_ptr(), x.stride(0), x.shape[0], heads, head_dim, cos.data_ptr(), sin.data_ptr(),
                torch.get_num_threads())


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2n] (contiguous) -> [T, n]."""
    gu = gate_up if gate_up.is_contiguous() else gate_up.contiguous()
    t, n2 = gu.shape
    out = torch.empty(t, n2 // 2)
    _lib.silu_mul(gu.data_ptr(), out.data_ptr(), t, n2 // 2, torch.get_num_threads())
    return out
