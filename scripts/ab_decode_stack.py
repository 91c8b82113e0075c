"""Two or more builds of the C decode stack in one process, alternated reply by reply: an A/B of a
kernel constant or flag that a machine whose speed moves within minutes cannot fool.

    .venv/bin/python scripts/ab_decode_stack.py --model FILE.gguf \\
        --variant=-DIL_AHEAD=4096 --variant="-DLIN_PIECES_PER_THREAD=8 -DKQ_AHEAD=4096" [--replies 16] \\
        [--context 2048]

The engine loads once; its decode stack is built again with each variant's compiler flags (any
`-D` of a constant the C sources guard with #ifndef: IL_AHEAD, PREFETCH_AHEAD, KQ_AHEAD, the
prefetch hints IL_HINT and KQ_HINT, LIN_PIECES_PER_THREAD) and the builds take turns, one greedy
reply each, the order reversed every pass (ABBA); --context N decodes after N tokens of ShareGPT
text (attention's share of a step). A second build of the default flags runs too, as the control: its ratio shows the
noise. Printed per build: the median decode-only tok/s, the median over passes of its reply's rate
over the default build's in the same pass, and whether its tokens equal the default's.
"""

from __future__ import annotations

import argparse
import copy
import statistics

from kvserve import LLM, SamplingParams
from kvserve.kernels import build, cpu
from kvserve.kernels import decode_stack as c_stack

PROMPT = "Tell me a story about a cat."


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a GGUF or model directory (default: the embedded default model)")
    p.add_argument("--variant", action="append", default=[],
                   help="compiler flags of one build, written --variant=-DNAME=VALUE (repeatable)")
    p.add_argument("--replies", type=int, default=16, help="replies per build")
    p.add_argument("--tokens", type=int, default=32, help="tokens per reply")
    p.add_argument("--context", type=int, default=0,
                   help="decode after this many ShareGPT tokens instead of a short prompt (cached after the first reply)")
    args = p.parse_args()
    if args.replies < 1 or args.tokens < 2 or args.context < 0:
        p.error("--replies must be at least 1, --tokens at least 2 and --context at least 0")
    # a long context is computed once: later replies take it from the prefix cache and time the decode only
    cache = args.context > 0
    llm = LLM(model=args.model, enable_prefix_caching=cache) if args.model else LLM(enable_prefix_caching=cache)
    prompt = PROMPT
    if args.context:
        from kvserve.eval.ppl import load_text_tokens

        prompt = {"prompt_token_ids": load_text_tokens(llm.get_tokenizer(), "sharegpt", args.context)[:args.context]}
    runner = llm.engine.executor.worker.runner
    base = runner.decode_stack
    if base is None:
        raise SystemExit("the decode stack does not run this model here (see the log)")
    flags = (*cpu.compile_flags(cpu.isa_level()), "-mtune=native")
    builds = {"default": base}
    for i, v in enumerate(["", *args.variant]):  # "": a second build of the default flags, the control
        lib = build.build(f"decode_stack_ab{i}", "decode_stack.c", (*flags, *v.split(), f"-DAB_BUILD={i}"))
        for fn, sig in c_stack._SIGNATURES.items():
            getattr(lib, fn).restype, getattr(lib, fn).argtypes = None, sig
        c_stack.check_layout(lib)
        stack = copy.copy(base)
        stack.lib = lib
        builds[v or "default (again)"] = stack
    greedy = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    llm.generate([prompt], greedy, use_tqdm=False)  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in builds}
    tokens: dict[str, list[int]] = {}
    for r in range(args.replies):
        for name in (list(builds) if r % 2 == 0 else list(builds)[::-1]):
            runner.decode_stack = builds[name]
            out = llm.generate([prompt], greedy, use_tqdm=False)[0]
            m = out.metrics
            rates[name].append((args.tokens - 1) / (m.last_token_time - m.first_token_time))
            tokens.setdefault(name, out.outputs[0].token_ids)
    runner.decode_stack = base
    print(f"{'build':40s} {'decode-only tok/s':>17s} {'x default':>9s}  tokens")
    for name, v in rates.items():
        ratio = statistics.median(a / b for a, b in zip(v, rates["default"]))
        same = "equal" if tokens[name] == tokens["default"] else "DIFFER"
        print(f"{name:40s} {statistics.median(v):17.2f} {ratio:9.3f}  {same}")


if __name__ == "__main__":
    main()
