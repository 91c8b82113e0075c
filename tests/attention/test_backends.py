"""Choosing the attention backend (--attention-backend auto|cpu|torch): the registry, the checks,
and the same greedy tokens from the engine under each."""

from __future__ import annotations

import importlib.util
import os

import pytest

from kvserve import LLM, SamplingParams
from kvserve.attention import get_backend
from kvserve.attention.cpu_backend import CpuAttentionBackend
from kvserve.attention.torch_backend import TorchAttentionBackend
from kvserve.config import EngineConfig
from kvserve.config import resolve_attention_backend as resolve_backend


def test_auto_is_the_c_kernels_on_a_cpu_and_torch_elsewhere():
    assert resolve_backend("auto", "cpu") == "cpu"
    assert resolve_backend("auto", "cuda") == "torch"
    assert resolve_backend("auto", "cuda:1") == "torch"
    assert resolve_backend("torch", "cpu") == "torch"
    assert type(get_backend("cpu")) is CpuAttentionBackend
    assert type(get_backend("torch")) is TorchAttentionBackend


def test_bad_choices_name_the_field():
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig.from_kwargs(attention_backend="flash")
    with pytest.raises(ValueError, match="attention_backend cpu runs on the CPU only"):
        EngineConfig.from_kwargs(attention_backend="cpu", device="cuda")
    with pytest.raises(ValueError, match="attention_backend cpu runs on the CPU only"):
        resolve_backend("cpu", "cuda")
    with pytest.raises(ValueError, match="unknown attention backend"):
        get_backend("flash")


def test_triton_on_a_cpu_needs_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="attention_backend triton runs on a CUDA device"):
        resolve_backend("triton", "cpu")
    assert resolve_backend("triton", "cuda") == "triton"


def test_every_backend_gives_the_same_greedy_tokens(tiny_model_factory):
    """Mixed prefills and decodes over shared cached blocks, in float32 where the two compute alike."""
    model = str(tiny_model_factory("llama"))
    prompts = [[(7 * i + 3 * j) % 250 + 3 for j in range(20 + 9 * i)] for i in range(4)]
    prompts.append(prompts[0][:18] + [5, 6, 7])  # a prefix hit: prefill over cached blocks
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    tokens = {}
    names = ["cpu", "torch"]
    if importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET") == "1":
        names.append("triton")  # in Triton's interpreter (tests/conftest.py), which the test extra installs
    for name in names:
        llm = LLM(model=model, dtype="float32", attention_backend=name, block_size=8, check_integrity=True)
        try:
            assert type(llm.engine.executor.runner.attention_backend).name == name
            tokens[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        finally:
            llm.close()
    assert tokens["cpu"] == tokens["torch"]
    if "triton" in tokens:
        assert tokens["triton"] == tokens["torch"]
