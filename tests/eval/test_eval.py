"""`kvserve eval ppl | agree` and `score` against HF transformers on a tiny random Llama (float32)."""

from __future__ import annotations

import argparse
import json
import math
import shutil

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.eval.agree import compare, load_prompts, run_agree
from kvserve.eval.cli import add_eval_parser
from kvserve.eval.ppl import load_text_tokens, perplexity, score, windows
from tests.conftest import CORPUS, hf_greedy

SENTENCES = CORPUS[:5]


@pytest.fixture(scope="module")
def model_dir(tiny_model_factory):
    return tiny_model_factory("llama")


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), dtype="float32", num_kv_blocks=64, block_size=4)


@pytest.fixture(scope="module")
def text_ids(llm):
    # Sentences in a shifting order so that windows see varied text: about 300 tokens.
    text = " ".join(SENTENCES[(i * 3) % 5] + " " + SENTENCES[(i * 2 + 1) % 5] for i in range(4))
    ids = list(llm.get_tokenizer()(text)["input_ids"])
    assert 250 < len(ids) < 500  # shorter than max_model_len (512): one window can hold it all
    return ids


def hf_recipe(model, ids: list[int], window: int, stride: int) -> tuple[int, float]:
    """HF's fixed-length-model perplexity loop: labels before the new targets are -100 and the
    model's own (shifted) loss is weighted by the targets it counted. Returns (count, mean NLL)."""
    x = torch.tensor([ids])
    nll_sum, count, prev_end = 0.0, 0, 0
    with torch.no_grad():
        for begin in range(0, len(ids), stride):
            end = min(begin + window, len(ids))
            inp = x[:, begin:end]
            target = inp.clone()
            target[:, :-(end - prev_end)] = -100
            n = int((target[:, 1:] != -100).sum())  # the loss shifts labels by one
            nll_sum += float(model(inp, labels=target).loss) * n
            count += n
            prev_end = end
            if end == len(ids):
                break
    return count, nll_sum / count


# ---- score ----------------------------------------------------------------


def test_score_matches_hf_and_leaves_engine_cache_alone(llm, hf_model, text_ids):
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=1, ignore_eos=True)
    prompt = text_ids[:13]
    before = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    caches = [(k.clone(), v.clone()) for k, v in llm.engine.executor.runner.kv_caches]
    used = llm.engine.kv.num_used_blocks

    ids = text_ids[:150]  # 38 blocks of 4: more than the prompt above ever used
    logits = score(llm, ids)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    assert logits.dtype == torch.float32 and logits.shape == ref.shape
    torch.testing.assert_close(logits, ref, atol=2e-5, rtol=1e-5)

    for (k, v), (k0, v0) in zip(llm.engine.executor.runner.kv_caches, caches):
        assert torch.equal(k, k0) and torch.equal(v, v0)
    assert llm.engine.kv.num_used_blocks == used
    # The same prompt again hits the prefix cache written before score() and decodes the same.
    again = llm.generate([prompt], params, use_tqdm=False)[0]
    assert again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == before.token_ids == hf_greedy(hf_model, [prompt], 6)[0][0]
    for a, b in zip(again.outputs[0].logprobs, before.logprobs):
        assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-5 for t in a)


def test_score_rejects_bad_ids(llm):
    with pytest.raises(ValueError, match="token_ids must not be empty"):
        score(llm, [])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        score(llm, [3, 10**6])
    with pytest.raises(ValueError, match="max_model_len=512"):
        score(llm, [3] * 513)


# ---- ppl ------------------------------------------------------------------


