"""Weight quantization applied to a plain model while it loads.

`hf_plan` / `gguf_plan` decide from --quantization and the checkpoint how the decoder
linears load; `LinearInstaller` puts placeholders in for them before the model's memory
is allocated, takes their tensors out of the checkpoint stream, converts each linear
with its method, fuses q/k/v and gate/up the way the model does, and swaps in a kernel
module (quant/linear.py). Models never see any of this.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kvserve.layers.linear import ParallelLinear
from kvserve.quant.base import (Fp8Weight, QuantizedWeight, QuantMethod, cat_rows, check_method, linear_prefix,
                                quantize_rtn)
from kvserve.quant.gguf import GGUFMethod, KQuantWeight, settle_parts
from kvserve.quant.linear import Fp8Linear, Int4Linear, Int8Linear, StackedLinear, quantized_linear
from kvserve.quant.methods import load_time_method, method_from_config, pack_fp8, pack_int8, quant_config

logger = logging.getLogger(__name__)

# What quantization=None means for a GGUF file: its quantized linears stay compressed, as
# llama.cpp and vLLM run them ("none" dequantizes them into --dtype).
GGUF_DEFAULT = "gguf"
FLOAT32_KERNEL_METHODS = frozenset({"gguf", "awq", "gptq", "int4", "int8"})

__all__ = ["GGUF_DEFAULT", "Fp8Linear", "Int4Linear", "Int8Linear", "LinearInstaller", "LoadPlan", "StackedLinear",
           "gguf_plan", "hf_plan", "pack_fp8", "pack_int8", "quant_config", "quantize_lm_head", "quantized_linear"]


@dataclass(frozen=True)
class LoadPlan:
    method: QuantMethod  # reads the checkpoint's decoder linears
    dequantize: bool = False  # True: build plain nn.Linear in --dtype instead of kernels

    @property
    def float32_kernels(self) -> bool:
        """Whether the linears run compressed in kernels whose CPU activations are float32 whatever
        --dtype is (integer codes: qmatmul blocks, K-quant rows; fp8 is a dense matmul in --dtype)."""
        return not self.dequantize and self.method.name in FLOAT32_KERNEL_METHODS


def _quantize_hint(name: str) -> str:
    return (f"--quantization {name} needs a checkpoint quantized with {name}; make one with "
            f"`kvserve quantize MODEL --method {name} --out DIR` and load DIR")


def hf_plan(quantization: str | None, hf_config: Any) -> LoadPlan | None:
    """How to load an HF directory's linears; None: plain float weights (nothing to do)."""
    check_method(quantization)
    qc = getattr(hf_config, "quantization_config", None)
    if qc is not None and not isinstance(qc, dict):
        qc = qc.to_dict()
    found = qc.get("quant_method") if qc else None
    if quantization == "gguf":
        raise ValueError("--quantization gguf needs a GGUF file, but the model is an HF directory")
    if quantization is None:
        return LoadPlan(method_from_config(qc)) if qc else None
    if quantization == "none":
        return LoadPlan(method_from_config(qc), dequantize=True) if qc else None
    if qc is None:
        if quantization in ("awq", "gptq"):
            raise ValueError(_quantize_hint(quantization))
        return LoadPlan(load_time_method(quantization))
    if found != quantization:
        raise ValueError(f"--quantization {quantization} contradicts the checkpoint's quantization_config "
                         f"(quant_method {found!r})")
    return LoadPlan(method_from_config(qc))


def gguf_plan(quantization: str | None) -> LoadPlan | None:
    """How to load a GGUF file's linears; None: dequantize every tensor into --dtype."""
    check_method(quantization)
    name = GGUF_DEFAULT if quantization is None else quantization
    if name == "none":
        return None
    if name == "gguf":
        return LoadPlan(GGUFMethod())
    if name in ("awq", "gptq"):
        raise ValueError(_quantize_hint(name))
    return LoadPlan(load_time_method(name))  # int8 / fp8: dequantize, then quantize at load


