"""`kvserve bench throughput`: offline throughput of kvserve or HF transformers on one request set.

Model loading and dataset tokenization are outside the timed region; both backends are
fed the same prompt token ids and produce exactly each request's output length.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvserve.bench.datasets import DEFAULT_RANDOM_LEN, BenchRequest, load_sharegpt, random_requests
from kvserve.bench.serve import add_serve_bench_parser
from kvserve.bench.table import cpu_model, render_table
from kvserve.config import EngineConfig
from kvserve.engine_args import add_engine_args

WARMUP_TOKENS = 4
WARMUP_REQUESTS = 4


@dataclass
class BenchResult:
    backend: str
    dataset: str
    model: str
    dtype: str
    hardware: str
    cpu_cores: int | None
    torch_threads: int
    command: str
    num_requests: int
    total_prompt_tokens: int
    total_output_tokens: int  # useful output: each request's own output length
    elapsed_s: float
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    warmup: bool = True
    hf_batch_size: int | None = None
    computed_output_tokens: int | None = None  # HF static batches: incl. tokens past a request's own end
    note: str = ""


def add_bench_parser(subparsers: Any) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    p = bench_sub.add_parser("throughput", help="offline throughput: kvserve vs HF transformers")
    p.add_argument("--backend", default="kvserve", choices=["kvserve", "hf"])
    p.add_argument("--dataset", default="sharegpt", choices=["sharegpt", "random"])
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--input-len", type=int, default=None,
                   help=f"random: prompt tokens per request (default {DEFAULT_RANDOM_LEN})")
    p.add_argument("--output-len", type=int, default=None,
                   help=f"output tokens per request (random default {DEFAULT_RANDOM_LEN}; "
                        "sharegpt default: the reference completion's length)")
    p.add_argument("--max-prompt-len", type=int, default=512, help="sharegpt: longest prompt kept")
    p.add_argument("--max-output-len", type=int, default=256, help="sharegpt: longest completion kept")
    p.add_argument("--hf-batch-size", type=int, default=1,
                   help="hf: requests per static batch (dataset order, left-padded)")
    p.add_argument("--hf-gguf-packed", action="store_true",
                   help="hf: keep GGUF weights packed (transformers' quantized kernels) instead of "
                        "unpacking them to --dtype like kvserve does")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="run one untimed small batch first (one-time kernel set-up is not throughput)")
    p.add_argument("--output-json", default=None, help="also write the numbers to this JSON file")
    p.add_argument("--json-schema", default=None, metavar="FILE",
                   help="kvserve: constrain every request's output to this JSON schema (structured outputs); a "
                        "request ends when its JSON is complete (as in vLLM) or at its output length")
    add_engine_args(p)
    p.set_defaults(func=cmd_throughput)
    add_serve_bench_parser(bench_sub)


def cmd_throughput(args: argparse.Namespace) -> int:
    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be at least 1, got {args.num_prompts}")
    for flag in ("hf_batch_size", "input_len", "output_len"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, got {value}")
    if args.json_schema and args.backend != "kvserve":
        raise ValueError("--json-schema constrains kvserve's outputs; --backend hf has no constraint")
    if args.backend == "kvserve":
        result = _run_kvserve(args)
    else:
        result = _run_hf(args)
    print(format_table(result))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(asdict(result), indent=2) + "\n")
    return 0


def build_requests(args: argparse.Namespace, tokenizer: Any) -> list[BenchRequest]:
    if args.dataset == "random":
        input_len = DEFAULT_RANDOM_LEN if args.input_len is None else args.input_len
        output_len = DEFAULT_RANDOM_LEN if args.output_len is None else args.output_len
        return random_requests(tokenizer, args.num_prompts, input_len, output_len, seed=args.seed)
    reqs = load_sharegpt(tokenizer, args.num_prompts, args.max_prompt_len, args.max_output_len, seed=args.seed)
    if args.output_len is not None:
        for r in reqs:
            r.output_len = args.output_len
    return reqs


def _warmup_requests(reqs: list[BenchRequest], n: int) -> list[BenchRequest]:
    """Up to n requests shaped like the first ones, prompts reversed so no prefix is cached for the timed run."""
    return [BenchRequest(r.prompt, r.prompt_len, WARMUP_TOKENS, list(reversed(r.prompt_token_ids or [])))
            for r in reqs[:max(1, min(n, WARMUP_REQUESTS))]]


# ---- kvserve ----------------------------------------------------------------


def _run_kvserve(args: argparse.Namespace) -> BenchResult:
    from kvserve import LLM, SamplingParams

    llm = LLM(config=EngineConfig.from_cli_args(args))
    reqs = build_requests(args, llm.get_tokenizer())
    prompts = [r.prompt_token_ids for r in reqs]
    constraint = None
    if args.json_schema:
        from kvserve import StructuredOutputsParams

        constraint = StructuredOutputsParams(json=json.loads(Path(args.json_schema).read_text()))
    params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0,
                             structured_outputs=constraint) for r in reqs]
    if args.warmup:
        warm = [r.prompt_token_ids for r in _warmup_requests(reqs, args.max_num_seqs)]
        llm.generate(warm, SamplingParams(max_tokens=WARMUP_TOKENS, ignore_eos=True, temperature=0.0),
                     use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    produced = [len(o.outputs[0].token_ids) for o in outputs]
    expected = [r.output_len for r in reqs]
    note = ""
    if produced != expected:
        bad = sum(p != e for p, e in zip(produced, expected))
        note = f"WARNING: {bad} requests produced a different output length than asked"
    engine = llm.engine
    stats = engine.stats() if hasattr(engine, "stats") else {}
    if stats.get("num_preemptions"):
        note = "; ".join(filter(None, [note, f"{stats['num_preemptions']} preemptions (KV cache full)"]))
    model = str(getattr(engine, "model_path", None) or args.model or "default")
    dtype = _dtype_name(getattr(engine, "dtype", None) or args.dtype)
    return _result("kvserve", args, model, dtype, reqs, sum(produced), elapsed, note=note)


# ---- HF transformers --------------------------------------------------------


def _hf_model_source(model: str | None) -> tuple[str, str | None]:
    """(directory, gguf file name or None) for from_pretrained."""
    if model is None:
        from kvserve.models.loader import default_model_path

        model = default_model_path()
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model path {model!r} is a file but not a .gguf file")
        return str(path.parent.resolve()), path.name
    if not path.is_dir():
        raise ValueError(f"model path {model!r} does not exist")
    if (path / "config.json").exists():
        return str(path.resolve()), None
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) != 1:
        raise ValueError(f"model directory {model!r} has no config.json and "
                         f"{'no' if not ggufs else 'several'} .gguf files; pass one file")
    return str(path.resolve()), ggufs[0].name


def _load_hf(args: argparse.Namespace) -> tuple[Any, Any, str, Any]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from kvserve.models.loader import resolve_dtype

    directory, gguf_file = _hf_model_source(args.model)
    kw = {"gguf_file": gguf_file} if gguf_file else {}
    # 'auto' resolves on the model's own shapes, as kvserve's does for dense linears (HF runs a GGUF
    # dequantized; kvserve keeps its linears in the float32 kernels and takes float32 for them)
    dtype = resolve_dtype(args.dtype, args.device, AutoConfig.from_pretrained(directory, **kw))
    tokenizer = AutoTokenizer.from_pretrained(directory, **kw)
    model_kw = dict(kw)
    if gguf_file and not args.hf_gguf_packed:
        model_kw.update(_dense_gguf_config())
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **model_kw).to(args.device).eval()
    torch.manual_seed(args.seed)
    name = str(Path(directory) / gguf_file) if gguf_file else directory
    return model, tokenizer, name, dtype


def _dense_gguf_config() -> dict[str, Any]:
    """Ask transformers to unpack GGUF weights into dense `dtype` tensors at load, as kvserve does.

    transformers >= 5 otherwise keeps quantized blocks and computes each matmul through a
    float32 kernel (two orders of magnitude slower on CPU); older versions always unpack.
    """
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def _run_hf(args: argparse.Namespace) -> BenchResult:
    import torch

    model, tokenizer, name, dtype = _load_hf(args)
    reqs = build_requests(args, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad_id is None:
        pad_id = 0
    bs = args.hf_batch_size
    computed = 0
    if args.warmup:
        with torch.inference_mode():
            _hf_generate_batch(model, _warmup_requests(reqs, bs), pad_id, args.device)
    start = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(reqs), bs):
            computed += _hf_generate_batch(model, reqs[i:i + bs], pad_id, args.device)
    elapsed = time.perf_counter() - start
    useful = sum(r.output_len for r in reqs)
    weights = "GGUF blocks kept packed" if args.hf_gguf_packed else f"dense {_dtype_name(dtype)}"
    note = f"hf weights: {weights}"
    if bs > 1:
        note += (f"; static batches of {bs} in dataset order: a batch runs until its longest request is done; "
                f"output tokens count only each request's own length ({computed} were computed)")
    return _result("hf", args, name, _dtype_name(dtype), reqs, useful, elapsed,
                   hf_batch_size=bs, computed=computed, note=note)


def _hf_generate_batch(model: Any, batch: list[BenchRequest], pad_id: int, device: str) -> int:
    """Greedy-generate one left-padded batch to its longest output length; returns tokens computed."""
    import torch

    width = max(r.prompt_len for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, r in enumerate(batch):
        ids[row, width - r.prompt_len:] = torch.tensor(r.prompt_token_ids, dtype=torch.long)
        mask[row, width - r.prompt_len:] = 1
    new = max(r.output_len for r in batch)
    # min_new_tokens = max_new_tokens: EOS is masked, so every row runs the full length.
    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
                         min_new_tokens=new, do_sample=False, pad_token_id=pad_id)
    generated = out.shape[1] - width
    if generated != new:
        raise RuntimeError(f"HF generate produced {generated} tokens for a batch asked for {new}")
    return generated * len(batch)


# ---- reporting --------------------------------------------------------------


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _hardware(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(torch.device(device))} (host CPU: {cpu_model()})"
    return cpu_model()


def _result(backend: str, args: argparse.Namespace, model: str, dtype: str, reqs: list[BenchRequest],
            output_tokens: int, elapsed: float, hf_batch_size: int | None = None,
            computed: int | None = None, note: str = "") -> BenchResult:
    import torch

    prompt_tokens = sum(r.prompt_len for r in reqs)
    elapsed = max(elapsed, 1e-9)
    return BenchResult(
        backend=backend, dataset=args.dataset, model=model, dtype=dtype, hardware=_hardware(args.device),
        cpu_cores=os.cpu_count(), torch_threads=torch.get_num_threads(), command=" ".join(sys.argv),
        num_requests=len(reqs), total_prompt_tokens=prompt_tokens, total_output_tokens=output_tokens,
        elapsed_s=elapsed, requests_per_s=len(reqs) / elapsed, output_tokens_per_s=output_tokens / elapsed,
        total_tokens_per_s=(prompt_tokens + output_tokens) / elapsed, warmup=args.warmup,
        hf_batch_size=hf_batch_size,
        computed_output_tokens=computed, note=note)


def _hf_mode(batch_size: int | None) -> str:
    if batch_size is None:
        return ""
    return " (one request at a time)" if batch_size == 1 else f" (static batches of {batch_size})"


def format_table(r: BenchResult) -> str:
    rows = [
        ("hardware", r.hardware),
        ("cpu cores / torch threads", f"{r.cpu_cores} / {r.torch_threads}"),
        ("model", r.model),
        ("dtype", r.dtype),
        ("backend", r.backend + _hf_mode(r.hf_batch_size)),
        ("dataset", r.dataset),
        ("command", r.command),
        ("requests", str(r.num_requests)),
        ("total prompt tokens", str(r.total_prompt_tokens)),
        ("total output tokens", str(r.total_output_tokens)),
        ("elapsed (s)", f"{r.elapsed_s:.2f}" + (" (after an untimed warm-up batch)" if r.warmup else "")),
        ("requests/s", f"{r.requests_per_s:.3f}"),
        ("output tokens/s", f"{r.output_tokens_per_s:.1f}"),
        ("total tokens/s", f"{r.total_tokens_per_s:.1f}"),
    ]
    if r.computed_output_tokens is not None and r.computed_output_tokens != r.total_output_tokens:
        rows.append(("computed output tokens", str(r.computed_output_tokens)))
    return render_table(rows, [f"note: {r.note}"] if r.note else [])
