"""Quantization methods by name, and kvserve's own int8 / fp8 checkpoint layouts.

int8 checkpoint (quantization_config {"quant_method": "int8", "bits": 8, "group_size": -1,
"sym": false}): per linear `<prefix>.weight` int8 [out, in] (signed codes),
`<prefix>.weight_scale` float32 [out] and `<prefix>.weight_zero_point` int8 [out];
W = (weight - weight_zero_point[:, None]) * weight_scale[:, None]. With "sym": true there is
no zero point. Asymmetric is what kvserve writes and quantizes at load: on the default model
per-channel sym int8 costs +0.54% perplexity, asym +0.08% (its rows are skewed).
fp8 checkpoint ({"quant_method": "fp8", "activation_scheme": "dynamic"}): `<prefix>.weight`
float8_e4m3fn [out, in] and `<prefix>.weight_scale` float32 [out] (a scalar or [out, 1]
scale from other writers is accepted).
Without a quantization_config, int8 / fp8 quantize each float `<prefix>.weight` at load.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from kvserve.quant.base import Fp8Weight, QuantizedWeight, QuantMethod, quantize_fp8, quantize_rtn

# Methods written in their own modules, imported only when used.
_LAZY = {"awq": ("kvserve.quant.awq", "AWQMethod"), "gptq": ("kvserve.quant.gptq", "GPTQMethod")}
CHECKPOINT_METHODS = ("awq", "gptq", "int8", "fp8")  # quant_method values a quantization_config may hold


def _tensor(prefix: str, tensors: dict[str, torch.Tensor], suffix: str, dtypes: tuple[torch.dtype, ...],
            ndim: int | None = None) -> torch.Tensor:
    t = tensors[suffix]
    if t.dtype not in dtypes:
        raise ValueError(f"tensor {prefix}.{suffix} has dtype {t.dtype}, expected {' or '.join(map(str, dtypes))}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"tensor {prefix}.{suffix} has shape {tuple(t.shape)}, expected {ndim} dimensions")
    return t


def _channel_scale(prefix: str, scale: torch.Tensor, out: int) -> torch.Tensor:
    """weight_scale as float32 [out]; a scalar / [1] / [out, 1] scale is broadcast."""
    if scale.numel() not in (1, out) or (scale.dim() == 2 and scale.shape[1] != 1) or scale.dim() > 2:
        raise ValueError(f"tensor {prefix}.weight_scale has shape {tuple(scale.shape)}, expected ({out},)")
    return scale.float().reshape(-1).expand(out).contiguous()


class Int4Method(QuantMethod):
    """4-bit codes in groups of 32 with a scale and an integer zero point per group, rounded to
    nearest while a float checkpoint loads (llama.cpp's Q4_1 layout, read in place by the blocks
    kernels). No calibration: AWQ and GPTQ checkpoints keep more accuracy at the same size."""

    name = "int4"
    GROUP_SIZE = 32

    def tensor_suffixes(self) -> tuple[str, ...]:
        return ("weight",)

    def convert(self, prefix: str, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
        w = _tensor(prefix, tensors, "weight", (torch.float32, torch.bfloat16, torch.float16), 2)
        if w.shape[1] % self.GROUP_SIZE:
            raise ValueError(f"int4 at load: {prefix}.weight's input dim {w.shape[1]} is not a multiple of "
                             f"{self.GROUP_SIZE}")
        return quantize_rtn(w, 4, self.GROUP_SIZE, symmetric=False)


class Int8Method(QuantMethod):
    """Per-channel int8 with zero points: read from kvserve's layout, or quantized at load (RTN)."""

    name = "int8"

    def __init__(self, prequantized: bool, sym: bool = False) -> None:
        self.prequantized, self.sym = prequantized, sym

    @classmethod
    def from_config(cls, quant_config: dict[str, Any]) -> Int8Method:
        expected = {"bits": 8, "group_size": -1}
        for key, value in expected.items():
            if quant_config.get(key, value) != value:
                raise ValueError(f"int8 quantization_config field {key!r} is {quant_config[key]!r}; "
                                 f"only {value!r} is supported")
        sym = quant_config.get("sym", True)
        if not isinstance(sym, bool):
            raise ValueError(f"int8 quantization_config field 'sym' must be true or false, got {sym!r}")
        return cls(prequantized=True, sym=sym)

    def tensor_suffixes(self) -> tuple[str, ...]:
        return ("weight", "weight_scale", "weight_zero_point") if self.prequantized else ("weight",)

    def optional_suffixes(self) -> tuple[str, ...]:
        return ("weight_zero_point",) if self.sym else ()

    def convert(self, prefix: str, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
        if not self.prequantized:
            return quantize_rtn(_tensor(prefix, tensors, "weight", (torch.float32, torch.bfloat16, torch.float16), 2),
                                8, None, symmetric=False)
        w = _tensor(prefix, tensors, "weight", (torch.int8,), 2)
        scale = _channel_scale(prefix, tensors["weight_scale"], w.shape[0])[:, None]
        zero = torch.zeros_like(scale)
        if "weight_zero_point" in tensors:
            z = _tensor(prefix, tensors, "weight_zero_point", (torch.int8,))
            if z.numel() != w.shape[0]:
                raise ValueError(f"tensor {prefix}.weight_zero_point has shape {tuple(z.shape)}, "
                                 f"expected ({w.shape[0]},)")
            zero = z.reshape(-1, 1).float()
        return QuantizedWeight((w.to(torch.int16) + 128).to(torch.uint8), scale, -(zero + 128) * scale, 8, w.shape[1])


class Fp8Method(QuantMethod):
    """float8 e4m3 weights with per-channel scales: read, or quantized at load."""

    name = "fp8"

    def __init__(self, prequantized: bool) -> None:
        self.prequantized = prequantized

    @classmethod
    def from_config(cls, quant_config: dict[str, Any]) -> Fp8Method:
        scheme = quant_config.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ValueError(f"fp8 quantization_config field 'activation_scheme' is {scheme!r}; "
                             "only 'dynamic' is supported")
        if quant_config.get("weight_block_size") is not None:
            raise ValueError("fp8 quantization_config field 'weight_block_size' is set; "
                             "only per-channel scales are supported")
        return cls(prequantized=True)

    def tensor_suffixes(self) -> tuple[str, ...]:
        return ("weight", "weight_scale") if self.prequantized else ("weight",)

    def convert(self, prefix: str, tensors: dict[str, torch.Tensor]) -> Fp8Weight:
        if not self.prequantized:
            return quantize_fp8(_tensor(prefix, tensors, "weight", (torch.float32, torch.bfloat16, torch.float16), 2))
        w = _tensor(prefix, tensors, "weight", (torch.float8_e4m3fn,), 2)
        return Fp8Weight(w, _channel_scale(prefix, tensors["weight_scale"], w.shape[0]))


def method_from_config(quant_config: dict[str, Any]) -> QuantMethod:
    """The method reading a checkpoint with this quantization_config."""
    name = quant_config.get("quant_method")
    if name == "int8":
        return Int8Method.from_config(quant_config)
    if name == "fp8":
        return Fp8Method.from_config(quant_config)
    if name in _LAZY:
        module, cls = _LAZY[name]
        try:
            return getattr(importlib.import_module(module), cls).from_config(quant_config)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"quant_method {name!r} is not available in this build ({module}.{cls}): {e}") from e
    raise ValueError(f"quantization_config has unsupported quant_method {name!r}; "
                     f"supported: {', '.join(CHECKPOINT_METHODS)}")


