"""The one representation every quantized linear weight passes through.

Each checkpoint layout (AWQ, GPTQ, GGUF blocks, kvserve's own int8/fp8) is converted
to a `QuantizedWeight` by its method, and each kernel (quant/linear.py) is built from
one; the quantizers (AWQ, GPTQ, round-to-nearest) produce one and the layout writers
pack it. Models never see any of this: their nn.Linear modules are swapped for
quantized ones after they are built (`install` in quant/linear.py).

Integer weights: W[o, i] = q[o, i] * scale[o, g] + offset[o, g], where q is unsigned
(0 .. 2**bits - 1) and g = i // group_size counts the *stored* columns. When the
checkpoint quantized its input channels in another order (GPTQ act-order, `g_idx`),
the columns are stored sorted by group and `perm[j]` is the input channel held in
stored column j: y = x[..., perm] @ W_stored.T. The offset form covers every layout
exactly: asymmetric AWQ/GPTQ (offset = -zero * scale), symmetric (offset =
-2**(bits-1) * scale), GGUF Q4_1 (offset = min) and Q4_0 / Q8_0 (offset = -8 d, -128 d).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kvserve.attention.backend import FP8_MAX, saturate_fp8
from kvserve.config_sections import QUANTIZATION_METHODS as METHODS  # listed once, where --quantization is checked


@dataclass
class QuantizedWeight:
    """A linear weight [out, in] as unsigned integers with per-group scale and offset (float32)."""

    q: torch.Tensor  # [out, in] integer dtype (uint8/int32), values in [0, 2**bits)
    scale: torch.Tensor  # [out, in // group_size] float32
    offset: torch.Tensor  # [out, in // group_size] float32
    bits: int  # 4 or 8
    group_size: int  # columns per group; == in for one group per output channel
    perm: torch.Tensor | None = None  # [in] int64: stored column j holds input channel perm[j]

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"bits must be 4 or 8, got {self.bits}")
        out, n_in = self.q.shape
        if self.group_size < 1 or n_in % self.group_size:
            raise ValueError(f"group_size {self.group_size} does not divide the input dim {n_in}")
        groups = (out, n_in // self.group_size)
        for name in ("scale", "offset"):
            if tuple(getattr(self, name).shape) != groups:
                raise ValueError(f"{name} has shape {tuple(getattr(self, name).shape)}, expected {groups}")
        if self.perm is not None and tuple(self.perm.shape) != (n_in,):
            raise ValueError(f"perm has shape {tuple(self.perm.shape)}, expected ({n_in},)")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)  # type: ignore[return-value]

    @property
    def symmetric(self) -> bool:
        """offset == -2**(bits-1) * scale everywhere: q - 2**(bits-1) is a signed code."""
        return bool(torch.equal(self.offset, -(2 ** (self.bits - 1)) * self.scale))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """W [out, in] in input-channel order (perm undone)."""
        out, n_in = self.q.shape
        g = self.group_size
        w = (self.q.reshape(out, n_in // g, g).float() * self.scale[..., None] + self.offset[..., None])
        w = w.reshape(out, n_in)
        if self.perm is not None:
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w.to(dtype)

    def rows(self, sl: slice) -> QuantizedWeight:
        return QuantizedWeight(self.q[sl], self.scale[sl], self.offset[sl], self.bits, self.group_size, self.perm)

    def cols(self, sl: slice) -> QuantizedWeight:
        """Input channels sl (a row-parallel shard); its bounds must fall on group bounds."""
        g = self.group_size
        if g == self.q.shape[1] and self.perm is None:  # one group per output channel: scales hold for any columns
            return QuantizedWeight(self.q[:, sl], self.scale, self.offset, self.bits, sl.stop - sl.start)
        if sl.start % g or sl.stop % g:
            raise ValueError(f"a shard of input channels [{sl.start}, {sl.stop}) splits quantization groups of "
                             f"{g}; choose a tensor_parallel_size that keeps groups whole")
        if self.perm is not None:
            raise ValueError("act-order (g_idx) weights cannot be split by input channel; "
                             "tensor_parallel_size > 1 needs a checkpoint quantized without act-order")
        gs = slice(sl.start // g, sl.stop // g)
        return QuantizedWeight(self.q[:, sl], self.scale[:, gs], self.offset[:, gs], self.bits, g)


def cat_rows(parts: list[QuantizedWeight]) -> QuantizedWeight:
    """Stack weights along the output dim (fused q/k/v, gate/up); they must agree on layout."""
    first = parts[0]
    for p in parts[1:]:
        if (p.bits, p.group_size, p.shape[1]) != (first.bits, first.group_size, first.shape[1]):
            raise ValueError("cannot fuse quantized weights with different bits, group size or input dim")
        if (p.perm is None) != (first.perm is None) or (p.perm is not None and not torch.equal(p.perm, first.perm)):
            raise ValueError("cannot fuse quantized weights with different input orders (g_idx)")
    return QuantizedWeight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),
                           torch.cat([p.offset for p in parts]), first.bits, first.group_size, first.perm)


def check_method(name: str | None) -> str | None:
    if name is None or name == "none":
        return name
    if name not in METHODS:
        raise ValueError(f"quantization must be one of {', '.join(METHODS)} (or none), got {name!r}")
    return name


@dataclass
class Fp8Weight:
    """A linear weight [out, in] as float8 e4m3 with one float32 scale per output channel."""

    weight: torch.Tensor  # [out, in] torch.float8_e4m3fn
    scale: torch.Tensor  # [out] float32; W = weight.float() * scale[:, None]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.weight.shape)  # type: ignore[return-value]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.weight.float() * self.scale[:, None]).to(dtype)

    def rows(self, sl: slice) -> Fp8Weight:
        return Fp8Weight(self.weight[sl], self.scale[sl])

    def cols(self, sl: slice) -> Fp8Weight:
        return Fp8Weight(self.weight[:, sl], self.scale)


# The decoder linears a method quantizes, by HF name (lm_head and embeddings stay in --dtype).
LINEAR_SUFFIXES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def linear_prefix(hf_name: str) -> str | None:
    """'model.layers.3.mlp.up_proj.qweight' -> 'model.layers.3.mlp.up_proj'; None if not a decoder linear."""
    prefix, _, _ = hf_name.rpartition(".")
    return prefix if prefix.startswith("model.layers.") and prefix.endswith(LINEAR_SUFFIXES) else None


class QuantMethod(ABC):
    """One quantization format: which checkpoint tensors make up a quantized linear, and how
    they become a QuantizedWeight / Fp8Weight.

    The loader (quant/linear.py) groups the checkpoint's tensors by `linear_prefix`,
    passes each decoder linear's complete set of tensors (suffix -> tensor: 'qweight',
    'scales', ... or just 'weight' for a float checkpoint quantized at load) to
    `convert`, fuses the results the way the model fuses q/k/v and gate/up, and swaps in
    a kernel module. 'bias' is never part of the set: it loads as a plain parameter.
    """

    name: str

    @abstractmethod
    def tensor_suffixes(self) -> tuple[str, ...]:
        """Suffixes that together make up one quantized linear in the checkpoint."""

    def optional_suffixes(self) -> tuple[str, ...]:
        """Those of tensor_suffixes() a checkpoint may leave out; convert() then gets the rest."""
        return ()

    @abstractmethod
    def convert(self, prefix: str, tensors: dict[str, torch.Tensor]) -> QuantizedWeight | Fp8Weight:
        """One linear's tensors -> its quantized weight; ValueError naming `prefix` if malformed."""


