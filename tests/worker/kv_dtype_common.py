"""What the KV-dtype tests (test_fp8_kv.py, test_bf16_kv.py) share: an engine on a tiny random model
with a given kv_cache_dtype, its prompts, teacher-forced logprobs, and greedy outputs held close to
the 'auto' (model-dtype) cache's."""

from __future__ import annotations

import random
from pathlib import Path

from kvserve import LLM, SamplingParams

BS = 16


def prompts(n: int = 8, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randrange(20, 60))] for _ in range(n)]


def engine(model_dir: Path, kv_cache_dtype: str, **kw) -> LLM:
    kw.setdefault("num_kv_blocks", 128)
    return LLM(model=str(model_dir), dtype=kw.pop("dtype", "float32"), kv_cache_dtype=kv_cache_dtype, block_size=BS,
               check_integrity=True, **kw)


def prompt_logprobs(llm: LLM, prompts: list[list[int]]) -> list[float]:
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [next(iter(d.values())).logprob for o in outs for d in o.prompt_logprobs if d]


def assert_greedy_close(outs, auto_outs, max_lp_diff: float, mean_lp_diff: float) -> int:
    """Tokens equal up to a near-tie of auto's top two (closer than 2 * max_lp_diff), logprobs within
    max_lp_diff (mean_lp_diff on average) before it; returns how many generations were identical."""
    identical, diffs = 0, []
    for a, b in zip(auto_outs, outs):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        for j, (x, y) in enumerate(zip(ta, tb)):
            la, lb = a.outputs[0].logprobs[j], b.outputs[0].logprobs[j]
            if x != y:
                assert y in la, f"step {j}: token {y} is not in auto's top 5 {list(la)}"
                gap = la[x].logprob - la[y].logprob
                assert gap < 2 * max_lp_diff, f"step {j}: tokens {x} != {y} but auto's gap is {gap:.3f}"
                break
            diffs.append(abs(la[x].logprob - lb[x].logprob))
        else:
            identical += 1
    assert max(diffs) < max_lp_diff and sum(diffs) / len(diffs) < mean_lp_diff, (max(diffs), sum(diffs) / len(diffs))
    return identical