def load_time_method(name: str) -> QuantMethod:
    """int4 / int8 / fp8 applied to a float checkpoint's linears as they load."""
    if name == "int4":
        return Int4Method()
    if name == "int8":
        return Int8Method(prequantized=False)
    if name == "fp8":
        return Fp8Method(prequantized=False)
    raise ValueError(f"{name} cannot quantize at load; only int4, int8 and fp8 can")


def quant_config(method: str) -> dict[str, Any]:
    """config.json's quantization_config for a checkpoint written with pack_int8 / pack_fp8."""
    if method == "int8":
        return {"quant_method": "int8", "bits": 8, "group_size": -1, "sym": False}
    if method == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic"}
    raise ValueError(f"quant_config: method must be 'int8' or 'fp8', got {method!r}")


def pack_int8(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """A per-channel 8-bit weight with integer zero points (quantize_rtn(w, 8, None)) ->
    {'weight': int8 [out, in], 'weight_scale': float32 [out], 'weight_zero_point': int8 [out]}
    (signed: code - 128, zero point - 128); prefix the keys with the linear's name."""
    n_in = qw.shape[1]
    zero = -qw.offset[:, 0] / qw.scale[:, 0]
    integral = bool(torch.all((zero - zero.round()).abs() < 1e-3) and torch.all((zero >= 0) & (zero <= 255)))
    if qw.bits != 8 or qw.group_size != n_in or qw.perm is not None or not integral:
        raise ValueError("pack_int8 needs an 8-bit weight with one group per output channel, integer zero points "
                         f"and no perm; got bits={qw.bits}, group_size={qw.group_size} of {n_in}, "
                         f"perm={qw.perm is not None}, integer zero points={integral}")
    return {"weight": (qw.q.to(torch.int16) - 128).to(torch.int8).contiguous(),
            "weight_scale": qw.scale[:, 0].float().contiguous(),
            "weight_zero_point": (zero.round().to(torch.int16) - 128).to(torch.int8).contiguous()}


def pack_fp8(fw: Fp8Weight) -> dict[str, torch.Tensor]:
    """-> {'weight': float8_e4m3fn [out, in], 'weight_scale': float32 [out]}; prefix the keys with the linear's name."""
    if fw.weight.dtype != torch.float8_e4m3fn or tuple(fw.scale.shape) != (fw.shape[0],):
        raise ValueError(f"pack_fp8 needs a float8_e4m3fn weight with a [out] scale; got {fw.weight.dtype}, "
                         f"scale shape {tuple(fw.scale.shape)}")
    return {"weight": fw.weight.contiguous(), "weight_scale": fw.scale.float().contiguous()}
