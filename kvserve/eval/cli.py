"""`kvserve eval ppl | agree`: perplexity and quantized-vs-reference agreement.

    kvserve eval ppl [MODEL] [-q Q] [--dataset sharegpt|FILE] [--max-tokens N] [--window W] [--stride S]
    kvserve eval agree [MODEL] -q Q [--reference-quantization none] [--num-prompts N] [--max-tokens M]

MODEL is an HF directory or a GGUF file; omitted, the embedded SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvserve import eval as defaults
from kvserve.config_sections import KV_CACHE_DTYPES
from kvserve.config_sections import QUANTIZATION_METHODS as METHODS

_QUANT_CHOICES = [*METHODS, "none"]


def _model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="HF directory or GGUF file (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--output-json", default=None, metavar="PATH", help="also write the numbers to this JSON file")


def add_eval_parser(subparsers: Any) -> None:
    """Add `eval` with its `ppl` and `agree` subcommands to a parser's subparsers."""
    ev = subparsers.add_parser("eval", help="model quality: perplexity, agreement with a reference")
    sub = ev.add_subparsers(dest="eval_command", required=True)

    p = sub.add_parser("ppl", help="sliding-window perplexity (HF's fixed-length-model recipe)")
    _model_args(p)
    p.add_argument("--quantization", "-q", default=None, choices=_QUANT_CHOICES,
                   help="weight quantization (default: what the checkpoint says; none: load dequantized)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    p.add_argument("--dataset", default="sharegpt",
                   help="'sharegpt' (all turns joined, in file order) or a UTF-8 text file")
    p.add_argument("--max-tokens", type=int, default=defaults.PPL_MAX_TOKENS, help="cut the tokenized text here")
    p.add_argument("--window", type=int, default=defaults.PPL_WINDOW, help="tokens per model call")
    p.add_argument("--stride", type=int, default=defaults.PPL_STRIDE,
                   help="tokens between window starts (<= --window; each token is scored once)")
    p.set_defaults(func=cmd_ppl)

    a = sub.add_parser("agree", help="greedy-token agreement and KL(ref || quant) against a reference model")
    _model_args(a)
    a.add_argument("--quantization", "-q", required=True, choices=_QUANT_CHOICES,
                   help="quantization of the model under test")
    a.add_argument("--reference-quantization", default="none", choices=_QUANT_CHOICES,
                   help="quantization of the reference (default none: unquantized / dequantized)")
    a.add_argument("--reference-model", default=None, help="reference checkpoint (default: MODEL)")
    a.add_argument("--dataset", default="sharegpt", help="'sharegpt' or a JSON file in ShareGPT format")
    a.add_argument("--num-prompts", type=int, default=defaults.AGREE_NUM_PROMPTS)
    a.add_argument("--max-tokens", type=int, default=defaults.AGREE_MAX_TOKENS,
                   help="greedy tokens the reference generates per prompt")
    a.add_argument("--max-prompt-len", type=int, default=defaults.AGREE_MAX_PROMPT_LEN,
                   help="longest ShareGPT prompt kept, in tokens")
    a.add_argument("--seed", type=int, default=0, help="prompt selection")
    a.set_defaults(func=cmd_agree)


def _emit(rows: list[tuple[str, str]], result: Any, output_json: str | None) -> None:
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    if output_json:
        Path(output_json).write_text(json.dumps(asdict(result), indent=2) + "\n")


def cmd_ppl(args: argparse.Namespace) -> int:
    from kvserve.eval import ppl

    r = ppl.run_ppl(args.model, args.dataset, args.max_tokens, args.window, args.stride, args.quantization,
                    args.dtype, args.kv_cache_dtype, args.device)
    _emit([("model", r.model), ("quantization", r.quantization), ("weight memory", f"{r.weight_bytes / 1e6:.1f} MB"),
           ("dtype", r.dtype),
           ("kv cache dtype", r.kv_cache_dtype), ("dataset", r.dataset),
           ("window / stride", f"{r.window} / {r.stride}"), ("windows", str(r.num_windows)),
           ("tokens", str(r.num_tokens)), ("tokens scored", str(r.tokens_scored)),
           ("mean NLL", f"{r.mean_nll:.4f}"), ("perplexity", f"{r.ppl:.4f}"), ("time (s)", f"{r.elapsed_s:.2f}")],
          r, args.output_json)
    return 0


def cmd_agree(args: argparse.Namespace) -> int:
    from kvserve.eval import agree

    r = agree.run_agree(args.model, args.quantization, args.reference_quantization, args.reference_model,
                        args.num_prompts, args.max_tokens, args.max_prompt_len, args.dtype, args.device, args.seed,
                        args.dataset)
    _emit([("model", f"{r.model} (quantization {r.quantization})"),
           ("reference", f"{r.reference_model} (quantization {r.reference_quantization})"), ("dtype", r.dtype),
           ("prompts", str(r.num_prompts)), ("positions", str(r.positions)),
           ("greedy agreement", f"{r.agreement:.4f}"), ("mean KL(ref||quant)", f"{r.mean_kl:.6f}"),
           ("max KL", f"{r.max_kl:.6f}"), ("NLL ref / quant", f"{r.reference_nll:.4f} / {r.quantized_nll:.4f}"),
           ("time (s)", f"{r.elapsed_s:.2f}")], r, args.output_json)
    return 0
