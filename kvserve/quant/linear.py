"""Quantized linear kernels that replace nn.Linear, built from a QuantizedWeight / Fp8Weight.

Every module takes x [..., in] in the model dtype and returns [..., out]; the bias (if
any) is a plain `bias` parameter, the weight lives in buffers. Each path was chosen by
timing the default model's shapes (576->576, 576->960, 576->3072, 1536->576) in bf16 on
this AVX-512/AMX CPU (table in the issue note):

- Int4Linear: torch's CPU int4 kernel, 2.5-3x faster than a bf16 F.linear for 1 token
  but linear in the token count; from INT4_DEQUANT_MIN_TOKENS tokens on, unpacking the
  kernel's own layout (float32 arithmetic, then the model dtype) + one matmul wins
  (1.4-1.6x at 256 tokens).
- Int8Linear: per channel -> `_weight_int8pack_mm` below INT8_DEQUANT_MIN_TOKENS tokens,
  else F.linear on the int8 codes cast to the model dtype, scaled per output. Group-wise
  (GGUF Q8_0) -> the int4 kernel on two nibble planes (q = 16 hi + lo) of a doubled
  input [x, x] (2x faster than bf16 for 1 token, 5x faster than dequantizing per call),
  or the unpacked weight from INT8_PLANES_DEQUANT_MIN_TOKENS tokens on.
- Fp8Linear: CPU has no fp8 arithmetic and `.to(bfloat16)` on fp8 is slow (7 ms for
  1.8 M weights); moving the 7 code bits into a bfloat16 and multiplying by 2**120 is
  exact and 8x faster, then F.linear, scaled per output (still ~2x a bf16 F.linear for
  1 token: fp8 saves memory, not time, on CPU). CUDA: torch._scaled_mm with per-token
  dynamic activation scales (sm89+, bf16).

CUDA: int4 and int8 weights (group-wise, and int8 per channel as one group) keep compact
storage (uint8 codes, 4-bit two per byte, float32 scale / offset per group) and run through a
Triton GEMM that reads the codes in place (quant/triton_matmul.py; groups that are multiples of
16, or one per row). Without triton, and on CPU shapes the int4 kernel rejects (out % 16, groups
other than 32..256), the same storage is dequantized per call. CPU serving never takes the
Triton path; tests build it there under Triton's interpreter (TRITON_ON_CPU).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cache, lru_cache
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.attention.backend import FP8_MAX, saturate_fp8
from kvserve.config import triton_interpreting
from kvserve.quant.base import Fp8Weight, QuantizedWeight
from kvserve.kernels import qmatmul, tuning

logger = logging.getLogger(__name__)

INT4_DEQUANT_MIN_TOKENS = 128  # tokens from which unpack + matmul beats the int4 kernel
INT8_PLANES_DEQUANT_MIN_TOKENS = 64  # the same for 8-bit codes as two int4 planes (twice the kernel work)
INT8_DEQUANT_MIN_TOKENS = 32  # tokens from which F.linear on int8 codes beats _weight_int8pack_mm
_KERNEL_GROUPS = (256, 128, 64, 32)  # group sizes _weight_int4pack_mm_for_cpu accepts
TRITON_ON_CPU = False  # tests set it (under TRITON_INTERPRET=1) to build the "triton" path on a CPU


@cache
def _triton_matmul() -> ModuleType | None:
    """kvserve.quant.triton_matmul if triton imports; imported on first need (triton is a heavy import)."""
    from kvserve.quant import triton_matmul
    return triton_matmul if triton_matmul.triton is not None else None


def _triton_path(in_features: int, group_size: int, device: torch.device) -> bool:
    """Group codes run through the Triton GEMM: on CUDA when triton imports; on a CPU only in
    Triton's interpreter when a test asks (TRITON_ON_CPU), so CPU serving keeps its C kernels."""
    if device.type != "cuda" and not (device.type == "cpu" and TRITON_ON_CPU and triton_interpreting()):
        return False
    tm = _triton_matmul()
    return tm is not None and tm.supports(in_features, group_size)


def _kernel_group(group_size: int, out_features: int, device: torch.device) -> int | None:
    """The int4 kernel's group size for `group_size` (groups split exactly), or None if it cannot run."""
    if device.type != "cpu" or out_features % 16 or _int4_layout() is None:
        return None
    return next((g for g in _KERNEL_GROUPS if group_size % g == 0), None)


