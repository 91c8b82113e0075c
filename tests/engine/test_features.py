"""Engine features end to end on a tiny model: prefix reuse, sampling options,
stop handling, n > 1, logprobs, detokenization, priorities."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.detokenizer import IncrementalDetokenizer
from tests.conftest import hf_greedy


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return LLM(model=str(tiny_model_factory("llama")), dtype="float32", num_kv_blocks=128,
               check_integrity=True)


def ids(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 300) for _ in range(n)]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, ignore_eos=True, **kw)


def test_shared_three_block_prefix_reports_48_cached(llm):
    prefix = ids(48, seed=1)
    llm.engine.kv.reset_prefix_cache()
    first = llm.generate([prefix + ids(7, 2)], greedy(max_tokens=2), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    hits_before = llm.engine.kv.prefix_cache_hits
    second = llm.generate([prefix + ids(5, 3)], greedy(max_tokens=2), use_tqdm=False)[0]
    assert second.num_cached_tokens == 48
    assert llm.engine.kv.prefix_cache_hits - hits_before == 48
    assert llm.engine.kv.num_used_blocks == 0


def test_seed_reproducible_independent_of_batch(llm):
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate([ids(9, 5)], p, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=7, max_tokens=4, ignore_eos=True)]
    batch = llm.generate([ids(20, 6), ids(9, 5), ids(3, 7)], [others[0], p, others[1]], use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    unseeded = llm.generate([ids(9, 5)] * 2, SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True),
                            use_tqdm=False)
    assert unseeded[0].outputs[0].token_ids != alone or unseeded[1].outputs[0].token_ids != alone


def test_n_samples_share_prompt_and_differ(llm):
    p = SamplingParams(n=3, temperature=1.0, seed=42, max_tokens=8, ignore_eos=True)
    out = llm.generate([ids(40, 8)], p, use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = llm.generate([ids(40, 8)], p, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    assert llm.engine.kv.num_used_blocks == 0


def test_n_greedy_samples_equal_single(llm):
    single = llm.generate([ids(21, 9)], greedy(max_tokens=6), use_tqdm=False)[0].outputs[0].token_ids
    multi = llm.generate([ids(21, 9)], greedy(max_tokens=6, n=2), use_tqdm=False)[0]
    assert [c.token_ids for c in multi.outputs] == [single, single]


def test_max_tokens_and_finish_reason(llm):
    out = llm.generate([ids(5)], greedy(max_tokens=3), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 3 and out.finish_reason == "length"


def test_stop_token_ids_and_min_tokens(llm):
    base = llm.generate([ids(6, 10)], greedy(max_tokens=8), use_tqdm=False)[0].outputs[0].token_ids
    stop_tok = base[2]
    out = llm.generate([ids(6, 10)], greedy(max_tokens=8, stop_token_ids=[stop_tok]), use_tqdm=False)[0]
    c = out.outputs[0]
    first = base.index(stop_tok)
    assert c.token_ids == base[:first + 1] and c.finish_reason == "stop" and c.stop_reason == stop_tok
    # min_tokens forbids the stop token until enough tokens are out
    out = llm.generate([ids(6, 10)], greedy(max_tokens=8, min_tokens=first + 2, stop_token_ids=[stop_tok]),
                       use_tqdm=False)[0].outputs[0]
    assert stop_tok not in out.token_ids[:first + 2]


def test_eos_stops_unless_ignored(tiny_model_factory):
    llm = LLM(model=str(tiny_model_factory("llama")), dtype="float32", num_kv_blocks=64)
    base = llm.generate([ids(4, 11)], greedy(max_tokens=6), use_tqdm=False)[0].outputs[0].token_ids
    llm.engine.eos_token_id = llm.engine.executor.runner.eos_token_id = base[1]
    out = llm.generate([ids(4, 11)], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == base[:2] and out.outputs[0].finish_reason == "stop"
    ign = llm.generate([ids(4, 11)], greedy(max_tokens=6), use_tqdm=False)[0].outputs[0]
    assert ign.token_ids == base


def test_stop_string_trimmed(llm):
    full = llm.generate([ids(6, 12)], greedy(max_tokens=10), use_tqdm=False)[0].outputs[0]
    text = full.text
    assert len(text) > 4
    stop = text[2:4]
    cut = text.index(stop)
    out = llm.generate([ids(6, 12)], greedy(max_tokens=10, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == text[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    inc = llm.generate([ids(6, 12)], greedy(max_tokens=10, stop=stop, include_stop_str_in_output=True),
                       use_tqdm=False)[0].outputs[0]
    assert inc.text == text[:cut + len(stop)]


def test_logprobs_and_prompt_logprobs_match_hf(llm, tiny_model_factory):
    prompt = ids(30, 13)
    out = llm.generate([prompt], greedy(max_tokens=3, logprobs=3, prompt_logprobs=2), use_tqdm=False)[0]
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_model_factory("llama"), dtype=torch.float32)
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        tok = prompt[pos]
        assert abs(entry[tok].logprob - float(lp[pos - 1, tok])) < 1e-4
        top2 = torch.topk(lp[pos - 1], 2).indices.tolist()
        assert set(top2) <= set(entry)
        assert entry[tok].rank == int((lp[pos - 1] > lp[pos - 1, tok]).sum()) + 1
    c = out.outputs[0]
    assert len(c.logprobs) == 3 and all(len(p) >= 3 for p in c.logprobs)
    assert c.cumulative_logprob == pytest.approx(sum(p[t].logprob for p, t in zip(c.logprobs, c.token_ids)))


def test_prompt_logprobs_under_tiny_chunks(tiny_model_factory):
    llm = LLM(model=str(tiny_model_factory("llama")), dtype="float32", num_kv_blocks=64,
              max_num_batched_tokens=5)
    big = LLM(model=str(tiny_model_factory("llama")), dtype="float32", num_kv_blocks=64)
    p = greedy(max_tokens=2, prompt_logprobs=0)
    a = llm.generate([ids(23, 14)], p, use_tqdm=False)[0].prompt_logprobs
    b = big.generate([ids(23, 14)], p, use_tqdm=False)[0].prompt_logprobs
    assert len(a) == len(b) == 23
    for x, y in zip(a[1:], b[1:]):
        (tx, lx), = x.items()
        (ty, ly), = y.items()
        assert tx == ty and abs(lx.logprob - ly.logprob) < 1e-4


def test_priority_scheduling_order(tiny_model_factory):
    llm = LLM(model=str(tiny_model_factory("llama")), dtype="float32", num_kv_blocks=64, max_num_seqs=1)
    outs = llm.generate([ids(5, 1), ids(5, 2), ids(5, 3)], greedy(max_tokens=2), use_tqdm=False,
                        priority=[5, 0, 1])
    order = sorted(range(3), key=lambda i: outs[i].metrics.first_scheduled_time)
    assert order == [1, 2, 0]


def test_chat_uses_template(llm):
    out = llm.chat([{"role": "user", "content": "hello"}], greedy(max_tokens=2), use_tqdm=False)[0]
    tok = llm.get_tokenizer()
    assert tok.decode(out.prompt_token_ids).startswith("<|im_start|>user\nhello<|im_end|>")
    assert out.prompt_token_ids == llm.apply_chat_template([{"role": "user", "content": "hello"}])


def test_generate_matches_hf_on_text_prompt(llm, tiny_model_factory):
    prompt = "Prefix caching reuses"
    toks = llm.get_tokenizer()(prompt)["input_ids"]
    ours = llm.generate(prompt, greedy(max_tokens=5), use_tqdm=False)[0]
    assert ours.prompt_token_ids == toks and ours.prompt == prompt
    ref, _ = hf_greedy(tiny_model_factory("llama"), [toks], 5)[0]
    assert ours.outputs[0].token_ids == ref


class _ByteTok:
    """Each token is one byte of UTF-8: a multi-byte character spans tokens."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(ids).decode("utf-8", errors="replace")


def test_incremental_detokenizer_multibyte():
    text = "aé中🙂b"
    det = IncrementalDetokenizer(_ByteTok(), [], stop=None)
    pieces = [det.add_token(b)[0] for b in text.encode()]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    assert pieces.count("") == len(text.encode()) - len(text)


def test_incremental_detokenizer_stop_across_tokens():
    det = IncrementalDetokenizer(_ByteTok(), [], stop=["中🙂"])
    hit = None
    for b in "x中🙂y".encode():
        _, hit = det.add_token(b)
        if hit:
            break
    assert hit == "中🙂" and det.text == "x"


def test_stream_holds_back_partial_stop_string(llm):
    full = llm.generate([ids(6, 12)], greedy(max_tokens=10), use_tqdm=False)[0].outputs[0].text
    stop = full[3:6]
    pieces = list(llm.stream(ids(6, 12), greedy(max_tokens=10, stop=[stop])))
    assert "".join(pieces) == full[:full.index(stop)]
    assert "".join(llm.stream(ids(6, 12), greedy(max_tokens=10))) == full
