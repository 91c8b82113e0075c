"""Tensor-parallel offline throughput on the default model through the public API (issue 33 before/after):
32 random prompts of 128 tokens, 64 output tokens each, all submitted at once; and one stream."""
import json
import random
import sys
import time

from kvserve import LLM, SamplingParams

tp = int(sys.argv[1]) if len(sys.argv) > 1 else 2
llm = LLM(tensor_parallel_size=tp)
rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(128)]} for _ in range(32)]
params = SamplingParams(max_tokens=64, ignore_eos=True, temperature=0)
llm.generate(prompts[:4], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0), use_tqdm=False)
t = time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
el = time.perf_counter() - t
n = sum(len(o.outputs[0].token_ids) for o in outs)
t = time.perf_counter()
one = llm.generate([{"prompt_token_ids": [7] * 16}], SamplingParams(max_tokens=65, ignore_eos=True, temperature=0),
                   use_tqdm=False)[0]
m = one.metrics
stream = 64 / (m.last_token_time - m.first_token_time) if hasattr(m, "last_token_time") else 65 / (time.perf_counter() - t)
print(json.dumps({"tp": tp, "kvserve": __import__("kvserve").__file__, "output_tok_s": n / el, "stream_tok_s": stream}))
llm.close()
