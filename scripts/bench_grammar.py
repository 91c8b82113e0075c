"""Grammar backends on this machine: schema compile time and per-step mask time (issue 34).

    .venv/bin/python scripts/bench_grammar.py [--schemas 20] [--backends xgrammar guidance]
    .venv/bin/python scripts/bench_grammar.py --engine [--batch 32]   # the bitmask's cost inside the engine

Compile: 20 distinct ~10-field JSON schemas, each compiled cold (no cache), p50 / p99, for the
default model's vocabulary (SmolLM2, 49,152 tokens) and a synthetic 128k one (the 49k tokens plus
concatenations of pairs of them, as BPE merges make; no hub). Mask: B matchers walk a valid
document of their schema token by token; a step is filling all B rows of the bitmask (what the
engine does per step), timed per step; p50 / mean over every step of every schema, at B = 1 and 32.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import time

from kvserve.structured.backend import ConstraintKey, Vocab
from kvserve.structured.registry import backend_class


def schema_and_doc(i: int) -> tuple[dict, dict]:
    """A ~10-field schema (names differ per i, so no compile is shared) and a document it accepts."""
    f = [f"f{i}_{name}" for name in ("id", "name", "email", "age", "score", "active", "role", "tags", "address",
                                     "note")]
    schema = {"type": "object", "properties": {
        f[0]: {"type": "integer", "minimum": 1, "maximum": 100000},
        f[1]: {"type": "string", "maxLength": 40},
        f[2]: {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.com$"},
        f[3]: {"type": "integer", "minimum": 0, "maximum": 150},
        f[4]: {"type": "number", "minimum": 0, "maximum": 1},
        f[5]: {"type": "boolean"},
        f[6]: {"enum": ["admin", "user", "guest"]},
        f[7]: {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 4},
        f[8]: {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
               "required": ["city", "zip"], "additionalProperties": False},
        f[9]: {"anyOf": [{"type": "string"}, {"type": "null"}]},
    }, "required": f[:9], "additionalProperties": False}
    doc = {f[0]: 4711 + i, f[1]: "Ada Lovelace", f[2]: "ada@example.com", f[3]: 36, f[4]: 0.75, f[5]: True,
           f[6]: "admin", f[7]: ["math", "engines"], f[8]: {"city": "London", "zip": "W1"}, f[9]: None}
    return schema, doc


def vocab_49k() -> tuple[Vocab, object]:
    from kvserve.models.loader import load_tokenizer

    tok = load_tokenizer(None)
    byte_decoder = _byte_decoder()
    specials = set(tok.all_special_ids)
    tokens = []
    for i in range(len(tok)):
        piece = tok.convert_ids_to_tokens(i)
        tokens.append(b"" if i in specials else bytes(byte_decoder[c] for c in piece))
    return Vocab(tokens, [tok.eos_token_id], sorted(specials)), tok


def vocab_128k(base: Vocab, size: int = 128_000) -> Vocab:
    rng = random.Random(0)
    tokens = list(base.token_bytes)
    seen = set(tokens)
    plain = [t for t in tokens if t]
    while len(tokens) < size:
        t = rng.choice(plain) + rng.choice(plain)
        if t not in seen and len(t) <= 16:
            seen.add(t)
            tokens.append(t)
    return Vocab(tokens, base.eos_token_ids, base.special_token_ids)


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte <-> printable character table (byte-level BPE token text back to bytes)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def greedy_tokenize(vocab: Vocab, text: bytes) -> list[int]:
    """Longest match over the vocabulary: a valid (if not BPE's) tokenization of text, as the
    llguidance backend tokenizes forced text for a vocabulary given as bytes."""
    from kvserve.structured.guidance_backend import _RawTokenizer

    return _RawTokenizer(vocab)(text)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def bench(name: str, vocab: Vocab, n_schemas: int, batches: list[int]) -> dict:
    t0 = time.perf_counter()
    backend = backend_class(name).from_vocab(vocab)
    setup = time.perf_counter() - t0
    checks, compiles, steps = [], [], {b: [] for b in batches}
    for i in range(n_schemas):
        schema, doc = schema_and_doc(i)
        key = ConstraintKey("json", json.dumps(schema))
        t0 = time.perf_counter()
        backend.check(key)
        t1 = time.perf_counter()
        compiled = backend.compile(key)
        t2 = time.perf_counter()
        checks.append(t1 - t0)
        compiles.append(t2 - t1)
        ids = greedy_tokenize(vocab, json.dumps(doc, separators=(", ", ": ")).encode()) + vocab.eos_token_ids
        for b in batches:
            matchers = [backend.matcher(compiled) for _ in range(b)]
            mask = backend.allocate_bitmask(b)
            for tok in ids:
                t0 = time.perf_counter()
                for row, m in enumerate(matchers):
                    m.fill_bitmask(mask, row)
                steps[b].append(time.perf_counter() - t0)
                if not (mask[0, tok // 32] >> (tok % 32)) & 1:
                    raise AssertionError(f"{name}: token {tok} of the document is masked")
                for m in matchers:
                    assert m.accept(tok)
            assert all(m.is_terminated() for m in matchers)
    return {"backend": name, "vocab": len(vocab.token_bytes), "setup_s": setup,
            "check_p50_ms": pct(checks, 0.5) * 1e3, "compile_p50_ms": pct(compiles, 0.5) * 1e3,
            "compile_p99_ms": pct(compiles, 0.99) * 1e3,
            **{f"mask_b{b}_p50_ms": pct(steps[b], 0.5) * 1e3 for b in batches},
            **{f"mask_b{b}_mean_ms": statistics.mean(steps[b]) * 1e3 for b in batches},
            **{f"mask_b{b}_p99_ms": pct(steps[b], 0.99) * 1e3 for b in batches}}


def engine_cost(backend: str, batch: int) -> None:
    """`batch` requests with a ~10-field schema decoding together on the default model: the time the
    engine spends filling the step's bitmask (on its thread, before the forward) against the step."""
    from kvserve import LLM, SamplingParams
    from kvserve.sampling_params import StructuredOutputsParams

    llm = LLM(dtype="float32", kv_cache_memory="256MiB", max_num_seqs=batch, structured_outputs_backend=backend)
    tok = llm.get_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Describe user {i} as JSON."}],
                                       add_generation_prompt=True, tokenize=False) for i in range(batch)]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=96,
                             structured_outputs=StructuredOutputsParams(json=schema_and_doc(i % 4)[0]))
              for i in range(batch)]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # compiles 2 of the 4 schemas, warms up
    st = llm.engine.structured
    st.mask_seconds, st.mask_steps, st.mask_rows = 0.0, 0, 0
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    valid = sum(o.outputs[0].finish_reason == "stop" for o in outs)
    print(f"| {backend} | {batch} | {st.mask_steps} | {st.mask_rows / max(st.mask_steps, 1):.1f} | "
          f"{st.mask_seconds / max(st.mask_steps, 1) * 1e3:.3f} | {wall / max(st.mask_steps, 1) * 1e3:.1f} | "
          f"{st.mask_seconds / wall:.2%} | {tokens / wall:.1f} | {valid}/{batch} |", flush=True)
    llm.engine.close()


