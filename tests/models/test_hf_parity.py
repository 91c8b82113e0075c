"""Our Llama-family models against HF transformers on tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from kvserve.models import load_model

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)

CONFIGS = {
    "llama": lambda: LlamaConfig(**SMALL, rope_theta=10000.0),
    "llama_tied_llama3_rope": lambda: LlamaConfig(
        **SMALL, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "llama_mha_bias": lambda: LlamaConfig(**{**SMALL, "num_key_value_heads": 4}, attention_bias=True, mlp_bias=True),
    "mistral": lambda: MistralConfig(**SMALL, rope_theta=1e6, sliding_window=None),
    "qwen2": lambda: Qwen2Config(**SMALL, rope_theta=1e6, tie_word_embeddings=True),
    "qwen3": lambda: Qwen3Config(**SMALL, head_dim=32, rope_theta=1e6, tie_word_embeddings=False),
    "qwen3_tied": lambda: Qwen3Config(**{**SMALL, "num_key_value_heads": 1}, head_dim=16, tie_word_embeddings=True),
}

TOKENS = [5, 17, 42, 99, 7, 250, 3, 64, 128, 11, 200, 31, 77, 150, 9, 260, 45, 88, 2, 120]


def _hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_matches_hf(name, make_hf_checkpoint, paged_runner):
    path, hf = make_hf_checkpoint(CONFIGS[name]())
    lm = load_model(str(path), dtype="float32")
    assert type(lm.model).__name__ == hf.config.architectures[0]
    assert lm.dtype == torch.float32 and not lm.model.training
    ours = paged_runner(lm.model, lm.hf_config).step(TOKENS)
    ref = _hf_logits(hf, TOKENS)
    assert ours.shape == ref.shape and ours.dtype == torch.float32
    assert ref.std() > 0.3  # logits vary enough for the comparison to mean something
    assert (ours - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "llama_tied_llama3_rope"])
def test_prefill_then_decode_matches_hf(name, make_hf_checkpoint, paged_runner):
    path, hf = make_hf_checkpoint(CONFIGS[name]())
    lm = load_model(str(path), dtype="float32")
    runner = paged_runner(lm.model, lm.hf_config)
    ids = TOKENS[:11]
    prefill = runner.step(ids[:10])
    decode = runner.step(ids[10:], decode=True)
    ref = _hf_logits(hf, ids)
    assert (prefill - ref[:10]).abs().max().item() < 1e-4
    assert (decode[0] - ref[10]).abs().max().item() < 1e-4


def test_chunked_prefill_then_decodes_match_hf(make_hf_checkpoint, paged_runner):
    """A prompt in two chunks (the second attends to cached K/V), then several decodes across blocks."""
    path, hf = make_hf_checkpoint(CONFIGS["qwen3"]())
    lm = load_model(str(path), dtype="float32")
    runner = paged_runner(lm.model, lm.hf_config, block_size=4)
    ids = TOKENS
    out = [runner.step(ids[:7]), runner.step(ids[7:13])]
    out += [runner.step([t], decode=True) for t in ids[13:]]
    ours = torch.cat(out)
    assert (ours - _hf_logits(hf, ids)).abs().max().item() < 1e-4


def test_bfloat16_close_to_hf(make_hf_checkpoint, paged_runner):
    path, hf = make_hf_checkpoint(CONFIGS["llama"]())
    lm = load_model(str(path), dtype="bfloat16")
    assert lm.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in lm.model.parameters())
    ours = paged_runner(lm.model, lm.hf_config, dtype=torch.bfloat16).step(TOKENS)
    assert ours.dtype == torch.float32
    ref = _hf_logits(hf, TOKENS)
    assert (ours - ref).abs().max().item() < 0.15 * ref.abs().max().item()
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9


def test_tokenizer_and_chat_template_loaded(make_hf_checkpoint):
    path, _ = make_hf_checkpoint(CONFIGS["llama"]())
    lm = load_model(str(path), dtype="float32")
    assert lm.model_path == str(path.resolve())
    text = lm.tokenizer.apply_chat_template([{"role": "user", "content": "hello world"}], tokenize=False,
                                            add_generation_prompt=True)
    assert text == "<|im_start|>user\nhello world<|im_end|>\n<|im_start|>assistant\n"
    assert lm.tokenizer.decode(lm.tokenizer("hello world").input_ids) == "hello world"


def test_sharded_safetensors(make_hf_checkpoint, paged_runner, tiny_tokenizer, tmp_path):
    _, hf = make_hf_checkpoint(CONFIGS["mistral"]())
    out = tmp_path / "sharded"
    hf.save_pretrained(out, max_shard_size="50KB")
    tiny_tokenizer.save_pretrained(out)
    assert (out / "model.safetensors.index.json").exists()
    assert len(list(out.glob("*.safetensors"))) > 1
    lm = load_model(str(out), dtype="float32")
    ours = paged_runner(lm.model, lm.hf_config).step(TOKENS)
    assert (ours - _hf_logits(hf, TOKENS)).abs().max().item() < 1e-4
