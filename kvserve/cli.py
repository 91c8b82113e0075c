"""`kvserve serve | generate | chat | bench | cache | eval | quantize` — flag names mirror `vllm serve`."""

from __future__ import annotations

import argparse
import sys
from typing import Any

EXIT_BAD_INPUT = 2


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="HF directory or GGUF file (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"])
    g.add_argument("--quantization", "-q", default=None, choices=["awq", "gptq", "int8", "fp8", "gguf", "none"],
                   help="weight quantization (default: what the checkpoint says; none: load dequantized)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"],
                   help="fp8: KV stored as float8 e4m3 with per-layer scales (about 2x the tokens)")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=256)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--kv-cache-memory", default=None, help="KV cache size, e.g. 2GiB")
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    g.add_argument("--prefix-cache", default="hash", choices=["hash", "radix"])
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default="cpu")
    t = p.add_argument_group("KV tiers (blocks evicted from the KV cache are kept here and loaded back on a hit)")
    t.add_argument("--kv-offload-cpu", default=None, metavar="SIZE", help="host RAM tier, e.g. 8GiB")
    t.add_argument("--kv-offload-disk", default=None, metavar="PATH", help="local disk tier directory")
    t.add_argument("--kv-offload-disk-size", default="50GiB", metavar="SIZE")
    t.add_argument("--kv-offload-disk-min-hits", type=int, default=0, metavar="N",
                   help="only blocks hit N times in host RAM go down to disk")
    t.add_argument("--kv-remote", default=None, metavar="URL", help="shared store, e.g. redis://127.0.0.1:6379")
    t.add_argument("--kv-remote-min-hits", type=int, default=0, metavar="N")
    t.add_argument("--kv-remote-write-through", action="store_true",
                   help="send every new full block to --kv-remote at once (replicas reuse it sooner)")


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """kvserve.LLM keyword arguments from the flags of add_engine_args."""
    return {"model": args.model, "dtype": args.dtype, "max_model_len": args.max_model_len,
            "kv_cache_memory": args.kv_cache_memory, "num_kv_blocks": args.num_kv_blocks,
            "block_size": args.block_size, "enable_prefix_caching": args.enable_prefix_caching,
            "prefix_cache": args.prefix_cache, "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens, "seed": args.seed, "device": args.device,
            "kv_offload_cpu": args.kv_offload_cpu, "kv_offload_disk": args.kv_offload_disk,
            "kv_offload_disk_size": args.kv_offload_disk_size, "kv_remote": args.kv_remote,
            "kv_offload_disk_min_hits": args.kv_offload_disk_min_hits, "kv_remote_min_hits": args.kv_remote_min_hits,
            "kv_remote_write_through": args.kv_remote_write_through, "quantization": args.quantization,
            "kv_cache_dtype": args.kv_cache_dtype}


def engine_from_args(args: argparse.Namespace):
    from kvserve import LLM

    return LLM(**engine_kwargs(args))


def sampling_from_args(args: argparse.Namespace):
    from kvserve import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, min_tokens=args.min_tokens, temperature=args.temperature,
        top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
        seed=args.sampling_seed, stop=args.stop, ignore_eos=args.ignore_eos)


def cmd_generate(args: argparse.Namespace) -> int:
    params = sampling_from_args(args)
    llm = engine_from_args(args)
    prompt = args.prompt
    if args.chat:
        prompt = llm.apply_chat_template([{"role": "user", "content": args.prompt}])
    if args.stream:
        for piece in llm.stream(prompt, params):
            print(piece, end="", flush=True)
        print()
        return 0
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    print(out.outputs[0].text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    params = sampling_from_args(args)
    llm = engine_from_args(args)
    history: list[dict[str, str]] = []
    if args.system:
        history.append({"role": "system", "content": args.system})
    print("kvserve chat — empty line or Ctrl-D to quit", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        if not line.strip():
            return 0
        history.append({"role": "user", "content": line})
        reply = []
        for piece in llm.stream(llm.apply_chat_template(history), params):
            reply.append(piece)
            print(piece, end="", flush=True)
        print()
        history.append({"role": "assistant", "content": "".join(reply)})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="LLM inference engine built around the KV cache")
    sub = parser.add_subparsers(dest="command", required=True)

    from kvserve.server.launch import add_server_args, cmd_serve

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_server_args(s)
    s.set_defaults(func=cmd_serve)

    g = sub.add_parser("generate", help="generate a completion for one prompt")
    add_engine_args(g)
    add_sampling_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive multi-turn chat")
    add_engine_args(c)
    add_sampling_args(c)
    c.add_argument("--system", default=None, help="system prompt")
    c.set_defaults(func=cmd_chat)

    from kvserve.bench.throughput import add_bench_parser
    from kvserve.eval.cli import add_eval_parser
    from kvserve.kv_tiers.cli import add_cache_parser
    from kvserve.quant.quantize import add_quantize_parser

    add_bench_parser(sub)
    add_cache_parser(sub)
    add_eval_parser(sub)
    add_quantize_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"kvserve: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