def cpu() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = set(fields.get("Flags", "").split())
    isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_tile") if f in flags]
    return f"{fields.get('Model name', platform.processor()).strip()}, {fields.get('CPU(s)', '?').strip()} CPUs, {' '.join(isa)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--schemas", type=int, default=20)
    ap.add_argument("--backends", nargs="+", default=["xgrammar", "guidance"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    ap.add_argument("--engine", action="store_true", help="measure the bitmask's cost per engine step instead")
    ap.add_argument("--batch", type=int, default=32)
    args = ap.parse_args()
    if args.engine:
        print(f"# CPU: {cpu()}")
        print("| backend | requests | steps with a mask | rows per step | mask ms / step | step ms | "
              "share of wall | output tok/s | ended by the grammar |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name in args.backends:
            engine_cost(name, args.batch)
        return
    v49, _ = vocab_49k()
    vocabs = {"49k": v49, "128k": vocab_128k(v49)}
    print(f"# CPU: {cpu()}")
    cols = ["backend", "vocab", "setup_s", "check_p50_ms", "compile_p50_ms", "compile_p99_ms",
            *[f"mask_b{b}_{s}_ms" for b in args.batches for s in ("p50", "mean", "p99")]]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for vname, vocab in vocabs.items():
        for name in args.backends:
            r = bench(name, vocab, args.schemas, args.batches)
            print("| " + " | ".join(f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |",
                  flush=True)


if __name__ == "__main__":
    main()