def quantize_rtn(w: torch.Tensor, bits: int, group_size: int | None = None, symmetric: bool = False,
                 clip: torch.Tensor | None = None) -> QuantizedWeight:
    """Round-to-nearest W [out, in] -> QuantizedWeight with integer zero points.

    group_size None: one group per output channel. Asymmetric: per group, scale =
    (max - min) / (2**bits - 1) and an integer zero point (the AWQ / GPTQ convention).
    Symmetric: scale = absmax / (2**(bits-1) - 1) and zero point 2**(bits-1).
    clip [out, in // group_size]: optional per-group bound (AWQ's clipping search);
    the weights are clamped to [-clip, clip] before the range is taken.
    """
    if bits not in (4, 8):
        raise ValueError(f"bits must be 4 or 8, got {bits}")
    out, n_in = w.shape
    g = n_in if group_size in (None, -1) else group_size
    if g < 1 or n_in % g:
        raise ValueError(f"group_size {group_size} does not divide the input dim {n_in}")
    wg = w.detach().float().reshape(out, n_in // g, g)
    if clip is not None:
        wg = torch.maximum(torch.minimum(wg, clip[..., None]), -clip[..., None])
    qmax = 2**bits - 1
    if symmetric:
        half = 2 ** (bits - 1)
        scale = (wg.abs().amax(-1) / (half - 1)).clamp(min=1e-8)
        zero = torch.full_like(scale, half)
    else:
        lo, hi = wg.amin(-1), wg.amax(-1)
        scale = ((hi - lo) / qmax).clamp(min=1e-8)
        zero = (-lo / scale).round().clamp(0, qmax)
    q = (wg / scale[..., None]).round().add(zero[..., None]).clamp(0, qmax)
    return QuantizedWeight(q.reshape(out, n_in).to(torch.uint8), scale, -zero * scale, bits, g)


def fp8_scale(w: torch.Tensor) -> torch.Tensor:
    """Per-output-channel float8 e4m3 scale [out] of W [out, in]: each row's absmax maps to 448."""
    return (w.detach().float().abs().amax(1) / FP8_MAX).clamp(min=1e-12)


def quantize_fp8(w: torch.Tensor) -> Fp8Weight:
    """W [out, in] -> float8 e4m3 by round to nearest with a per-output-channel scale (`fp8_scale`)."""
    w = w.detach().float()
    scale = fp8_scale(w)
    return Fp8Weight(saturate_fp8(w / scale[:, None]), scale)
