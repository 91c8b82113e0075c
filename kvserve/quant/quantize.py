"""`kvserve quantize MODEL --method awq|gptq|int8|fp8|rtn --out DIR`: write a quantized HF checkpoint.

The output directory holds config.json (the model's config plus quantization_config),
model.safetensors (each decoder linear packed in its method's layout, every other tensor in
float16, or in bfloat16 when the source stores that), the tokenizer files (a GGUF source
becomes self-contained) and the source's generation_config.json if it has one. kvserve,
transformers and vLLM detect the method from quantization_config.

  awq   AutoAWQ GEMM, 4-bit, activation-aware scales + clipping (calibrated)
  gptq  AutoGPTQ layout (checkpoint_format gptq), 4/8-bit, GPTQ (calibrated), --sym, --act-order
  rtn   round-to-nearest in the GPTQ layout, no calibration: the baseline the others improve on
  int8 / fp8  kvserve's per-output-channel int8 / float8 e4m3 layouts, rounded by GPTQ's error
        feedback on calibration inputs (--act-order only orders the rounding: no g_idx); --calib none
        rounds to nearest, as -q int8 / fp8 do at load
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from kvserve.config_sections import QUANTIZE_METHODS
from kvserve.quant.base import LINEAR_SUFFIXES, Fp8Weight, QuantizedWeight, quantize_fp8, quantize_rtn

_CALIBRATED = ("awq", "gptq")  # always calibrated; int8 / fp8 are unless --calib none
_GROUPED = ("awq", "gptq", "rtn")


@dataclass(frozen=True)
class QuantizeOptions:
    """Validated `kvserve quantize` flags; group_size -1 means one group per output channel."""

    method: str
    bits: int
    group_size: int
    sym: bool = False
    act_order: bool = False
    calib: str = "sharegpt"  # or a text file; "none": int8 / fp8 round to nearest
    calib_samples: int = 128
    calib_seq_len: int = 512
    percdamp: float = 0.01

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> QuantizeOptions:
        """ValueError naming the flag for an unknown method, bits that the method cannot store, a bad
        group size, or a flag the method does not use."""
        method = args.method
        if method not in QUANTIZE_METHODS:
            raise ValueError(f"--method must be one of {', '.join(QUANTIZE_METHODS)}, got {method!r}")
        bits = args.bits if args.bits is not None else (8 if method == "int8" else 4)
        if method == "awq" and bits != 4:
            raise ValueError(f"--bits {bits}: AWQ is 4-bit only")
        if method == "int8" and bits != 8:
            raise ValueError(f"--bits {bits}: int8 is 8-bit")
        if method == "fp8" and args.bits is not None:
            raise ValueError("--bits does not apply to --method fp8 (float8 e4m3)")
        if bits not in (4, 8):
            raise ValueError(f"--bits must be 4 or 8, got {bits}")
        if args.group_size < 1 and not (args.group_size == -1 and method in ("gptq", "rtn")):
            raise ValueError(f"--group-size must be a positive integer (or -1 for gptq / rtn), got {args.group_size}")
        if args.sym and method not in ("gptq", "rtn"):
            raise ValueError(f"--sym applies to --method gptq and rtn, not {method} "
                             "(awq and int8 store zero points; fp8 has none)")
        if args.act_order and method not in ("gptq", "int8", "fp8"):
            raise ValueError(f"--act-order applies to --method gptq, int8 and fp8 (GPTQ rounding), not {method}")
        calib = args.calib or "sharegpt"
        if args.calib is not None and method == "rtn":
            raise ValueError("--calib does not apply to --method rtn (round to nearest, no calibration)")
        if calib == "none" and method in _CALIBRATED:
            raise ValueError(f"--calib none: --method {method} needs calibration (sharegpt or a text file)")
        if calib == "none" and args.act_order:
            raise ValueError("--act-order orders GPTQ's rounding, which --calib none turns off")
        if method != "rtn" and calib != "none":
            from kvserve.quant.calib import check_calibration

            check_calibration(calib, args.calib_samples, args.calib_seq_len)
        return cls(method, bits, args.group_size, args.sym, args.act_order, calib, args.calib_samples,
                   args.calib_seq_len)

    @property
    def calibrated(self) -> bool:
        return self.method != "rtn" and self.calib != "none"


def cmd_quantize(args: argparse.Namespace) -> int:
    from kvserve.quant.calib import load_source

    opts = QuantizeOptions.from_args(args)
    out = Path(args.out).expanduser()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"--out {str(out)!r} exists and is not an empty directory")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    src = load_source(args.model, device)
    check_shapes(src.model, opts)
    weights = quantize_model(src, opts)
    write_checkpoint(src, weights, opts, out)
    size = (out / "model.safetensors").stat().st_size
    print(f"wrote {opts.method} ({_describe(opts)}) checkpoint to {out} (model.safetensors: {size / 2**20:.1f} MiB)")
    return 0


def _describe(opts: QuantizeOptions) -> str:
    rounding = "GPTQ rounding" if opts.calibrated else "round to nearest"
    if opts.method == "fp8":
        return f"float8 e4m3, per-channel scales, {rounding}"
    if opts.method == "int8":
        return f"int8, per-channel scales and zero points, {rounding}"
    parts = [f"{opts.bits}-bit", f"group size {opts.group_size}", "sym" if opts.sym else "asym"]
    return ", ".join(parts + (["act-order"] if opts.act_order else []))


def decoder_linears(model: torch.nn.Module) -> dict[str, torch.nn.Linear]:
    """{'model.layers.0.self_attn.q_proj': module, ...} for every quantized decoder linear."""
    return {name: m for name, m in model.named_modules() if name.startswith("model.layers.")
            and name.endswith(LINEAR_SUFFIXES)}


def check_shapes(model: torch.nn.Module, opts: QuantizeOptions) -> None:
    """Before any work: the group size divides every linear's input dim and the layout can pack its dims."""
    per = 32 // opts.bits
    linears = decoder_linears(model)
    for name, lin in linears.items():
        n_out, n_in = lin.weight.shape
        if opts.method in _GROUPED and opts.group_size != -1 and n_in % opts.group_size:
            fits = [g for g in (256, 128, 64, 32, 16) if all(m.in_features % g == 0 for m in linears.values())]
            hint = f"; --group-size {fits[0]} divides all of them" if fits else ""
            raise ValueError(f"--group-size {opts.group_size} does not divide the input dim {n_in} of {name}{hint}")
        if opts.method == "awq" and n_out % 8:
            raise ValueError(f"{name}: output dim {n_out} is not a multiple of 8 (AWQ packs 8 outputs per int32)")
        if opts.method in ("gptq", "rtn") and (n_in % per or n_out % per):
            raise ValueError(f"{name}: dims {n_out} x {n_in} are not multiples of {per} "
                             f"(GPTQ packs {per} {opts.bits}-bit values per int32)")


