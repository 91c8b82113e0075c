"""The `kvserve quantize` flags (the work is kvserve.quant.quantize).

Outside kvserve.quant, whose package imports torch, so that building `kvserve`'s parser for
another command (`kvserve serve`) does not pay torch's import before its engine starts.
"""

from __future__ import annotations

import argparse
from typing import Any

from kvserve.config_sections import QUANTIZE_METHODS


def add_quantize_parser(subparsers: Any) -> None:
    p = subparsers.add_parser("quantize", help="quantize a model's linear weights into an HF checkpoint directory")
    p.add_argument("model", nargs="?", default=None,
                   help="HF directory or GGUF file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--method", required=True, help=f"one of {', '.join(QUANTIZE_METHODS)}")
    p.add_argument("--bits", type=int, default=None, help="4 or 8 (default: 4; int8: 8; awq: 4 only)")
    p.add_argument("--group-size", type=int, default=128,
                   help="input channels per scale (awq / gptq / rtn; -1: one per output channel)")
    p.add_argument("--sym", action="store_true", help="gptq / rtn: symmetric (zero point 2**(bits-1))")
    p.add_argument("--act-order", action="store_true",
                   help="gptq / int8 / fp8: round input channels by descending activation energy "
                        "(gptq stores the order as desc_act / g_idx)")
    p.add_argument("--calib", default=None,
                   help="calibration text: 'sharegpt' (default) or a text FILE; int8 / fp8 also take 'none' "
                        "(round to nearest)")
    p.add_argument("--calib-samples", type=int, default=128, help="calibration sequences")
    p.add_argument("--calib-seq-len", type=int, default=512, help="tokens per calibration sequence (at most)")
    p.add_argument("--device", default=None, help="where to run calibration (default: cuda if available, else cpu)")
    p.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    p.set_defaults(func=_cmd_quantize)



def _cmd_quantize(args: argparse.Namespace) -> int:
    from kvserve.quant.quantize import cmd_quantize

    return cmd_quantize(args)