def quantize_lm_head(net: nn.Module, method: str, dtype: torch.dtype, device: torch.device | str) -> bool:
    """Round the LM head's table as `method` (int4: groups of 32; int8: per channel) rounds the
    decoder linears at load, and run it through that kernel. The head is read in full every decode
    step (on a 135M model, a quarter of the float weights): a draft model that should cost a
    fraction of its target (spec_decode's self_quantized) cannot keep it in float. Embedding
    lookups keep the float table. False where it does not apply (already compressed, tensor
    parallel, no head on this stage)."""
    head = getattr(net, "lm_head", None)
    if head is None or head.kernel is not None or head.weight is None or head.tp.size != 1:
        return False
    w = head.weight.detach()
    qw = quantize_rtn(w, 4, 32) if method == "int4" else quantize_rtn(w, 8, None)
    head.set_kernel(quantized_linear(qw, None, dtype, device))
    return True


class _PendingLinear(nn.Module):
    """Holds a decoder linear's kernel place until its quantized tensors arrive (no tensors of its
    own: the bias stays the linear's, so moving the model never splits it in two)."""

    def __init__(self, linear: ParallelLinear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("this linear's weights were never loaded")


def _harmonize(parts: list[QuantizedWeight]) -> list[QuantizedWeight]:
    """Bring fused parts to one layout exactly: 4-bit codes are valid 8-bit codes, and a group
    splits into smaller ones by repeating its scale and offset."""
    bits = max(p.bits for p in parts)
    group = math.gcd(*(p.group_size for p in parts))
    out = []
    for p in parts:
        f = p.group_size // group
        out.append(QuantizedWeight(p.q, p.scale.repeat_interleave(f, 1), p.offset.repeat_interleave(f, 1), bits,
                                   group, p.perm) if (p.bits, p.group_size) != (bits, group) else p)
    return out


class LinearInstaller:
    """Swaps a model's decoder linears for kernels as their checkpoint tensors stream by.

    Create it on the meta-device model, before its memory is allocated: it gives each
    ParallelLinear the checkpoint's decoder linears map to (fused qkv_proj / gate_up_proj
    included) a placeholder kernel and drops its float weight, so no full-precision weight
    is ever allocated. Each checkpoint part is cut to this rank's shard by its linear.
    Then pass the checkpoint stream through `filter` into model.load_weights (which sees
    the biases and every other tensor) and call `finish` to check nothing is missing.
    """

    def __init__(self, model: nn.Module, plan: LoadPlan, dtype: torch.dtype, device: str | torch.device) -> None:
        self.model, self.plan, self.dtype, self.device = model, plan, dtype, torch.device(device)
        self.suffixes = tuple(plan.method.tensor_suffixes())
        self._rows: dict[str, tuple[str, int | None]] = {}  # HF prefix -> (our module, part of it)
        self._needed: dict[str, list[str]] = {}  # our module -> HF prefixes still to come
        self._parts: dict[str, dict[str, Any]] = {}  # our module -> HF prefix -> converted part
        self._groups: dict[str, dict[str, torch.Tensor]] = {}  # HF prefix -> suffix -> tensor
        self.num_float = 0
        for hf in sorted(model.hf_weight_names()):
            prefix = linear_prefix(hf)
            if prefix is None or not hf.endswith(".weight"):
                continue
            target, shard_id = model._map_name(hf)
            if target is None:  # another pipeline stage's
                continue
            module = target.rpartition(".")[0]
            linear = model.get_submodule(module)
            if not isinstance(linear, ParallelLinear):
                raise ValueError(  # noqa: TRY004 - a model the loader cannot handle, not a caller's type error
                    f"{module} is a {type(linear).__name__}, not a ParallelLinear; cannot quantize it")
            self._rows[prefix] = (module, shard_id)
            self._needed.setdefault(module, []).append(prefix)
        for module in self._needed:
            linear = model.get_submodule(module)
            linear.set_kernel(_PendingLinear(linear))

    def _linear(self, prefix: str) -> tuple[ParallelLinear, slice]:
        """The linear checkpoint linear `prefix` is part of, and the rows of it the part fills."""
        module, shard_id = self._rows[prefix]
        linear = self.model.get_submodule(module)
        return linear, linear.part_rows(shard_id)

    def filter(self, weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Consume the decoder linears' tensors (biases excepted); yield every other tensor."""
        for name, tensor in weights:
            prefix = linear_prefix(name)
            suffix = name[len(prefix) + 1:] if prefix else ""
            if prefix not in self._rows or suffix == "bias":
                yield name, tensor
            elif suffix in self.suffixes:
                group = self._groups.setdefault(prefix, {})
                if suffix in group:
                    raise ValueError(f"checkpoint tensor {name!r} appears twice")
                group[suffix] = tensor
                if len(group) == len(self.suffixes):
                    self._add(prefix, self.plan.method.convert(prefix, self._groups.pop(prefix)))
            elif suffix == "weight":  # a float linear inside a quantized checkpoint
                self._add(prefix, tensor)
            else:
                raise ValueError(f"unexpected checkpoint tensor {name!r}: a {self.plan.method.name} linear has "
                                 f"tensors {', '.join(self.suffixes)} (and an optional bias)")

    def _add(self, prefix: str, part: QuantizedWeight | Fp8Weight | torch.Tensor) -> None:
        module, shard_id = self._rows[prefix]
        linear, rows = self._linear(prefix)
        pending = linear.kernel
        if not isinstance(pending, _PendingLinear) or prefix not in self._needed[module]:
            raise ValueError(f"checkpoint holds the weights of linear {prefix!r} twice")
        try:
            part = linear.shard(part, shard_id)
        except ValueError as e:
            raise ValueError(f"linear {prefix!r}: {e}") from None
        want = (rows.stop - rows.start, linear.in_features)
        if tuple(part.shape) != want:
            raise ValueError(f"linear {prefix!r} has shape {tuple(part.shape)} in the checkpoint, expected {want}")
        self._needed[module].remove(prefix)
        self._parts.setdefault(module, {})[prefix] = part
        if not self._needed[module]:
            by_row = self._parts.pop(module)
            ordered = [by_row[p] for p in sorted(by_row, key=lambda p: self._linear(p)[1].start)]
            self._install(linear, ordered)

    def _install(self, linear: ParallelLinear, parts: list[Any]) -> None:
        """A kernel from the quantized parts; float (or dequantized) parts become the linear's weight again."""
        parts = settle_parts(parts)
        kinds = {type(p) for p in parts}
        if kinds == {KQuantWeight} and not self.plan.dequantize:  # raw GGUF K-quant rows, read in place
            return linear.set_kernel(quantized_linear(parts, linear.kernel_bias, self.dtype, self.device))
        if kinds == {QuantizedWeight} and not self.plan.dequantize:
            return linear.set_kernel(quantized_linear(cat_rows(_harmonize(parts)), linear.kernel_bias, self.dtype,
                                                      self.device))
        if kinds == {QuantizedWeight, KQuantWeight} and not self.plan.dequantize:  # each run of parts its kernel
            runs = [list(run) for _, run in itertools.groupby(parts, type)]
            kernels = [quantized_linear(cat_rows(_harmonize(r)) if isinstance(r[0], QuantizedWeight) else r, None,
                                        self.dtype, self.device) for r in runs]
            return linear.set_kernel(StackedLinear(kernels, linear.kernel_bias, self.dtype, self.device))
        if kinds == {Fp8Weight} and not self.plan.dequantize:
            fused = Fp8Weight(torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]))
            return linear.set_kernel(quantized_linear(fused, linear.kernel_bias, self.dtype, self.device))
        if not self.plan.dequantize:
            self.num_float += 1
        w = torch.cat([p.float() if isinstance(p, torch.Tensor) else p.dequantize(torch.float32) for p in parts])
        linear.set_weight(w.to(device=self.device, dtype=self.dtype))

    def finish(self) -> None:
        """ValueError naming a tensor if a linear's tensors are incomplete or missing."""
        optional = set(self.plan.method.optional_suffixes())
        for prefix, group in list(self._groups.items()):
            missing = [s for s in self.suffixes if s not in group]
            if set(missing) <= optional:
                self._add(prefix, self.plan.method.convert(prefix, self._groups.pop(prefix)))
                continue
            raise ValueError(f"checkpoint tensor {prefix}.{missing[0]} is missing "
                             f"(the {self.plan.method.name} linear {prefix!r} has only {', '.join(sorted(group))})")
        missing = sorted(p for prefixes in self._needed.values() for p in prefixes)
        if missing:
            raise ValueError(f"missing weight tensor {missing[0]}.{self.suffixes[0]}"
                             + (f" (and {len(missing) - 1} more linears)" if len(missing) > 1 else ""))
        if self.num_float:
            logger.info("%d decoder linears kept in %s: the checkpoint stores them unquantized or in mixed formats",
                        self.num_float, self.dtype)