def quantize_model(src: Any, opts: QuantizeOptions) -> dict[str, QuantizedWeight | Fp8Weight]:
    """Quantize every decoder linear of src.model; {'model.layers.0.self_attn.q_proj': weight, ...}.

    awq also rescales norms / linears of src.model in place (folded into the float tensors written).
    """
    from kvserve.quant.gptq import rtn_quantize

    model = src.model
    g = opts.group_size
    # v1 GPTQ checkpoints store zero - 1: keep asymmetric zero points >= 1 (symmetric ones are 2**(bits-1)).
    min_zero = 0 if opts.sym else 1
    if opts.calibrated:
        return _calibrated(src, opts, min_zero)
    results: dict[str, QuantizedWeight | Fp8Weight] = {}
    for name, lin in tqdm(decoder_linears(model).items(), desc=opts.method, unit="linear"):
        w = lin.weight.detach()
        if opts.method == "rtn":
            results[name] = rtn_quantize(w, opts.bits, g, opts.sym, min_zero)
        elif opts.method == "int8":
            results[name] = quantize_rtn(w, 8, None)
        else:
            results[name] = quantize_fp8(w)
    return results


def _calibrated(src: Any, opts: QuantizeOptions, min_zero: int) -> dict[str, QuantizedWeight | Fp8Weight]:
    from kvserve.quant.awq import awq_layer
    from kvserve.quant.calib import calibration_sequences, quantize_layers
    from kvserve.quant.gptq import gptq_fp8, gptq_layer, gptq_quantize

    sequences = calibration_sequences(src.tokenizer, opts.calib, opts.calib_samples, opts.calib_seq_len)
    results: dict[str, QuantizedWeight | Fp8Weight] = {}

    def rounding(w: torch.Tensor, h: torch.Tensor) -> QuantizedWeight | Fp8Weight:
        if opts.method == "fp8":
            return gptq_fp8(w, h, opts.act_order, opts.percdamp)
        if opts.method == "int8":  # one group per channel: act-order orders the rounding, no g_idx
            return gptq_quantize(w, h, 8, None, sym=False, act_order=opts.act_order, percdamp=opts.percdamp)
        return gptq_quantize(w, h, opts.bits, opts.group_size, opts.sym, opts.act_order, opts.percdamp, min_zero)

    def quantize_layer(i: int, layer: torch.nn.Module, inputs: Any) -> None:
        if opts.method == "awq":
            done = awq_layer(layer, inputs, opts.group_size, opts.bits)
        else:
            done = gptq_layer(layer, inputs, rounding)
        results.update({f"model.layers.{i}.{name}": qw for name, qw in done.items()})

    quantize_layers(src.model, sequences, quantize_layer, desc=f"{opts.method} ({len(sequences)} sequences)")
    return results


