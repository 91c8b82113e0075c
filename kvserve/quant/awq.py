"""AWQ: the AutoAWQ "GEMM" checkpoint layout and the activation-aware quantizer.

Layout of one linear (W [out, in], 4 bits, g columns per group):
  qweight int32 [in, out / 8]      q[o, i] of 8 consecutive outputs per int32, interleaved
  qzeros  int32 [in / g, out / 8]  zero points, same packing
  scales  fp16  [in / g, out]
Slot k (bits 4k..4k+3) of an int32 holds output 8c + AWQ_ORDER[k]; W[o, i] = (q - zero) * scale.

The quantizer follows AutoAWQ: per group of linears that share an input, search a per-input-
channel scale s = x_mean^a / w_mean^(1-a) (a on a 20-point grid in [0, 1)) minimizing the
output error of the block with pseudo-quantized weights, fold 1/s into the op before (a norm's
weight or the previous linear's rows), then search a per-group clipping bound, then quantize
asymmetrically with round-to-nearest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from kvserve.quant.base import QuantizedWeight, QuantMethod, quantize_rtn
from kvserve.quant.gptq import integer_zeros, pack_int32, unpack_int32

if TYPE_CHECKING:  # calib reads checkpoints through the model loader, which imports this module
    from kvserve.quant.calib import LayerInputs

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_N_GRID = 20
_MAX_SHRINK = 0.5
_CLIP_TOKENS = 512
_CLIP_ROWS = 64  # output channels per clipping-search batch (bounds its memory)


# --- layout ------------------------------------------------------------------------------------------------------

def pack_awq(qw: QuantizedWeight) -> dict[str, torch.Tensor]:
    """QuantizedWeight (4-bit, integer zero points, no perm) -> {'qweight', 'qzeros', 'scales'} as AutoAWQ writes."""
    if qw.bits != 4:
        raise ValueError(f"the AWQ GEMM layout stores 4-bit weights, got bits={qw.bits}")
    if qw.perm is not None:
        raise ValueError("the AWQ layout has no input-channel permutation (act-order); use GPTQ")
    zeros = integer_zeros(qw, "AWQ")
    if int(zeros.min()) < 0 or int(zeros.max()) > 15:
        raise ValueError("AWQ zero points must lie in 0..15")
    return {"qweight": pack_int32(qw.q.t(), 4, dim=1, order=AWQ_ORDER),
            "qzeros": pack_int32(zeros.t(), 4, dim=1, order=AWQ_ORDER),
            "scales": qw.scale.t().to(torch.float16).contiguous()}


def unpack_awq(tensors: dict[str, torch.Tensor], group_size: int, prefix: str = "linear") -> QuantizedWeight:
    """{'qweight', 'qzeros', 'scales'} -> QuantizedWeight; ValueError naming `prefix` and the tensor."""
    for name in ("qweight", "qzeros", "scales"):
        if name not in tensors:
            raise ValueError(f"{prefix}: missing {prefix}.{name} (an AWQ linear has qweight, qzeros, scales)")
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    if qweight.dim() != 2 or qweight.dtype != torch.int32:
        raise ValueError(f"{prefix}.qweight must be a 2-D int32 tensor, got {qweight.dtype} {tuple(qweight.shape)}")
    n_in, out = qweight.shape[0], qweight.shape[1] * 8
    g = n_in if group_size == -1 else group_size
    if g < 1 or n_in % g:
        raise ValueError(f"{prefix}: group_size {group_size} does not divide the input dim {n_in}")
    if tuple(scales.shape) != (n_in // g, out):
        raise ValueError(f"{prefix}.scales has shape {tuple(scales.shape)}, expected {(n_in // g, out)}")
    if tuple(qzeros.shape) != (n_in // g, out // 8) or qzeros.dtype != torch.int32:
        raise ValueError(f"{prefix}.qzeros has shape {tuple(qzeros.shape)} ({qzeros.dtype}), expected int32 "
                         f"{(n_in // g, out // 8)}")
    q = unpack_int32(qweight, 4, dim=1, order=AWQ_ORDER).t()
    zeros = unpack_int32(qzeros, 4, dim=1, order=AWQ_ORDER).t()
    scale = scales.float().t().contiguous()
    return QuantizedWeight(q.to(torch.uint8).contiguous(), scale, -zeros.float() * scale, 4, g)


def awq_config(group_size: int) -> dict[str, Any]:
    """The HF quantization_config of a checkpoint written by pack_awq (AutoAWQ's keys)."""
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": None}


class AWQMethod(QuantMethod):
    """AutoAWQ GEMM checkpoints (4-bit, zero points)."""

    name = "awq"

    def __init__(self, group_size: int) -> None:
        self.group_size = group_size

    @classmethod
    def from_config(cls, quant_config: dict[str, Any]) -> AWQMethod:
        """Validate an HF `quantization_config` (AutoAWQ's w_bit / q_group_size spellings accepted)."""
        method = quant_config.get("quant_method", "awq")
        if method != "awq":
            raise ValueError(f"quantization_config.quant_method is {method!r}, expected 'awq'")
        bits = quant_config.get("bits", quant_config.get("w_bit", 4))
        if bits != 4:
            raise ValueError(f"quantization_config.bits={bits!r}: AWQ checkpoints are 4-bit")
        group_size = quant_config.get("group_size", quant_config.get("q_group_size", 128))
        if not isinstance(group_size, int) or (group_size < 1 and group_size != -1):
            raise ValueError(f"quantization_config.group_size must be a positive integer or -1, got {group_size!r}")
        version = str(quant_config.get("version", "gemm")).lower()
        if version != "gemm":
            raise ValueError(f"quantization_config.version={version!r}: only AWQ 'gemm' checkpoints are supported "
                             "(gemv, gemv_fast and marlin pack differently)")
        if not quant_config.get("zero_point", True):
            raise ValueError("quantization_config.zero_point=false: AWQ without zero points is a marlin-only "
                             "layout; only the gemm layout (with qzeros) is supported")
        return cls(group_size)

    def tensor_suffixes(self) -> tuple[str, ...]:
        return ("qweight", "qzeros", "scales")

    def convert(self, prefix: str, tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
        extra = sorted(set(tensors) - set(self.tensor_suffixes()))
        if extra:
            raise ValueError(f"{prefix}: unexpected tensors {', '.join(f'{prefix}.{s}' for s in extra)} "
                             "in an AWQ checkpoint")
        return unpack_awq(tensors, self.group_size, prefix=prefix)


# --- quantizer ---------------------------------------------------------------------------------------------------

def pseudo_quantize(w: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """W quantized with round-to-nearest and dequantized again (what the searches score)."""
    return quantize_rtn(w, bits, group_size).dequantize(w.dtype)


Forward = Callable[[list[torch.Tensor]], list[torch.Tensor]]


def _mse(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return sum(float((x - y).float().pow(2).sum()) for x, y in zip(a, b)) / sum(x.numel() for x in a)


@torch.no_grad()
def search_scale(linears: list[nn.Linear], xs: list[torch.Tensor], forward: Forward, bits: int,
                 group_size: int) -> torch.Tensor:
    """The per-input-channel scale s [in] for linears sharing the inputs xs, searched as AutoAWQ does.

    forward(xs) runs the block the linears belong to; its output error with the linears' weights
    replaced by Q(W * s) / s is minimized. The linears' weights are left as they were.
    """
    x_mean = torch.cat([x.reshape(-1, x.shape[-1]) for x in xs]).abs().float().mean(0)
    w = torch.cat([lin.weight for lin in linears]).float()
    wa = w.abs().reshape(-1, group_size)
    w_mean = (wa / (wa.amax(1, keepdim=True) + 1e-6)).reshape(w.shape).mean(0)
    reference = forward(xs)
    originals = [lin.weight.detach().clone() for lin in linears]
    best, best_err = torch.ones_like(x_mean), float("inf")
    for k in range(_N_GRID):
        alpha = k / _N_GRID
        s = (x_mean.pow(alpha) / (w_mean.pow(1 - alpha) + 1e-4)).clamp(min=1e-4)
        s = torch.nan_to_num(s / (s.max() * s.min()).sqrt(), nan=1.0, posinf=1.0, neginf=1.0)
        for lin, w0 in zip(linears, originals):
            lin.weight.copy_(pseudo_quantize(w0.float() * s, bits, group_size) / s)
        err = _mse(forward(xs), reference)
        if err < best_err:
            best, best_err = s, err
    for lin, w0 in zip(linears, originals):
        lin.weight.copy_(w0)
    return best


@torch.no_grad()
def apply_scale(prev: nn.Module, linears: list[nn.Linear], s: torch.Tensor) -> None:
    """W <- W * s on the linears' input channels and 1/s into `prev` (a norm's weight, or the last
    len(s) output rows of a linear): the float function is unchanged."""
    if isinstance(prev, nn.Linear):
        prev.weight[-s.numel():].div_(s[:, None])
        if prev.bias is not None:
            prev.bias[-s.numel():].div_(s)
    else:
        prev.weight.div_(s)
        if getattr(prev, "bias", None) is not None:
            prev.bias.div_(s)
    for lin in linears:
        lin.weight.mul_(s[None, :])


@torch.no_grad()
def search_clip(w: torch.Tensor, x: torch.Tensor, bits: int, group_size: int) -> torch.Tensor:
    """Per-group clipping bound [out, in // group_size] minimizing each group's output error on x [n, in].

    Candidates shrink the group's max |w| by 0, 5, ..., 45 % (AutoAWQ's auto_clip); up to 512
    evenly spaced tokens of x are scored.
    """
    out, n_in = w.shape
    n_groups = n_in // group_size
    x = x.reshape(-1, n_in)
    xg = x[:: max(1, x.shape[0] // _CLIP_TOKENS)].float().reshape(-1, n_groups, group_size)
    bounds = []
    for r0 in range(0, out, _CLIP_ROWS):
        wb = w[r0:r0 + _CLIP_ROWS].float()
        rows = wb.shape[0]
        wg = wb.reshape(rows, n_groups, group_size)
        org_max = wg.abs().amax(-1)
        reference = torch.einsum("tgk,ogk->otg", xg, wg)
        best, best_err = org_max.clone(), torch.full_like(org_max, float("inf"))
        for k in range(int(_MAX_SHRINK * _N_GRID)):
            bound = org_max * (1 - k / _N_GRID)
            clipped = torch.maximum(torch.minimum(wg, bound[..., None]), -bound[..., None])
            qg = pseudo_quantize(clipped.reshape(rows, n_in), bits, group_size).reshape(rows, n_groups, group_size)
            err = (torch.einsum("tgk,ogk->otg", xg, qg) - reference).pow(2).mean(1)
            better = err < best_err
            best, best_err = torch.where(better, bound, best), torch.where(better, err, best_err)
        bounds.append(best)
    return torch.cat(bounds)


# Which captured input each linear sees (q/k/v share one, gate/up share one).
_INPUT_OF = {"self_attn.q_proj": "self_attn.q_proj", "self_attn.k_proj": "self_attn.q_proj",
             "self_attn.v_proj": "self_attn.q_proj", "self_attn.o_proj": "self_attn.o_proj",
             "mlp.gate_proj": "mlp.gate_proj", "mlp.up_proj": "mlp.gate_proj", "mlp.down_proj": "mlp.down_proj"}
_NO_CLIP = ("self_attn.q_proj", "self_attn.k_proj")  # AutoAWQ leaves q/k unclipped (attention scores)


def _scale_groups(layer: nn.Module, inputs: LayerInputs) -> list[tuple[nn.Module, list[nn.Linear], str, Forward]]:
    """(op before, linears, captured input, block forward) for each AWQ scaling group of a Llama-style layer."""
    attn, mlp = layer.self_attn, layer.mlp
    attn_kwargs = inputs.attention_kwargs()

    def run_attn(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [attn(hidden_states=x, **kw)[0] for x, kw in zip(xs, attn_kwargs)]

    def per_seq(module: nn.Module) -> Forward:
        return lambda xs: [module(x) for x in xs]

    groups = [(layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj], "self_attn.q_proj", run_attn)]
    if attn.v_proj.weight.shape == attn.o_proj.weight.shape:  # no GQA: v's rows meet o's columns one to one
        groups.append((attn.v_proj, [attn.o_proj], "self_attn.o_proj", per_seq(attn.o_proj)))
    groups.append((layer.post_attention_layernorm, [mlp.gate_proj, mlp.up_proj], "mlp.gate_proj", per_seq(mlp)))
    groups.append((mlp.up_proj, [mlp.down_proj], "mlp.down_proj", per_seq(mlp.down_proj)))
    return groups


@torch.no_grad()
def awq_layer(layer: nn.Module, inputs: LayerInputs, group_size: int, bits: int = 4) -> dict[str, QuantizedWeight]:
    """AWQ one decoder layer in place; returns {'self_attn.q_proj': QuantizedWeight, ...}.

    Afterwards the layer's norms / linears hold the scaled weights, and each linear holds its
    dequantized quantized weight, so the layer computes what the packed checkpoint will.
    """
    from kvserve.quant.calib import capture_linear_inputs

    feats: dict[str, list[torch.Tensor]] = {name: [] for name in set(_INPUT_OF.values())}
    capture_linear_inputs(layer, inputs, sorted(feats), lambda name, x: feats[name].append(x))
    for prev, linears, key, forward in _scale_groups(layer, inputs):
        s = search_scale(linears, feats[key], forward, bits, group_size)
        apply_scale(prev, linears, s)
        feats[key] = [x / s for x in feats[key]]
    results = {}
    for name, key in _INPUT_OF.items():
        lin = layer.get_submodule(name)
        clip = None
        if name not in _NO_CLIP:
            clip = search_clip(lin.weight, torch.cat([x.reshape(-1, x.shape[-1]) for x in feats[key]]), bits,
                               group_size)
        qw = quantize_rtn(lin.weight, bits, group_size, clip=clip)
        lin.weight.copy_(qw.dequantize(lin.weight.dtype))
        results[name] = qw
    return results