def _split_groups(t: torch.Tensor, factor: int) -> torch.Tensor:
    """Per-group values [out, G] -> [out, G * factor] for groups `factor` times smaller."""
    return t if factor == 1 else t.repeat_interleave(factor, dim=1)


def _unpack_int4(packed: torch.Tensor, n: int, k: int, layout: tuple[int, bool]) -> torch.Tensor:
    """torch's CPU int4 packing of a [n, k] weight -> the codes transposed, uint8 [k, n].

    layout (block, halves): rows go in blocks of `block`; a full block stores [k, block/2]
    bytes whose low nibbles are rows 0..block/2-1 and high nibbles the rest (halves) or
    adjacent row pairs (not halves); a last partial block always stores row pairs.
    """
    block, halves = layout
    full = n // block
    flat = packed.reshape(-1)
    parts = []
    if full:
        head = flat[: full * k * block // 2].view(full, k, block // 2)
        lo, hi = head & 15, head >> 4
        codes = torch.cat([lo, hi], -1) if halves else torch.stack([lo, hi], -1).view(full, k, block)
        parts.append(codes.permute(1, 0, 2).reshape(k, full * block))
    if n - full * block:
        tail = flat[full * k * block // 2:].view(k, (n - full * block) // 2)
        parts.append(torch.stack([tail & 15, tail >> 4], -1).view(k, -1))
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1)


@lru_cache(maxsize=1)
def _int4_layout() -> tuple[int, bool] | None:
    """How this torch build / CPU packs int4 weights (it depends on the vector ISA), found by
    packing a probe; None (no int4 kernel) if no known layout reproduces it."""
    probe = torch.randint(0, 16, (80, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    try:
        packed = torch._convert_weight_to_int4pack_for_cpu(probe, 1)
    except (RuntimeError, AttributeError) as e:
        logger.info("int4 CPU kernel unavailable (%s); int4 weights are dequantized per call", e)
        return None
    for layout in ((64, True), (32, True), (32, False)):
        if torch.equal(_unpack_int4(packed, 80, 64, layout), probe.t().to(torch.uint8)):
            return layout
    logger.info("unknown int4 CPU packing layout; int4 weights are dequantized per call")
    return None


@dataclass(frozen=True)
class InplaceWeight:
    """How a quantized linear's weight is read in place by the C kernels, for code that runs them
    itself (the decode stack, kvserve/worker/decode_stack.py). Either `blocks` (qmatmul.Blocks,
    multiplied with `activations`, one of qmatmul.MODES) or `kquant_parts` (raw GGUF K-quant rows:
    kquant.make_matrix's parts, views into the module's buffer), or `parts`: one of these per run of
    output rows (StackedLinear). From `dense_from` rows on the module takes another path (int8
    codes or a dense matmul), which the decode stack leaves to it. The weight is in input-channel order (no permutation), bias apart."""

    out_features: int
    in_features: int
    dense_from: int
    blocks: qmatmul.Blocks | None = None
    activations: str = "float32"
    kquant_parts: list[tuple[int, torch.Tensor]] | None = None
    parts: list[InplaceWeight] | None = None  # a StackedLinear: its kernels' weights, output rows in order


class _QuantLinear(nn.Module):
    """Shared plumbing: flatten leading dims, apply the input permutation, add the bias."""

    def __init__(self, out_features: int, in_features: int, perm: torch.Tensor | None,
                 bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        self.register_buffer("perm", None if perm is None else perm.to(device=device, dtype=torch.int64))
        if bias is not None and tuple(bias.shape) != (out_features,):
            raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({out_features},)")
        self.bias = None if bias is None else nn.Parameter(bias.to(device=device, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        y = self._matmul(x2.contiguous())
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in] in stored column order -> x @ W_stored.T [M, out] (no bias)."""
        raise NotImplementedError

    def inplace_weight(self) -> InplaceWeight | None:
        """The weight as the C kernels read it in place, or None where this module does not run one
        of them (another path, or an input permutation)."""
        return None

    @property
    def prefill_int8(self) -> bool:
        """Whether some prefill-sized batches run int8 codes (tuning's int8_from, below dense_from;
        only the paths tuning measures have them)."""
        return getattr(self, "int8_from", tuning.NEVER) < getattr(self, "dense_from", tuning.NEVER)

    def _stored_weight(self) -> torch.Tensor:
        """W [out, in] in stored column order, float32."""
        raise NotImplementedError

    def dequantize(self) -> torch.Tensor:
        """W [out, in] in float32 and input-channel order, as the module applies it."""
        w = self._stored_weight()
        return w if self.perm is None else torch.empty_like(w).index_copy_(1, self.perm, w)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, path={self.path}"


class GroupCodesLinear(_QuantLinear):
    """Integer codes with per-group scale/offset: blocks for the C kernel, packed for the CPU int4
    kernel (`planes` 4-bit planes of the input dim: 1 for 4-bit, 2 for 8-bit codes), or kept
    compact (uint8 codes, two 4-bit codes per byte) and read by the Triton GEMM or dequantized
    per call."""

    def _init_codes(self, qw: QuantizedWeight, planes: int, device: torch.device) -> None:
        out, n_in = qw.shape
        self.planes = planes
        if _triton_path(n_in, qw.group_size, device):
            self._init_compact(qw, "triton", device)
            return
        if qmatmul.supports(n_in, qw.group_size, device):
            self.path = "blocks"
            self.bits = qw.bits
            self.group = 32
            blocks = qmatmul.Blocks.from_codes(qw.q, qw.scale, qw.offset, qw.bits)
            self.register_buffer("codes", blocks.codes.to(device))
            self.register_buffer("d", blocks.d.to(device))
            self.register_buffer("c", None if blocks.c is None else blocks.c.to(device))
            # set by kvserve.kernels.tuning from measurements; these are the untuned defaults
            # (dense_dtype: the dense prefill matmul's dtype, None for x's; from int8_from rows up
            # to dense_from the kernel with int8 codes; decode keeps the kernel)
            self.activations, self.dense_from = "float32", tuning.DEFAULT_DENSE_FROM
            self.dense_dtype: torch.dtype | None = None
            self.int8_from = tuning.NEVER
            return
        self.group = _kernel_group(qw.group_size, out, device)
        if self.group is None:
            self._init_compact(qw, "dequantize", device)
            return
        q = qw.q.to(torch.int32)
        self.path = "int4 kernel"
        factor = qw.group_size // self.group
        scale, offset = _split_groups(qw.scale.float(), factor), _split_groups(qw.offset.float(), factor)
        if planes == 1:  # kernel dequantization: (q - 8) * s + z
            sz = torch.stack([scale, offset + 8 * scale], -1)
        else:  # (hi - 8) * 16 s + z_hi + (lo - 8) * s + z_lo == (16 hi + lo) * s + offset
            hi = torch.stack([16 * scale, offset + 136 * scale], -1)
            sz = torch.cat([hi, torch.stack([scale, torch.zeros_like(scale)], -1)], 1)
            q = torch.cat([q >> 4, q & 15], 1)
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(q.contiguous(), 1).to(device))
        self.register_buffer("scales_zeros", sz.transpose(0, 1).contiguous().to(device=device, dtype=self.dtype))

    def _init_compact(self, qw: QuantizedWeight, path: str, device: torch.device) -> None:
        """Compact storage for the "triton" and "dequantize" paths: uint8 codes [out, in], 4-bit
        ones two per byte (low nibble = even column) when `in` is even, float32 scale / offset."""
        self.path, self.group, self.bits = path, qw.group_size, qw.bits
        codes = qw.q.to(torch.uint8)
        if qw.bits == 4 and qw.shape[1] % 2 == 0:
            codes = codes[:, 0::2] | (codes[:, 1::2] << 4)
        self.register_buffer("codes", codes.contiguous().to(device))
        self.register_buffer("scale", qw.scale.float().contiguous().to(device))
        self.register_buffer("offset", qw.offset.float().contiguous().to(device))

    def _codes_t(self) -> torch.Tensor:
        """Kernel path: integer codes transposed, uint8 [in, out]."""
        k = self.in_features * self.planes
        u = _unpack_int4(self.packed, self.out_features, k, _int4_layout())
        return u if self.planes == 1 else u[: self.in_features] * 16 + u[self.in_features:]

    def _weight_t(self, dtype: torch.dtype) -> torch.Tensor:
        """Kernel path: W_stored.T [in, out] in `dtype`, from the kernel's own scales and zeros.

        The arithmetic runs in float32: 4-5x faster on CPU than in bfloat16.
        """
        sz = self.scales_zeros.float()
        groups = self.in_features // self.group
        if self.planes == 1:  # (q - 8) s + z
            s, o = sz[..., 0], sz[..., 1] - 8 * sz[..., 0]
        else:  # (q - 136) s + z_hi, s from the low plane
            s = sz[groups:, :, 0]
            o = sz[:groups, :, 1] - 136 * s
        w = self._codes_t().float().view(groups, self.group, self.out_features)
        return w.mul_(s[:, None]).add_(o[:, None]).view(self.in_features, self.out_features).to(dtype)

    def _compact_weight(self, dtype: torch.dtype, ids: torch.Tensor | None = None) -> torch.Tensor:
        """Compact paths: W_stored [out, in] (rows `ids` only, if given) in `dtype`, arithmetic in float32."""
        codes, scale, offset = self.codes, self.scale, self.offset
        if ids is not None:
            codes, scale, offset = codes.index_select(0, ids), scale.index_select(0, ids), offset.index_select(0, ids)
        n = codes.shape[0]
        if self.bits == 4 and codes.shape[1] != self.in_features:
            codes = torch.stack([codes & 15, codes >> 4], -1).view(n, self.in_features)
        groups = self.in_features // self.group
        w = codes.view(n, groups, self.group).float() * scale[..., None] + offset[..., None]
        return w.view(n, self.in_features).to(dtype)

    @property
    def activations(self) -> str:
        """Blocks path: how x is multiplied (one of qmatmul.MODES). Setting it lays the weight out for
        that mode: rows interleaved by 8 (qmatmul.relayout) where qmatmul.interleaved_for says so,
        else row-major."""
        return self.__dict__.get("_activations", "float32")

    @activations.setter
    def activations(self, mode: str) -> None:
        if mode not in qmatmul.MODES:
            raise ValueError(f"activations must be one of {qmatmul.MODES}, got {mode!r}")
        self.__dict__["_activations"] = mode
        if self.path == "blocks":
            b = qmatmul.relayout(self.blocks(), qmatmul.interleaved_for(mode, self.bits))
            self.codes, self.d, self.c = b.codes, b.d, b.c
            self.__dict__["_interleaved"] = b.interleaved

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W (stored column order) in float32: an embedding lookup in a compressed table."""
        ids = ids.reshape(-1)
        if self.path == "blocks":
            return qmatmul.rows(self.blocks(), ids)
        if self.path in ("dequantize", "triton"):
            return self._compact_weight(torch.float32, ids)
        return self._stored_weight().index_select(0, ids)

    def blocks(self) -> qmatmul.Blocks:
        """Blocks path: the weight as qmatmul reads it (built once; again if the buffers were moved)."""
        b = self.__dict__.get("_blocks")
        codes = self._buffers["codes"]
        if b is None or b.codes is not codes:
            b = self.__dict__["_blocks"] = qmatmul.Blocks(codes, self._buffers["d"], self._buffers["c"], self.bits,
                                                          self.__dict__.get("_interleaved", False))
        return b

    def inplace_weight(self) -> InplaceWeight | None:
        if self.path != "blocks" or self.perm is not None:
            return None
        return InplaceWeight(self.out_features, self.in_features, min(self.dense_from, self.int8_from),
                             blocks=self.blocks(), activations=self.activations)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.path == "blocks":
            if x.shape[0] >= self.dense_from:  # prefill-sized: one dense matmul, on bf16 units if tuning chose them
                return qmatmul.dense_matmul(x, self.blocks(), self.dense_dtype or x.dtype)
            if x.shape[0] >= self.int8_from:  # mid-sized, int8 codes (tuning chose)
                return qmatmul.matmul(x.float(), self.blocks(), "int8").to(x.dtype)
            return qmatmul.matmul(x.float(), self.blocks(), self.activations).to(x.dtype)
        if self.path == "triton":
            return _triton_matmul().matmul(x, self.codes, self.scale, self.offset, self.group)
        if self.path == "dequantize":
            return F.linear(x, self._compact_weight(x.dtype))
        if x.shape[0] >= (INT4_DEQUANT_MIN_TOKENS if self.planes == 1 else INT8_PLANES_DEQUANT_MIN_TOKENS):
            return x @ self._weight_t(x.dtype)
        xk = x if self.planes == 1 else torch.cat([x, x], 1)
        return torch._weight_int4pack_mm_for_cpu(xk, self.packed, self.group, self.scales_zeros)

    def _stored_weight(self) -> torch.Tensor:
        if self.path == "blocks":
            return qmatmul.reference(self.blocks())
        if self.path in ("dequantize", "triton"):
            return self._compact_weight(torch.float32)
        return self._weight_t(torch.float32).t().contiguous()


class Int4Linear(GroupCodesLinear):
    """4-bit weights, any group size dividing `in`; CPU int4 kernel where it applies."""

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                 device: str | torch.device = "cpu") -> None:
        if qw.bits != 4:
            raise ValueError(f"Int4Linear needs a 4-bit weight, got bits={qw.bits}")
        device = torch.device(device)
        super().__init__(qw.shape[0], qw.shape[1], qw.perm, bias, dtype, device)
        self._init_codes(qw, 1, device)


class Int8Linear(GroupCodesLinear):
    """8-bit weights. One group per output channel: int8 codes (q - 128) with a per-channel
    scale, plus a rank-one term for asymmetric offsets (the group-code paths "blocks" and
    "triton" take it as one group instead). Smaller groups: the group-code paths."""

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None, dtype: torch.dtype,
                 device: str | torch.device = "cpu") -> None:
        if qw.bits != 8:
            raise ValueError(f"Int8Linear needs an 8-bit weight, got bits={qw.bits}")
        device = torch.device(device)
        out, n_in = qw.shape
        super().__init__(out, n_in, qw.perm, bias, dtype, device)
        self.per_channel = qw.group_size == n_in
        if (not self.per_channel or qmatmul.supports(n_in, qw.group_size, device)
                or _triton_path(n_in, qw.group_size, device)):
            self._init_codes(qw, 2, device)
            return
        self.path = "int8 kernel" if device.type == "cpu" else "dequantize"
        scale = qw.scale[:, 0].float()
        self.register_buffer("weight_int8", (qw.q.to(torch.int16) - 128).to(device=device, dtype=torch.int8))
        self.register_buffer("weight_scale", scale.to(device=device, dtype=dtype))
        shift = qw.offset[:, 0].float() + 128 * scale  # W = (q - 128) * s + shift
        self.register_buffer("shift", None if qw.symmetric else shift.to(device=device, dtype=dtype))

    def _group_codes(self) -> bool:
        """Built by GroupCodesLinear._init_codes, not as int8 codes with a per-channel scale."""
        return not self.per_channel or self.path in ("blocks", "triton")

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self._group_codes():
            return super()._matmul(x)
        if self.path == "int8 kernel" and x.shape[0] < INT8_DEQUANT_MIN_TOKENS:
            y = torch._weight_int8pack_mm(x, self.weight_int8, self.weight_scale)
        else:
            y = F.linear(x, self.weight_int8.to(x.dtype)) * self.weight_scale
        if self.shift is not None:
            y = y + x.sum(-1, keepdim=True) * self.shift
        return y

    def _stored_weight(self) -> torch.Tensor:
        if self._group_codes():
            return super()._stored_weight()
        w = self.weight_int8.float() * self.weight_scale.float()[:, None]
        return w if self.shift is None else w + self.shift.float()[:, None]


def fp8_to_bfloat16(w: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn -> bfloat16, exactly (NaN codes excepted), without torch's slow CPU cast.

    The sign and the 7 exponent/mantissa bits land in a bfloat16 whose exponent bias is
    120 too large (e4m3 subnormals become bf16 subnormals), so one multiply by 2**120 fixes it.
    """
    bits = (w.view(torch.int8).to(torch.int16) << 4) & -0x7810  # keep bit 15 (sign) and bits 10..4
    return bits.view(torch.bfloat16) * 2.0**120


@cache
def scaled_mm_works(device: torch.device) -> bool:
    """Whether torch._scaled_mm with row-wise scales (per token x per output channel) runs on
    this device: CUDA sm89 / sm90 do, older GPUs and some newer ones raise. Tried once."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        return False
    try:
        a = torch.ones(16, 16, device=device).to(torch.float8_e4m3fn)
        y = torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1, device=device),
                             scale_b=torch.ones(1, 16, device=device), out_dtype=torch.bfloat16)
        return bool((y == 16).all())
    except (RuntimeError, NotImplementedError, TypeError) as e:
        logger.info("torch._scaled_mm with row-wise scales does not run on %s (%s): fp8 weights are cast", device, e)
        return False


class Fp8Linear(_QuantLinear):
    """float8 e4m3 weights with a per-output-channel scale."""

    def __init__(self, fw: Fp8Weight, bias: torch.Tensor | None, dtype: torch.dtype,
                 device: str | torch.device = "cpu") -> None:
        device = torch.device(device)
        out, n_in = fw.shape
        super().__init__(out, n_in, None, bias, dtype, device)
        if fw.weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"Fp8Linear needs a float8_e4m3fn weight, got {fw.weight.dtype}")
        if tuple(fw.scale.shape) != (out,):
            raise ValueError(f"fp8 weight scale has shape {tuple(fw.scale.shape)}, expected ({out},)")
        self.register_buffer("weight_fp8", fw.weight.to(device))
        self.register_buffer("weight_scale", fw.scale.float().to(device))
        self.path = "bf16 via bit shift"
        if device.type == "cuda":
            fits = dtype == torch.bfloat16 and out % 16 == 0 and n_in % 16 == 0
            self.path = "_scaled_mm" if fits and scaled_mm_works(device) else "cast"

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.path == "_scaled_mm":
            a = (x.abs().amax(-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
            xq = saturate_fp8(x.float() / a)
            return torch._scaled_mm(xq, self.weight_fp8.t(), scale_a=a, scale_b=self.weight_scale[None, :],
                                    out_dtype=x.dtype)
        return F.linear(x, self._codes(x.dtype)) * self.weight_scale.to(x.dtype)

    def _codes(self, dtype: torch.dtype) -> torch.Tensor:
        if self.path == "cast":
            return self.weight_fp8.to(dtype)
        return fp8_to_bfloat16(self.weight_fp8).to(dtype)

    def _stored_weight(self) -> torch.Tensor:
        return self.weight_fp8.float() * self.weight_scale[:, None]


class StackedLinear(_QuantLinear):
    """A fused linear (q/k/v, gate/up) whose parts take different kernels, stacked by output rows:
    `kernels` (no bias, no input permutation) each multiply x, their outputs side by side. A GGUF
    Q4_K_M q/k/v is one: Q4_K q and k as blocks (factored scales, rows interleaved, ~2x the weights
    per second of the K-quant kernel on Zen 3) and a Q6_K v read in place by the K-quant kernel."""

    def __init__(self, kernels: list[_QuantLinear], bias: torch.Tensor | None, dtype: torch.dtype,
                 device: str | torch.device = "cpu") -> None:
        n_in = kernels[0].in_features
        if any(k.in_features != n_in or k.bias is not None or k.perm is not None for k in kernels):
            raise ValueError("stacked kernels must share the input dim and have no bias or input permutation")
        super().__init__(sum(k.out_features for k in kernels), n_in, None, bias, dtype, torch.device(device))
        self.kernels = nn.ModuleList(kernels)
        self.path = "stacked"

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([k._matmul(x) for k in self.kernels], -1)

    def _stored_weight(self) -> torch.Tensor:
        return torch.cat([k._stored_weight() for k in self.kernels])

    def inplace_weight(self) -> InplaceWeight | None:
        parts = [k.inplace_weight() for k in self.kernels]
        if any(p is None for p in parts):
            return None
        return InplaceWeight(self.out_features, self.in_features, min(p.dense_from for p in parts), parts=parts)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rows={[k.out_features for k in self.kernels]}"


def quantized_linear(weight: QuantizedWeight | Fp8Weight | object, bias: torch.Tensor | None, dtype: torch.dtype,
                     device: str | torch.device = "cpu") -> _QuantLinear:
    """The kernel module for a weight: Int4Linear, Int8Linear, Fp8Linear, or KQuantLinear for raw GGUF
    K-quant rows (a KQuantWeight, or a list of them: the parts of a fused linear)."""
    from kvserve.quant.gguf import KQuantWeight  # kquant_linear imports this module: imported here

    if isinstance(weight, (KQuantWeight, list, tuple)):
        from kvserve.quant.kquant_linear import KQuantLinear

        return KQuantLinear(weight, bias, dtype, device)
    if isinstance(weight, Fp8Weight):
        return Fp8Linear(weight, bias, dtype, device)
    return (Int4Linear if weight.bits == 4 else Int8Linear)(weight, bias, dtype, device)
