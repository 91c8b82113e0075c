"""GPTQ: the AutoGPTQ / GPTQModel checkpoint layout and the GPTQ quantizer.

Layout of one linear (W [out, in], b bits, g columns per group, n = in // g):
  qweight int32 [in * b / 32, out]  q packed along the input dim, low bits first
  qzeros  int32 [n, out * b / 32]   zero points packed along the output dim
  scales  fp16  [n, out]
  g_idx   int32 [in]                group of input channel i (act-order: not i // g)
W[o, i] = (q[o, i] - zero[g_idx[i], o]) * scales[g_idx[i], o]. checkpoint_format "gptq"
(v1, AutoGPTQ and what vLLM / transformers read) stores zero - 1; "gptq_v2" (GPTQModel's
internal format) stores the zero as is.

The quantizer is GPTQ (Frantar et al.) as AutoGPTQ runs it: Hessian H = 2 X^T X / n of the
linear's inputs, dampening, Cholesky of H^-1, column blocks with lazy error propagation,
group parameters taken at each group start from the error-updated weights, optional
act-order (columns by descending diag(H)).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from kvserve.attention.backend import saturate_fp8
from kvserve.quant.base import Fp8Weight, QuantizedWeight, QuantMethod, fp8_scale

if TYPE_CHECKING:  # calib reads checkpoints through the model loader, which imports this module
    from kvserve.quant.calib import LayerInputs

CHECKPOINT_FORMATS = ("gptq", "gptq_v2")
_BLOCK = 128
_FP16_TINY = torch.finfo(torch.float16).tiny


# --- int32 packing shared with the AWQ layout -------------------------------------------------------------------

def pack_int32(x: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Pack unsigned `bits`-bit values along `dim`, 32 // bits per int32, slot k at bit k * bits.

    order: slot k holds element order[k] of each run of 32 // bits (AWQ interleaves); None: element k.
    """
    per = 32 // bits
    v = x.movedim(dim, -1).to(torch.int64)
    if v.shape[-1] % per:
        raise ValueError(f"dim {dim} of size {v.shape[-1]} is not a multiple of {per} ({bits}-bit values per int32)")
    v = v.reshape(*v.shape[:-1], v.shape[-1] // per, per)
    if order is not None:
        v = v[..., list(order)]
    packed = (v << (torch.arange(per, dtype=torch.int64, device=v.device) * bits)).sum(-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)  # uint32 bit pattern as int32
    return packed.to(torch.int32).movedim(-1, dim).contiguous()


def unpack_int32(p: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """Inverse of pack_int32: int32 -> int64 values, `dim` grows by 32 // bits."""
    per = 32 // bits
    v = p.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    v = (v[..., None] >> (torch.arange(per, dtype=torch.int64, device=v.device) * bits)) & (2**bits - 1)
    if order is not None:
        v = v[..., sorted(range(per), key=lambda k: order[k])]  # element j sits in slot order.index(j)
    return v.reshape(*v.shape[:-2], -1).movedim(-1, dim)


def integer_zeros(qw: QuantizedWeight, layout: str) -> torch.Tensor:
    """The zero points z with offset == -z * scale, as int64 [out, groups]; ValueError if not integers."""
    safe = torch.where(qw.scale == 0, torch.ones_like(qw.scale), qw.scale)
    z = (-qw.offset / safe).round()
    z = torch.where(qw.scale == 0, torch.zeros_like(z), z)
    if not torch.allclose(-z * qw.scale, qw.offset, rtol=1e-5, atol=1e-12):
        raise ValueError(f"the {layout} layout needs offset == -zero * scale with an integer zero point")
    return z.to(torch.int64)


# --- layout ------------------------------------------------------------------------------------------------------

def _check_format(checkpoint_format: str) -> None:
    if checkpoint_format not in CHECKPOINT_FORMATS:
        raise ValueError(f"checkpoint_format must be one of {', '.join(CHECKPOINT_FORMATS)}, got {checkpoint_format!r}")


def pack_gptq(qw: QuantizedWeight, checkpoint_format: str = "gptq") -> dict[str, torch.Tensor]:
    """QuantizedWeight -> {'qweight', 'qzeros', 'scales', 'g_idx'} as AutoGPTQ (v1) / GPTQModel (v2) store them.

    A `perm` (act-order) becomes g_idx with q in input-channel order. v1 stores zero - 1, so
    it cannot hold a zero point of 0: ValueError (the quantizers here avoid it, see `grid`).
    """
    _check_format(checkpoint_format)
    n_in = qw.shape[1]
    zeros = integer_zeros(qw, "GPTQ")
    if checkpoint_format == "gptq":
        if int(zeros.min()) < 1:
            raise ValueError("a zero point of 0 cannot be stored in checkpoint_format 'gptq' (v1 stores zero - 1); "
                             "use 'gptq_v2'")
        zeros = zeros - 1
    if int(zeros.min()) < 0 or int(zeros.max()) >= 2**qw.bits:
        raise ValueError(f"zero points out of the {qw.bits}-bit range for checkpoint_format {checkpoint_format!r}")
    q = qw.q.to(torch.int64)
    g_idx = torch.arange(n_in, device=q.device) // qw.group_size
    if qw.perm is not None:  # stored column j holds channel perm[j]: back to channel order
        q = torch.empty_like(q).index_copy_(1, qw.perm, q)
        g_idx = torch.empty_like(g_idx).index_copy_(0, qw.perm, g_idx)
    return {"qweight": pack_int32(q, qw.bits, dim=1).t().contiguous(),
            "qzeros": pack_int32(zeros.t(), qw.bits, dim=1),
            "scales": qw.scale.t().to(torch.float16).contiguous(),
            "g_idx": g_idx.to(torch.int32)}


def _perm_from_g_idx(g_idx: torch.Tensor, n_in: int, group_size: int, prefix: str) -> torch.Tensor | None:
    """Channels sorted by group (stable); None when g_idx is the trivial i // group_size."""
    g_idx = g_idx.to(torch.int64)
    if tuple(g_idx.shape) != (n_in,):
        raise ValueError(f"{prefix}.g_idx has shape {tuple(g_idx.shape)}, expected ({n_in},)")
    trivial = torch.arange(n_in, device=g_idx.device) // group_size
    if torch.equal(g_idx, trivial):
        return None
    n_groups = n_in // group_size
    if int(g_idx.min()) < 0 or int(g_idx.max()) >= n_groups:
        raise ValueError(f"{prefix}.g_idx has groups outside 0..{n_groups - 1}")
    if not torch.equal(torch.bincount(g_idx, minlength=n_groups), torch.full((n_groups,), group_size, device=g_idx.device)):
        raise ValueError(f"{prefix}.g_idx does not give every group exactly group_size={group_size} channels")
    return torch.sort(g_idx, stable=True).indices


def unpack_gptq(tensors: dict[str, torch.Tensor], bits: int, group_size: int, checkpoint_format: str = "gptq",
                prefix: str = "linear") -> QuantizedWeight:
    """{'qweight', 'qzeros', 'scales'[, 'g_idx']} -> QuantizedWeight; group_size -1: one group per row.

    With a non-trivial g_idx (act-order) the columns are sorted by group and `perm` is set.
    ValueError naming `prefix` and the tensor on a missing tensor or a wrong shape.
    """
    _check_format(checkpoint_format)
    if bits not in (4, 8):
        raise ValueError(f"{prefix}: GPTQ bits must be 4 or 8, got {bits}")
    for name in ("qweight", "qzeros", "scales"):
        if name not in tensors:
            raise ValueError(f"{prefix}: missing {prefix}.{name} (a GPTQ linear has qweight, qzeros, scales, g_idx)")
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    per = 32 // bits
    if qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise ValueError(f"{prefix}.qweight must be a 2-D int32 tensor, got {qweight.dtype} {tuple(qweight.shape)}")
    n_in, out = qweight.shape[0] * per, qweight.shape[1]
    g = n_in if group_size == -1 else group_size
    if g < 1 or n_in % g:
        raise ValueError(f"{prefix}: group_size {group_size} does not divide the input dim {n_in}")
    n_groups = n_in // g
    if tuple(scales.shape) != (n_groups, out):
        raise ValueError(f"{prefix}.scales has shape {tuple(scales.shape)}, expected {(n_groups, out)}")
    if tuple(qzeros.shape) != (n_groups, out // per) or out % per or qzeros.dtype != torch.int32:
        raise ValueError(f"{prefix}.qzeros has shape {tuple(qzeros.shape)} ({qzeros.dtype}), expected int32 "
                         f"{(n_groups, out // per)}")
    q = unpack_int32(qweight, bits, dim=0).t()  # [out, in]
    zeros = unpack_int32(qzeros, bits, dim=1).t()  # [out, groups]
    if checkpoint_format == "gptq":
        zeros = zeros + 1
    scale = scales.float().t().contiguous()
    perm = _perm_from_g_idx(tensors["g_idx"], n_in, g, prefix) if "g_idx" in tensors else None
    if perm is not None:
        q = q[:, perm]
    return QuantizedWeight(q.to(torch.uint8).contiguous(), scale, -zeros.float() * scale, bits, g, perm)


class GPTQMethod(QuantMethod):
    """GPTQ checkpoints (AutoGPTQ v1 and GPTQModel v2 zero points, 4 / 8 bits, act-order g_idx)."""

    name = "gptq"

    def __init__(self, bits: int, group_size: int, checkpoint_format: str = "gptq", desc_act: bool = False) -> None:
        self.bits, self.group_size = bits, group_size
        self.checkpoint_format, self.desc_act = checkpoint_format, desc_act

    @classmethod
    def from_config(cls, quant_config: dict[str, Any]) -> GPTQMethod:
        """Validate an HF `quantization_config` (or AutoGPTQ's quantize_config.json) of a GPTQ checkpoint."""
        method = quant_config.get("quant_method", "gptq")
        if method != "gptq":
            raise ValueError(f"quantization_config.quant_method is {method!r}, expected 'gptq'")
        bits = quant_config.get("bits", 4)
        if bits not in (4, 8):
            raise ValueError(f"quantization_config.bits={bits!r}: GPTQ checkpoints with 4 or 8 bits are supported")
        group_size = quant_config.get("group_size", 128)
        if not isinstance(group_size, int) or (group_size < 1 and group_size != -1):
            raise ValueError(f"quantization_config.group_size must be a positive integer or -1, got {group_size!r}")
        if quant_config.get("is_marlin_format"):
            raise ValueError("quantization_config.is_marlin_format: Marlin-packed GPTQ checkpoints are not supported")
        fmt = quant_config.get("checkpoint_format", "gptq")
        if fmt not in CHECKPOINT_FORMATS:
            raise ValueError(f"quantization_config.checkpoint_format={fmt!r} is not supported; "
                             f"use one of {', '.join(CHECKPOINT_FORMATS)}")
        if quant_config.get("pack_dtype", "int32") != "int32":
            raise ValueError(f"quantization_config.pack_dtype={quant_config['pack_dtype']!r}: only int32 is supported")
        if quant_config.get("dynamic"):
            raise ValueError("quantization_config.dynamic (per-module overrides) is not supported")
        if quant_config.get("lm_head"):
            raise ValueError("quantization_config.lm_head: a quantized lm_head is not supported")
        return cls(bits, group_size, fmt, bool(quant_config.get("desc_act", False)))

    def tensor_suffixes(self) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales", "g_idx")

    def optional_suffixes(self) -> tuple[str, ...]:
        """AutoGPTQ and GPTQModel always write g_idx, but without act-order it carries nothing
        (channel i is in group i // group_size), and some converters leave it out."""
        return () if self.desc_act else ("g_idx",)

    def convert(self, prefix: str, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
        extra = sorted(set(tensors) - set(self.tensor_suffixes()))
        if extra:
            raise ValueError(f"{prefix}: unexpected tensors {', '.join(f'{prefix}.{s}' for s in extra)} "
                             "in a GPTQ checkpoint")
        if self.desc_act and "g_idx" not in tensors:
            raise ValueError(f"{prefix}: missing {prefix}.g_idx (desc_act is true)")
        return unpack_gptq(tensors, self.bits, self.group_size, self.checkpoint_format, prefix=prefix)


# --- quantizer ---------------------------------------------------------------------------------------------------

class Hessian:
    """Running H = 2 X^T X / n over the rows of every batch of inputs x [..., in]."""

    def __init__(self, n_in: int, device: torch.device | str = "cpu") -> None:
        self.sum = torch.zeros(n_in, n_in, dtype=torch.float32, device=device)
        self.count = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        self.sum.addmm_(x.t(), x)
        self.count += x.shape[0]

    def value(self) -> torch.Tensor:
        if not self.count:
            raise ValueError("no calibration tokens reached this linear")
        return self.sum * (2.0 / self.count)


def grid(w: torch.Tensor, bits: int, sym: bool, min_zero: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's per-row quantization grid of w [out, g] -> (scale, zero) [out], scale fp16-representable.

    The range always includes 0. Symmetric: zero 2**(bits-1) and scale 2 absmax / (2**bits - 1).
    Asymmetric: integer zero = round(-min / scale) raised to `min_zero` (1 for v1 checkpoints,
    which store zero - 1), widening the scale so the group's max stays representable.
    """
    maxq = 2**bits - 1
    lo = w.amin(1).clamp(max=0)
    hi = w.amax(1).clamp(min=0)
    if sym:
        hi = torch.maximum(-lo, hi)
        lo = -hi
    empty = (lo == 0) & (hi == 0)
    lo, hi = torch.where(empty, -1.0, lo), torch.where(empty, 1.0, hi)
    scale = (hi - lo) / maxq
    if sym:
        zero = torch.full_like(scale, 2 ** (bits - 1))
    else:
        zero = (-lo / scale).round()
        raise_ = zero < min_zero
        scale = torch.where(raise_, torch.maximum(scale, hi / (maxq - min_zero)), scale)
        zero = zero.clamp(min=min_zero)
    return scale.clamp(min=_FP16_TINY).half().float(), zero


def _quantize_cols(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int) -> torch.Tensor:
    return (w / scale[:, None]).round().add(zero[:, None]).clamp(0, maxq)


def rtn_quantize(w: torch.Tensor, bits: int, group_size: int | None, sym: bool = False,
                 min_zero: int = 0) -> QuantizedWeight:
    """Round-to-nearest on GPTQ's grid (`grid`), no calibration: the baseline GPTQ improves on."""
    out, n_in = w.shape
    g = n_in if group_size in (None, -1) else group_size
    if g < 1 or n_in % g:
        raise ValueError(f"group_size {group_size} does not divide the input dim {n_in}")
    wg = w.detach().float().reshape(out * (n_in // g), g)
    scale, zero = grid(wg, bits, sym, min_zero)
    q = _quantize_cols(wg, scale, zero, 2**bits - 1)
    scale, zero = scale.reshape(out, n_in // g), zero.reshape(out, n_in // g)
    return QuantizedWeight(q.reshape(out, n_in).to(torch.uint8), scale, -zero * scale, bits, g)


def _inverse_cholesky(h: torch.Tensor, percdamp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp I)^-1, raising the dampening if H is not positive definite."""
    damp = percdamp * float(torch.diag(h).mean())
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    for _ in range(6):
        chol, info = torch.linalg.cholesky_ex(h + damp * eye)
        if int(info) == 0:
            return torch.linalg.cholesky(torch.cholesky_inverse(chol), upper=True)
        damp *= 10
    raise ValueError("the GPTQ Hessian is not positive definite even with 10^5 x the dampening")


def _setup(w: torch.Tensor, h: torch.Tensor, act_order: bool,
           percdamp: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(W to update in place, upper Cholesky factor of H^-1, perm): dead input channels
    (diag(H) == 0) get weight 0; act_order sorts the columns by descending diag(H)."""
    w = w.detach().float().clone()
    h = h.detach().float().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    perm = None
    if act_order:
        perm = torch.argsort(torch.diag(h), descending=True)
        w, h = w[:, perm], h[perm][:, perm]
    return w, _inverse_cholesky(h, percdamp), perm


def _error_feedback(w: torch.Tensor, hinv: torch.Tensor, block: int,
                    round_col: Callable[[int, torch.Tensor], torch.Tensor]) -> None:
    """GPTQ's column loop over W [out, in] (updated in place): each column is rounded by
    round_col(col, rest), which returns the column's dequantized values; rest [out, k] holds
    the error-updated column and the rest of its block (a group's grid is taken from it).
    The rounding error is spread over the later columns of the block at once and over the
    columns after the block lazily, in one matmul per block."""
    out, n_in = w.shape
    for i1 in range(0, n_in, block):
        i2 = min(i1 + block, n_in)
        w1, err1, hinv1 = w[:, i1:i2].clone(), torch.zeros(out, i2 - i1, device=w.device), hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            err = (w1[:, i] - round_col(i1 + i, w1[:, i:])) / hinv1[i, i]
            w1[:, i:] -= err[:, None] * hinv1[i, i:][None, :]
            err1[:, i] = err
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]


def _unpermute(t: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    """Columns in stored (act-order) order -> input-channel order."""
    return t if perm is None else torch.empty_like(t).index_copy_(1, perm, t)


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, bits: int, group_size: int | None, sym: bool = False,
                  act_order: bool = False, percdamp: float = 0.01, min_zero: int = 0) -> QuantizedWeight:
    """GPTQ of W [out, in] given H [in, in] (`Hessian.value()`); act_order sets `perm` (stored column order).

    Dead input channels (diag(H) == 0) get weight 0. Blocks hold whole groups, so each group's
    grid is taken from weights that already carry the error of every earlier column. With one
    group per row the stored order does not matter: act-order then only orders the rounding,
    and the result has no perm.
    """
    out, n_in = w.shape
    g = n_in if group_size in (None, -1) else group_size
    if g < 1 or n_in % g:
        raise ValueError(f"group_size {group_size} does not divide the input dim {n_in}")
    maxq = 2**bits - 1
    w, hinv, perm = _setup(w, h, act_order, percdamp)
    q = torch.zeros(out, n_in, dtype=torch.uint8, device=w.device)
    scales = torch.zeros(out, n_in // g, device=w.device)
    zeros = torch.zeros_like(scales)

    def round_col(col: int, rest: torch.Tensor) -> torch.Tensor:
        k = col // g
        if col % g == 0:
            scales[:, k], zeros[:, k] = grid(rest[:, :g], bits, sym, min_zero)
        qc = _quantize_cols(rest[:, :1], scales[:, k], zeros[:, k], maxq)[:, 0]
        q[:, col] = qc.to(torch.uint8)
        return (qc - zeros[:, k]) * scales[:, k]

    _error_feedback(w, hinv, g * max(1, _BLOCK // g), round_col)
    if g == n_in and perm is not None:
        q, perm = _unpermute(q, perm), None
    return QuantizedWeight(q, scales, -zeros * scales, bits, g, perm)


def gptq_fp8(w: torch.Tensor, h: torch.Tensor, act_order: bool = False, percdamp: float = 0.01) -> Fp8Weight:
    """GPTQ's error feedback with float8 e4m3 rounding: per-output-channel scales as `quantize_fp8`
    takes them (absmax of W maps to 448), then each column is rounded to the e4m3 grid and its
    error spread over the columns not yet rounded. On the default model (64 calibration
    sequences) this takes fp8's perplexity increase from +1.24% (round to nearest) to +0.10%;
    act-order gave +0.30% there."""
    scale = fp8_scale(w.detach().float())
    w, hinv, perm = _setup(w, h, act_order, percdamp)
    codes = torch.zeros_like(w)

    def round_col(col: int, rest: torch.Tensor) -> torch.Tensor:
        codes[:, col] = saturate_fp8(rest[:, 0] / scale).float()
        return codes[:, col] * scale

    _error_feedback(w, hinv, _BLOCK, round_col)
    return Fp8Weight(_unpermute(codes, perm).to(torch.float8_e4m3fn), scale)


def gptq_config(bits: int, group_size: int, sym: bool, desc_act: bool, percdamp: float = 0.01,
                algorithm: str = "gptq") -> dict[str, Any]:
    """The HF quantization_config of a checkpoint written by pack_gptq (v1), AutoGPTQ's keys."""
    return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym,
            "static_groups": False, "true_sequential": True, "damp_percent": percdamp, "checkpoint_format": "gptq",
            "meta": {"quantizer": ["kvserve"], "algorithm": algorithm}}



# q/k/v share an input, so do gate/up: one Hessian each. Groups run in order, each on inputs
# computed with the groups before it already quantized (AutoGPTQ's true_sequential).
SEQUENTIAL_GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
                     ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))


@torch.no_grad()
def gptq_layer(layer: torch.nn.Module, inputs: LayerInputs,
               quantize: Callable[[torch.Tensor, torch.Tensor], QuantizedWeight | Fp8Weight]
               ) -> dict[str, QuantizedWeight | Fp8Weight]:
    """GPTQ one decoder layer in place: quantize(W, H) for each linear, e.g. `gptq_quantize` or
    `gptq_fp8` with the format's options bound; returns {'self_attn.q_proj': weight, ...}.

    Each linear is left holding its dequantized quantized weight.
    """
    from kvserve.quant.calib import capture_linear_inputs

    results = {}
    for names in SEQUENTIAL_GROUPS:
        first = layer.get_submodule(names[0])
        hessian = Hessian(first.in_features, first.weight.device)
        capture_linear_inputs(layer, inputs, names[:1], lambda _, x, acc=hessian: acc.add(x))
        h = hessian.value()
        for name in names:
            lin = layer.get_submodule(name)
            qw = quantize(lin.weight, h)
            lin.weight.copy_(qw.dequantize(lin.weight.dtype))
            results[name] = qw
    return results
