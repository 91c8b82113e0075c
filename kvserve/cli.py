"""`kvserve serve | router | generate | chat | tokenizer | bench | cache | eval | quantize | env | tune` — flag names
mirror `vllm serve`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import NoReturn

from kvserve.config import EngineConfig
from kvserve.engine_args import EXIT_BAD_INPUT, add_engine_args
from kvserve.fast_exit import exit_process


# What `generate` / `chat` use for a flag not given when the model has no default of its own
# (--generation-config: a model's generation_config.json or GGUF sampling keys come first).
SAMPLING_FALLBACKS = {"max_tokens": 128, "min_tokens": 0, "temperature": 0.0, "top_p": 1.0, "top_k": -1,
                      "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (a flag not given takes the model's default, see --generation-config, "
                             "else the value shown)")
    for name, value in SAMPLING_FALLBACKS.items():
        g.add_argument("--" + name.replace("_", "-"), type=type(value), default=None, help=f"(default {value})")
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def engine_from_args(args: argparse.Namespace):
    from kvserve import LLM

    return LLM(config=EngineConfig.from_cli_args(args))


def sampling_from_args(args: argparse.Namespace, model_defaults: dict | None = None):
    """The flags given, then the model's own defaults (LLM.engine.generation_defaults; not its
    max_tokens), then SAMPLING_FALLBACKS."""
    from kvserve import SamplingParams

    # A model's max_new_tokens is meant for long answers; the CLI keeps its own length unless given.
    model = {k: v for k, v in (model_defaults or {}).items() if k in SAMPLING_FALLBACKS and k != "max_tokens"}
    values = {**SAMPLING_FALLBACKS, **model}
    values.update({k: getattr(args, k) for k in SAMPLING_FALLBACKS if getattr(args, k) is not None})
    return SamplingParams(**values, seed=args.sampling_seed, stop=args.stop, ignore_eos=args.ignore_eos)


def cmd_generate(args: argparse.Namespace) -> int:
    constraint = structured_from_args(args)  # a bad file, schema or regex fails before the model loads
    check_structured(constraint, args.structured_outputs_backend)
    llm = engine_from_args(args)
    params = dataclasses.replace(sampling_from_args(args, llm.engine.generation_defaults),
                                 structured_outputs=constraint)
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


def structured_from_args(args: argparse.Namespace):
    """--json-schema FILE / --regex RE as a StructuredOutputsParams (None without either)."""
    from kvserve.sampling_params import StructuredOutputsParams

    if args.json_schema is not None and args.regex is not None:
        raise SystemExit("kvserve generate: give --json-schema or --regex, not both")
    if args.regex is not None:
        return StructuredOutputsParams(regex=args.regex)
    if args.json_schema is None:
        return None
    try:
        with open(args.json_schema, encoding="utf-8") as f:
            schema = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise SystemExit(f"kvserve generate: --json-schema {args.json_schema}: {e}") from None
    return StructuredOutputsParams(json=schema)


def check_structured(constraint, backend: str) -> None:
    """Refuse an invalid schema or regex (ValueError naming the field) before the model loads."""
    from kvserve.structured.backend import constraint_key
    from kvserve.structured.registry import backend_class

    if constraint is not None:
        backend_class(backend).check(constraint_key(constraint))


def cmd_chat(args: argparse.Namespace) -> int:
    llm = engine_from_args(args)
    params = sampling_from_args(args, llm.engine.generation_defaults)
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


def cmd_env(args: argparse.Namespace) -> int:
    from kvserve import env

    info = env.collect()
    print(json.dumps(info, indent=1) if args.json else env.format(info))
    return 0


def cmd_tokenizer_export(args: argparse.Namespace) -> int:
    """The tokenizer the engine loads for --model (an HF directory's, a GGUF file's embedded one, or
    the default model's) saved as a transformers directory, chat template included, so a client
    (aiperf --tokenizer DIR) counts tokens as the server does without a hub."""
    from pathlib import Path

    from kvserve.models.loader import load_tokenizer

    out = Path(args.dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{str(out)!r} exists and is not an empty directory")
    tokenizer = load_tokenizer(args.model)
    tokenizer.save_pretrained(str(out))
    template = "with its chat template" if getattr(tokenizer, "chat_template", None) else "(no chat template)"
    print(f"kvserve: wrote the tokenizer of {args.model or 'the default model'} {template} to {out}")
    return 0


def cmd_tune(args: argparse.Namespace) -> int:
    """--clear: delete the cached decisions. With a model (or without --clear, the default model):
    start the engine once with every cached decision for it counted as stale, so the dtype and the
    quantized linears are measured again, each logged in one line; `kvserve env` shows the results."""
    import logging
    import os
    import time

    from kvserve.kernels import evidence, tuning

    if args.clear:
        print(f"removed {evidence.clear_cache()} cached tuning decisions from {evidence.tuning_dir()}")
        if args.model is None:
            return 0
    if not tuning.enabled():
        raise ValueError(f"{tuning.TUNING_ENV}=off: nothing is measured")
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log = logging.getLogger(tuning.__name__)
    log.addHandler(handler)
    level = log.level
    log.setLevel(logging.INFO)
    # a time, not a flag: the engine core and the worker both resolve the dtype, and the second
    # should take what the first just measured
    os.environ[evidence.TUNE_BEFORE_ENV] = repr(time.time())
    try:
        engine_from_args(args)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="LLM inference engine built around the KV cache")
    sub = parser.add_subparsers(dest="command", required=True)

    from kvserve.server.launch import add_server_args, cmd_serve

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_server_args(s)
    s.set_defaults(func=cmd_serve)

    from kvserve.router.launch import add_router_args, cmd_router

    r = sub.add_parser("router", help="OpenAI-compatible front over several `kvserve serve` replicas")
    add_router_args(r)
    r.set_defaults(func=cmd_router)

    g = sub.add_parser("generate", help="generate a completion for one prompt")
    add_engine_args(g)
    add_sampling_args(g)
    g.add_argument("--prompt", required=True)
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--stream", action="store_true", help="print tokens as they are generated")
    g.add_argument("--json-schema", metavar="FILE", help="constrain the output to JSON valid under this JSON schema")
    g.add_argument("--regex", metavar="RE", help="constrain the output to text that fully matches this regex")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive multi-turn chat")
    add_engine_args(c)
    add_sampling_args(c)
    c.add_argument("--system", default=None, help="system prompt")
    c.set_defaults(func=cmd_chat)

    e = sub.add_parser("env", help="versions, CPU features, threads, C kernels and caches, for a bug report")
    e.add_argument("--json", action="store_true", help="print the same as JSON")
    e.set_defaults(func=cmd_env)

    t = sub.add_parser("tune", help="measure the dtype and kernel choices for a model again (cached per CPU)")
    t.add_argument("--clear", action="store_true", help="delete every cached decision first (alone: only that)")
    add_engine_args(t)
    t.set_defaults(func=cmd_tune)

    tok = sub.add_parser("tokenizer", help="the served model's tokenizer, for clients that count tokens")
    tok_sub = tok.add_subparsers(dest="tokenizer_command", required=True)
    x = tok_sub.add_parser("export", help="save the tokenizer the engine loads as a transformers directory "
                                          "(AutoTokenizer.from_pretrained(DIR))")
    x.add_argument("dir", metavar="DIR", help="where to write it (created; must be new or empty)")
    x.add_argument("--model", default=None, help="HF model directory or .gguf file (default: the embedded model)")
    x.set_defaults(func=cmd_tokenizer_export)

    from kvserve.bench.throughput import add_bench_parser
    from kvserve.eval.cli import add_eval_parser
    from kvserve.kv_tiers.cli import add_cache_parser
    from kvserve.quantize_args import add_quantize_parser

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


def run() -> NoReturn:
    """The `kvserve` program: main, then exit without the interpreter's teardown (fast_exit)."""
    exit_process(main())


if __name__ == "__main__":
    run()