@pytest.mark.parametrize("window,stride", [(64, 24), (64, 64), (100, 1 + 99 // 2), (1000, 512)])
def test_ppl_matches_hf_recipe(llm, hf_model, text_ids, window, stride):
    num_windows, count, total = perplexity(llm, text_ids, window, stride)
    ref_count, ref_nll = hf_recipe(hf_model, text_ids, window, stride)
    assert count == ref_count
    assert total / count == pytest.approx(ref_nll, rel=1e-4)
    n = len(text_ids)
    if window >= n:  # shorter text than the window: one window, everything but token 0 scored
        assert (num_windows, count) == (1, n - 1)
    elif stride == window:  # no overlap: each window's first token has no context
        assert count == n - num_windows
    else:
        assert count == n - 1


def test_windows_score_every_token_once():
    for n, w, s in [(2, 2, 1), (10, 4, 1), (10, 4, 3), (11, 4, 4), (17, 5, 2), (100, 7, 7), (3, 50, 10)]:
        spans = windows(n, w, s)
        scored = [t for sp in spans for t in range(sp.first_target, sp.end)]
        assert len(scored) == len(set(scored))
        assert all(sp.end - sp.begin <= w and sp.begin < sp.first_target for sp in spans)
        unscored = set(range(1, n)) - set(scored)
        assert unscored == ({sp.begin for sp in spans[1:]} if s == w else set())
        assert spans[-1].end == n


def test_window_and_stride_errors():
    with pytest.raises(ValueError, match="--stride must be between 1 and --window"):
        windows(100, 8, 9)
    with pytest.raises(ValueError, match="--stride"):
        windows(100, 8, 0)
    with pytest.raises(ValueError, match="--window must be at least 2"):
        windows(100, 1, 1)
    with pytest.raises(ValueError, match="at least 2"):
        windows(1, 8, 4)


def test_ppl_window_longer_than_model(llm, text_ids):
    ids = text_ids * 2  # > 512 tokens
    with pytest.raises(ValueError, match="--window 600 is longer than the model's max_model_len=512"):
        perplexity(llm, ids, 600, 300)
    # A long window is fine while the whole text fits.
    assert perplexity(llm, text_ids, 600, 300)[0] == 1


def test_text_file_dataset(llm, tmp_path):
    tok = llm.get_tokenizer()
    path = tmp_path / "t.txt"
    path.write_text("Ünïcödé " + SENTENCES[0], encoding="utf-8")
    assert load_text_tokens(tok, str(path), 5) == list(tok(path.read_text("utf-8"))["input_ids"])[:5]
    with pytest.raises(ValueError, match="--dataset .* neither 'sharegpt' nor a file"):
        load_text_tokens(tok, str(tmp_path / "missing.txt"), 100)
    path.write_bytes(b"\xff\xfe broken")
    with pytest.raises(ValueError, match="--dataset .* is not UTF-8"):
        load_text_tokens(tok, str(path), 100)
    path.write_text("a", encoding="utf-8")
    with pytest.raises(ValueError, match="--dataset .* gives 1 token"):
        load_text_tokens(tok, str(path), 100)
    with pytest.raises(ValueError, match="--max-tokens must be at least 2"):
        load_text_tokens(tok, str(path), 1)


def test_sharegpt_dataset_cut_to_max_tokens(llm):
    ids = load_text_tokens(llm.get_tokenizer(), "sharegpt", 3000)
    assert len(ids) == 3000


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvserve")
    add_eval_parser(p.add_subparsers(dest="command", required=True))
    return p


def test_cli_ppl_prints_and_writes_json(model_dir, hf_model, text_ids, tmp_path, capsys):
    from transformers import AutoTokenizer

    text = " ".join(SENTENCES * 3)
    (tmp_path / "t.txt").write_text(text, encoding="utf-8")
    out = tmp_path / "ppl.json"
    args = parser().parse_args(["eval", "ppl", str(model_dir), "--dataset", str(tmp_path / "t.txt"),
                                "--max-tokens", "90", "--window", "40", "--stride", "15", "--dtype", "float32",
                                "--output-json", str(out)])
    assert args.func(args) == 0
    data = json.loads(out.read_text())
    ids = list(AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"])[:90]
    count, nll = hf_recipe(hf_model, ids, 40, 15)
    assert (data["num_tokens"], data["tokens_scored"], data["num_windows"]) == (90, count, 5)  # windows start at 0, 15, 30, 45, 60
    assert data["mean_nll"] == pytest.approx(nll, rel=1e-4)
    assert data["ppl"] == pytest.approx(math.exp(nll), rel=1e-4)
    printed = capsys.readouterr().out
    assert f"{count}" in printed and f"{data['ppl']:.4f}" in printed


@pytest.mark.parametrize("argv,message", [
    (["ppl", "--max-tokens", "1"], "--max-tokens must be at least 2"),
    (["ppl", "--window", "1", "--stride", "1"], "--window must be at least 2"),
    (["ppl", "--window", "8", "--stride", "9"], "--stride must be between 1 and --window"),
    (["ppl", "--stride", "0"], "--stride must be between"),
    (["agree", "-q", "none", "--num-prompts", "0"], "--num-prompts must be at least 1"),
    (["agree", "-q", "none", "--max-tokens", "0"], "--max-tokens must be at least 1"),
    (["agree", "-q", "none", "--max-prompt-len", "3"], "--max-prompt-len must be at least 4"),
])
def test_cli_bad_flags_fail_before_loading(argv, message, monkeypatch):
    import kvserve

    def no_load(*a, **k):
        raise AssertionError("the model must not load when a flag is bad")

    monkeypatch.setattr(kvserve, "LLM", no_load)
    args = parser().parse_args(["eval", *argv])
    with pytest.raises(ValueError, match=message):
        args.func(args)


def test_cli_choices_and_required_quantization(capsys):
    for argv in (["eval", "agree"], ["eval", "ppl", "-q", "int3"], ["eval", "ppl", "--kv-cache-dtype", "int4"]):
        with pytest.raises(SystemExit):
            parser().parse_args(argv)
    err = capsys.readouterr().err
    assert "--quantization/-q" in err and "int3" in err and "int4" in err


# ---- agree ----------------------------------------------------------------


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("agree") / "sharegpt.json"
    records = [{"id": str(i), "conversations": [{"from": "human", "value": f"{SENTENCES[i % 5]} {SENTENCES[i // 5]}"},
                                                 {"from": "gpt", "value": SENTENCES[(i + 1) % 5]}]}
               for i in range(10)]
    path.write_text(json.dumps(records))
    return str(path)


@pytest.fixture(scope="module")
def noisy_dir(model_dir, tmp_path_factory):
    """A copy of the tiny model with noise on one weight."""
    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("noisy")
    shutil.copytree(model_dir, out, dirs_exist_ok=True)
    weights = load_file(out / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    weights[name] = weights[name] + 0.3 * torch.randn(weights[name].shape, generator=torch.Generator().manual_seed(1))
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_compare_formula():
    g = torch.Generator().manual_seed(0)
    a = torch.log_softmax(torch.randn(5, 11, generator=g), -1)
    b = torch.log_softmax(torch.randn(5, 11, generator=g), -1)
    same, kl = compare(a, b)
    torch.testing.assert_close(kl, torch.nn.functional.kl_div(b, a, log_target=True, reduction="none").sum(-1))
    assert torch.equal(same, a.argmax(-1) == b.argmax(-1))
    assert torch.allclose(compare(a, a)[1], torch.zeros(5))
    with pytest.raises(ValueError, match="share a vocabulary"):
        compare(a, b[:, :10])


def test_agree_with_itself(model_dir, prompts_file):
    r = run_agree(str(model_dir), "none", "none", num_prompts=3, max_tokens=8, dtype="float32",
                  dataset=prompts_file)
    assert r.num_prompts == 3 and r.positions > 3
    assert r.agreement == 1.0
    assert abs(r.mean_kl) < 1e-6 and abs(r.max_kl) < 1e-6
    assert r.reference_nll == pytest.approx(r.quantized_nll, abs=1e-6)


def test_agree_with_perturbed_copy_matches_hf(model_dir, noisy_dir, hf_model, prompts_file):
    from transformers import AutoModelForCausalLM

    n, m = 4, 10
    r = run_agree(str(noisy_dir), "none", "none", reference_model=str(model_dir), num_prompts=n, max_tokens=m,
                  dtype="float32", dataset=prompts_file)
    # The same numbers straight from HF: greedy continuation by the reference (stopping after
    # EOS like the engine), then both models teacher-forced on prompt + continuation.
    noisy = AutoModelForCausalLM.from_pretrained(noisy_dir, dtype=torch.float32).eval()
    eos = hf_model.config.eos_token_id
    same, kls = [], []
    for p in load_prompts(str(model_dir), n, 256, 0, prompts_file):
        cont = hf_greedy(hf_model, [p], m)[0][0]
        cont = cont[:cont.index(eos) + 1] if eos in cont else cont
        x = torch.tensor([p + cont])
        with torch.no_grad():
            rows = slice(len(p) - 1, len(p) - 1 + len(cont))
            lr = torch.log_softmax(hf_model(x).logits[0, rows], -1)
            lq = torch.log_softmax(noisy(x).logits[0, rows], -1)
        same.append(lr.argmax(-1) == lq.argmax(-1))
        kls.append((lr.exp() * (lr - lq)).sum(-1))
    same_t, kl_t = torch.cat(same), torch.cat(kls)
    assert r.positions == len(same_t)
    assert r.agreement == pytest.approx(float(same_t.float().mean()))
    assert r.mean_kl == pytest.approx(float(kl_t.mean()), rel=1e-3)
    assert r.agreement < 1.0 and r.mean_kl > 1e-3
