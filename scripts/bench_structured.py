"""Structured outputs (issue 34): what the constraint costs and what it buys, on the default model.

1. validity: each schema of kvserve/bench/json_schemas.py (32) asked for in a chat, greedy, up to
   --max-tokens tokens: the share of outputs that parse and validate (jsonschema), through kvserve
   with the schema as a constraint, and through HF transformers' `generate` with no constraint (the
   same GGUF, the same chat template, greedy);
2. compile: each schema compiled cold by the engine's grammar backend (a fresh backend, every
   schema once): p50 / p99 / max;
3. steps while compiling: --streams unconstrained greedy decodes run on the engine; at every 8th
   step a request with a schema never seen before arrives (its grammar compiles on the compile
   pool while the engine steps on). Step times with compiles in flight against a run without any
   constrained request (same streams), and against the same run again with every grammar
   compiled already (the same requests, no compile): median, p99, max, and the ratio of each step
   that ran beside a compile to the same step without one.

The cost in throughput is `kvserve bench throughput --json-schema FILE` against the same command
without it (BENCHMARKS.md has both).

    .venv/bin/python scripts/bench_structured.py [--max-tokens 512] [--streams 8] [--skip-hf] [--max-string 40]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid

from kvserve import LLM, SamplingParams, StructuredOutputsParams
from kvserve.bench.json_schemas import SCHEMAS, schema_prompt
from kvserve.structured.backend import constraint_key


def _valid(text: str, schema: dict) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def bounded(schema, max_len: int):
    """The schema with maxLength on every string that has no bound and no pattern (stricter: what
    validates under it validates under the original)."""
    if isinstance(schema, dict):
        out = {k: bounded(v, max_len) for k, v in schema.items()}
        if out.get("type") == "string" and "maxLength" not in out and "pattern" not in out:
            out["maxLength"] = max_len
        return out
    if isinstance(schema, list):
        return [bounded(v, max_len) for v in schema]
    return schema


def validity_kvserve(llm: LLM, max_tokens: int, max_string: int | None = None) -> list[bool]:
    out = []
    for _, what, schema in SCHEMAS:
        constraint = schema if max_string is None else bounded(schema, max_string)
        params = SamplingParams(temperature=0, max_tokens=max_tokens,
                                structured_outputs=StructuredOutputsParams(json=constraint))
        text = llm.chat(schema_prompt(what, schema), params, use_tqdm=False)[0].outputs[0].text
        out.append(_valid(text, schema))
    return out


def validity_hf(max_tokens: int) -> list[bool]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvserve.bench.throughput import _dense_gguf_config, _hf_model_source

    directory, gguf = _hf_model_source(None)
    tok = AutoTokenizer.from_pretrained(directory, gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf, dtype=torch.float32,
                                                 **_dense_gguf_config()).eval()
    out = []
    for _, what, schema in SCHEMAS:
        ids = tok.apply_chat_template(schema_prompt(what, schema), add_generation_prompt=True, return_tensors="pt",
                                      return_dict=True)["input_ids"]
        with torch.inference_mode():
            gen = model.generate(ids, max_new_tokens=max_tokens, do_sample=False)
        out.append(_valid(tok.decode(gen[0, ids.shape[1]:], skip_special_tokens=True), schema))
    return out


def compile_times(llm: LLM) -> list[float]:
    from kvserve.structured.registry import backend_class

    tok = llm.get_tokenizer()
    eng = llm.engine
    cls = backend_class(eng.config.structured_outputs_backend)
    backend = cls.from_tokenizer(tok, eng.hf_config.vocab_size, tok.eos_token_id)
    times = []
    for _, _, schema in SCHEMAS[:20]:
        key = constraint_key(StructuredOutputsParams(json=schema))
        t = time.perf_counter()
        backend.compile(key)
        times.append(time.perf_counter() - t)
    return times


def step_times(llm: LLM, streams: int, steps: int, schemas: list[dict] | None,
               compile_only: bool = False) -> tuple[list[float], list[bool]]:
    """Step times of `streams` greedy decodes; with `schemas`, every 8th step a request constrained
    by the next one arrives (compile_only: only its grammar's compile starts, on the engine's
    compile pool, and no request joins the batch). Also which steps ran while a grammar compiled."""
    eng = llm.engine
    prompt = llm.get_tokenizer()("Write a long story about a robot who learns to paint.")["input_ids"]
    for i in range(streams):
        eng.add_request(f"s{i}-{uuid.uuid4().hex[:6]}", prompt,
                        SamplingParams(temperature=0, max_tokens=steps + 64, ignore_eos=True))
    for _ in range(4):  # the prefills
        eng.step()
    times, compiling = [], []
    compiles = []
    for n in range(steps):
        if schemas and n % 8 == 0:
            so = StructuredOutputsParams(json=schemas[n // 8])
            if compile_only:
                compiles.append(eng.structured.cache.get((eng.structured.check(so), constraint_key(so))))
            else:
                eng.add_request(f"c{n}-{uuid.uuid4().hex[:6]}", prompt,
                                SamplingParams(temperature=0, max_tokens=8, structured_outputs=so))
        # a grammar compiles during this step
        busy = bool(schemas and (eng.structured.pending or any(not f.done() for f in compiles)))
        t = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t)
        compiling.append(busy and bool(eng.structured.pending or any(not f.done() for f in compiles)))
    for rid in list(eng.scheduler.requests):
        eng.abort_request(rid)
    while eng.has_unfinished_requests():
        eng.step()
    return times, compiling


def _summary(xs: list[float]) -> str:
    s = sorted(xs)
    return (f"median {statistics.median(s) * 1e3:.1f} ms, p99 {s[min(len(s) - 1, int(0.99 * len(s)))] * 1e3:.1f} ms, "
            f"max {s[-1] * 1e3:.1f} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--steps", type=int, default=160)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--max-string", type=int, default=40,
                    help="also run the validity set with maxLength on every unbounded string")
    args = ap.parse_args()
    llm = LLM()
    ours = validity_kvserve(llm, args.max_tokens)
    print(f"validity, kvserve constrained: {sum(ours)}/{len(ours)}")
    if args.max_string:
        capped = validity_kvserve(llm, args.max_tokens, args.max_string)
        print(f"validity, kvserve constrained, strings capped at {args.max_string} chars: {sum(capped)}/{len(capped)}")
    if not args.skip_hf:
        theirs = validity_hf(args.max_tokens)
        print(f"validity, HF generate unconstrained: {sum(theirs)}/{len(theirs)}")
    times = compile_times(llm)
    s = sorted(times)
    print(f"compile (cold, {len(s)} schemas): p50 {statistics.median(s) * 1e3:.1f} ms, "
          f"p99 {s[min(len(s) - 1, int(0.99 * len(s)))] * 1e3:.1f} ms, max {s[-1] * 1e3:.1f} ms")
    # Schemas never compiled before (a unique description each); the second run finds them compiled:
    # the same requests in the same steps, without a compile.
    def fresh() -> list[dict]:
        return [{**SCHEMAS[i % len(SCHEMAS)][2], "description": uuid.uuid4().hex} for i in range(args.steps // 8 + 1)]

    plain, _ = step_times(llm, args.streams, args.steps, None)
    busy, compiling = step_times(llm, args.streams, args.steps, fresh())
    during = [t for t, c in zip(busy, compiling) if c]
    print(f"steps, {args.streams} streams, no constrained request: {_summary(plain)}")
    print(f"steps, {args.streams} streams, a request with a cold schema every 8 steps: {_summary(busy)}")
    if during:
        print(f"  of those, the {len(during)} steps during which a compile ran: {_summary(during)}")
    # The compile alone: the same plain streams while cold compiles run on the pool.
    alone, compiling = step_times(llm, args.streams, args.steps, fresh(), compile_only=True)
    beside = [t for t, c in zip(alone, compiling) if c]
    apart = [t for t, c in zip(alone, compiling) if not c]
    if beside:
        print(f"steps, {args.streams} plain streams, a cold compile started every 8 steps: the {len(beside)} beside a "
              f"compile {_summary(beside)}; the {len(apart)} without {_summary(apart)}")
    llm.close()


if __name__ == "__main__":
    main()
