"""Bad input gets a ValueError naming the field or file; nothing else breaks."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from kvserve import LLM, SamplingParams
from kvserve.cli import main as cli_main


@pytest.fixture(scope="module")
def llm(tiny_model_factory):
    return LLM(model=str(tiny_model_factory("llama")), dtype="float32", num_kv_blocks=32,
               max_model_len=256, check_integrity=True)


@pytest.mark.parametrize("kwargs, field", [
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"logprobs": -1}, "logprobs"),
    ({"prompt_logprobs": -2}, "prompt_logprobs"),
    ({"min_p": 2.0}, "min_p"),
    ({"temperature": "hot"}, "temperature"),
    ({"n": 1.5}, "n"),
    ({"max_tokens": "10"}, "max_tokens"),
    ({"seed": True}, "seed"),
    ({"stop": 5}, "stop"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
])
def test_sampling_params_errors_name_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs, field", [({"logprobs": 21}, "logprobs"), ({"prompt_logprobs": 50}, "prompt_logprobs")])
def test_logprobs_over_the_engines_max(llm, kwargs, field):
    with pytest.raises(ValueError, match=rf"\b{field} must be at most 20"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, **kwargs), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_max_logprobs_whole_vocabulary(tiny_model_factory):
    """max_logprobs=-1 (vLLM's): a request may ask for every token's logprob, and they sum to 1."""
    llm = LLM(model=str(tiny_model_factory("llama")), dtype="float32", num_kv_blocks=32, max_logprobs=-1)
    vocab = llm.engine.vocab_size
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1, logprobs=vocab, prompt_logprobs=vocab),
                       use_tqdm=False)[0]
    for dist in (out.outputs[0].logprobs[0], out.prompt_logprobs[1]):
        assert len(dist) == vocab
        assert abs(sum(math.exp(lp.logprob) for lp in dist.values()) - 1) < 1e-4
    with pytest.raises(ValueError, match="max_logprobs"):
        LLM(model=str(tiny_model_factory("llama")), num_kv_blocks=32, max_logprobs=-2)


@pytest.mark.parametrize("prompt, match", [
    ("", "empty"),
    ([], "empty"),
    ([1] * 256, "max_model_len"),
    ([5, 10**6], "vocabulary"),
    ([1, "x"], "prompt_token_ids"),
    (3.5, "prompts"),
])
def test_bad_prompts(llm, prompt, match):
    with pytest.raises(ValueError, match=match):
        llm.generate([prompt], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_prompt_plus_max_tokens_over_context(llm):
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate([[3] * 200], SamplingParams(max_tokens=100), use_tqdm=False)


def test_request_larger_than_kv_pool(tiny_model_factory):
    small = LLM(model=str(tiny_model_factory("llama")), dtype="float32", num_kv_blocks=4, max_model_len=256)
    with pytest.raises(ValueError, match="KV blocks"):
        small.generate([[3] * 60], SamplingParams(max_tokens=10), use_tqdm=False)


def test_bad_request_in_batch_names_index_and_runs_nothing(llm):
    with pytest.raises(ValueError, match=r"prompts\[1\].*temperature|prompts\[1\]"):
        llm.generate([[5, 6], [], [7]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    outs = llm.generate([[5, 6], [7]], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]


def test_bad_request_mid_run_leaves_others_running(llm):
    eng = llm.engine
    good = [eng.add_request(None, [4 + i] * (5 + i), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
            for i in range(3)]
    eng.step()
    for bad in ([], [1] * 300, [10**6]):
        with pytest.raises(ValueError):
            eng.add_request(None, bad, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request(good[0], [1, 2], SamplingParams())
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    assert sorted(done) == sorted(good)
    assert all(len(o.outputs[0].token_ids) == 6 for o in done.values())
    assert eng.kv.num_used_blocks == 0


def test_abort_frees_blocks(llm):
    eng = llm.engine
    rid = eng.add_request(None, [9] * 40, SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    assert eng.kv.num_used_blocks > 0
    eng.abort_request(rid)
    assert eng.kv.num_used_blocks == 0 and not eng.has_unfinished_requests()
    eng.step()


def test_unknown_model_path():
    with pytest.raises(ValueError, match="/no/such/model"):
        LLM(model="/no/such/model")


def test_unknown_architecture(tmp_path, tiny_model_factory):
    src = tiny_model_factory("llama")
    for f in src.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["FancyNewForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="FancyNewForCausalLM"):
        LLM(model=str(tmp_path))


def test_truncated_safetensors(tmp_path, tiny_model_factory):
    src = tiny_model_factory("llama")
    for f in src.iterdir():
        data = f.read_bytes()
        if f.suffix == ".safetensors":
            data = data[: len(data) // 2]
        (tmp_path / f.name).write_bytes(data)
    with pytest.raises(ValueError, match="safetensors"):
        LLM(model=str(tmp_path))


def test_cli_bad_input_exit_code_2(tiny_model_factory, capsys):
    path = str(tiny_model_factory("llama"))
    assert cli_main(["generate", "--model", path, "--prompt", "hi", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert cli_main(["generate", "--model", "/no/such/dir", "--prompt", "hi"]) == 2
    assert "/no/such/dir" in capsys.readouterr().err


def test_cli_generate_prints_completion(tiny_model_factory):
    path = str(tiny_model_factory("llama"))
    args = [sys.executable, "-m", "kvserve.cli", "generate", "--model", path, "--prompt", "The quick",
            "--max-tokens", "4", "--dtype", "float32"]
    plain = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert plain.returncode == 0, plain.stderr
    streamed = subprocess.run(args + ["--stream"], capture_output=True, text=True, timeout=300)
    assert streamed.returncode == 0, streamed.stderr
    assert plain.stdout == streamed.stdout and plain.stdout.strip()


def test_cli_chat_repl_multi_turn(tiny_model_factory):
    path = str(tiny_model_factory("llama"))
    proc = subprocess.run(
        [sys.executable, "-m", "kvserve.cli", "chat", "--model", path, "--max-tokens", "3", "--dtype", "float32"],
        input="hello\nand again\n\n", capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("> ") == 3  # two turns answered, then the empty line ends it
