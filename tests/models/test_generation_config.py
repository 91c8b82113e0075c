"""Reading a model's sampling defaults: generation_config.json, GGUF general.sampling.*, the settings."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvserve.config import EngineConfig, ModelConfig
from kvserve.engine_args import add_engine_args
from kvserve.models.generation_config import generation_defaults


def hf_dir(path: Path, config: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "generation_config.json").write_text(json.dumps(config))
    return path


def gguf_file(path: Path, **sampling) -> Path:
    """A metadata-only GGUF file with llama.cpp's general.sampling.* keys."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    for name, value in sampling.items():
        getattr(w, f"add_sampling_{name}")(value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_hf_keys_as_vllm_takes_them(tmp_path):
    d = hf_dir(tmp_path, {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
                          "max_new_tokens": 256, "do_sample": True, "max_length": 4096, "bos_token_id": 1,
                          "typical_p": 0.5, "presence_penalty": None})
    assert generation_defaults(d) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                                      "repetition_penalty": 1.1, "max_tokens": 256}


def test_hf_top_k_zero_disables_and_integral_floats(tmp_path):
    assert generation_defaults(hf_dir(tmp_path, {"top_k": 0, "max_new_tokens": 64.0})) == {"top_k": -1,
                                                                                           "max_tokens": 64}


def test_no_file_or_no_sampling_keys(tmp_path):
    assert generation_defaults(tmp_path) == {}
    assert generation_defaults(hf_dir(tmp_path / "m", {"bos_token_id": 1, "eos_token_id": 2})) == {}


def test_none_and_folder_settings(tmp_path):
    model = hf_dir(tmp_path / "model", {"temperature": 0.6})
    other = hf_dir(tmp_path / "other", {"top_p": 0.5})
    assert generation_defaults(model, "none") == {} == generation_defaults(model, "vllm")
    assert generation_defaults(model, str(other)) == {"top_p": 0.5}
    with pytest.raises(ValueError, match="must be auto, none, or a directory holding generation_config.json"):
        generation_defaults(model, str(tmp_path / "missing"))


@pytest.mark.parametrize("config, match", [
    ({"temperature": -1}, "temperature must be non-negative"),
    ({"top_p": 2}, r"top_p must be in \(0, 1\]"),
    ({"max_new_tokens": "many"}, "max_tokens must be a 64-bit integer"),
])
def test_bad_value_names_file_and_field(tmp_path, config, match):
    with pytest.raises(ValueError, match=f"generation_config.json: {match}.*--generation-config none"):
        generation_defaults(hf_dir(tmp_path, config))


def test_bad_json(tmp_path):
    (tmp_path / "generation_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read .*generation_config.json"):
        generation_defaults(tmp_path)


def test_gguf_sampling_metadata(tmp_path):
    f = gguf_file(tmp_path / "m.gguf", temp=0.6, top_k=40, top_p=0.95, min_p=0.05, penalty_repeat=1.1,
                  mirostat=0)
    assert generation_defaults(f) == {"temperature": 0.6, "top_p": 0.95, "top_k": 40, "min_p": 0.05,
                                      "repetition_penalty": 1.1}
    assert generation_defaults(f, "none") == {}
    assert generation_defaults(gguf_file(tmp_path / "plain.gguf")) == {}


def test_flag_and_keyword():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert EngineConfig.from_cli_args(p.parse_args([])).model.generation_config == "auto"
    assert EngineConfig.from_cli_args(p.parse_args(["--generation-config", "none"])).model.generation_config == "none"
    assert EngineConfig.from_kwargs(generation_config="/some/dir").model.generation_config == "/some/dir"
    with pytest.raises(ValueError, match="generation_config must be auto, none or a directory"):
        ModelConfig(generation_config="")