def quant_config_for(opts: QuantizeOptions) -> dict[str, Any]:
    from kvserve.quant.awq import awq_config
    from kvserve.quant.gptq import gptq_config

    if opts.method == "awq":
        return awq_config(opts.group_size)
    if opts.method in ("gptq", "rtn"):
        return gptq_config(opts.bits, opts.group_size, opts.sym, opts.act_order, opts.percdamp, opts.method)
    from kvserve.quant.methods import quant_config

    return quant_config(opts.method)


def pack(weight: QuantizedWeight | Fp8Weight, method: str) -> dict[str, torch.Tensor]:
    """One linear's checkpoint tensors (suffix -> tensor) in the method's layout."""
    if method == "awq":
        from kvserve.quant.awq import pack_awq

        return pack_awq(weight)
    if method in ("gptq", "rtn"):
        from kvserve.quant.gptq import pack_gptq

        return pack_gptq(weight, "gptq")
    from kvserve.quant.methods import pack_fp8, pack_int8

    return pack_int8(weight) if method == "int8" else pack_fp8(weight)


def write_checkpoint(src: Any, weights: dict[str, QuantizedWeight | Fp8Weight], opts: QuantizeOptions,
                     out: Path) -> None:
    """config.json, model.safetensors, tokenizer files and generation_config.json into `out`."""
    from safetensors.torch import save_file

    float_dtype = src.dtype if src.dtype in (torch.float16, torch.bfloat16) else torch.float16
    config = src.model.config
    cfg = config.to_dict()
    cfg["quantization_config"] = quant_config_for(opts)
    cfg["dtype" if "dtype" in cfg else "torch_dtype"] = str(float_dtype).removeprefix("torch.")
    tensors: dict[str, torch.Tensor] = {}
    for name, t in src.model.state_dict().items():
        prefix, _, suffix = name.rpartition(".")
        if suffix == "weight" and prefix in weights:
            continue
        if name == "lm_head.weight" and getattr(config, "tie_word_embeddings", False):
            continue
        tensors[name] = t.detach().to("cpu", float_dtype).contiguous()
    for prefix, weight in weights.items():
        for suffix, t in pack(weight, opts.method).items():
            tensors[f"{prefix}.{suffix}"] = t.detach().cpu().contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    src.tokenizer.save_pretrained(str(out))
    if src.generation_config is not None:
        shutil.copyfile(src.generation_config, out / "generation_config.json")
