"""GGUF linears kept compressed (--quantization gguf): exact repacking of llama.cpp blocks,
logits equal to the dequantized model, and the default model's memory."""

from __future__ import annotations

import logging
import os

import gguf
import numpy as np
import pytest
import torch
from torch import nn
from transformers import LlamaConfig

import kvserve.quant
from kvserve.models import default_model_path, load_model
from kvserve.models.loader import weight_bytes
from kvserve.quant import Int4Linear, Int8Linear
from kvserve.quant import gguf as qgguf
from tests.models.conftest import PagedRunner, kernel_type, make_hf_checkpoint, tiny_tokenizer, write_llama_gguf  # noqa: F401

Q = gguf.GGMLQuantizationType
SMALL = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
TOKENS = [5, 17, 42, 99, 7, 250, 3, 64, 128, 11]


def _kquant_rows(qtype, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random Q4_K blocks with sane fp16 d / dmin (gguf-py cannot quantize K types)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    d = rng.uniform(0.001, 0.02, size=(raw.shape[0], 1)).astype(np.float16)
    raw[:, 0:2] = d.view(np.uint8)
    raw[:, 2:4] = (d / 2).view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K])
def test_repack_round_trips_against_gguf_dequantize(qtype):
    rows, cols = 48, 512
    if qtype == Q.Q4_K:
        raw = _kquant_rows(qtype, rows, cols, 0)
    else:
        w = np.random.default_rng(1).standard_normal((rows, cols)).astype(np.float32)
        raw = gguf.quants.quantize(w, qtype)
    qw = qgguf.repack(torch.from_numpy(raw), int(qtype), "blk.0.ffn_up.weight")
    assert (qw.bits, qw.group_size, qw.shape) == (8 if qtype == Q.Q8_0 else 4, 32, (rows, cols))
    assert int(qw.q.max()) < 2**qw.bits
    want = gguf.quants.dequantize(raw, qtype).reshape(rows, cols)
    assert np.abs(want).max() > 0
    assert torch.equal(qw.dequantize(), torch.from_numpy(want.astype(np.float32)))


def test_repack_refuses_other_types_and_bad_rows():
    assert {Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K} == {Q(t) for t in qgguf.REPACKABLE}  # K: test_kquant
    with pytest.raises(ValueError, match="type 6 cannot be kept compressed"):
        qgguf.repack(torch.zeros(4, 22, dtype=torch.uint8), int(Q.Q5_0), "x")
    with pytest.raises(ValueError, match="'blk.1.attn_q.weight': raw blocks have shape"):
        qgguf.repack(torch.zeros(4, 19, dtype=torch.uint8), int(Q.Q4_0), "blk.1.attn_q.weight")


def _logits(lm) -> torch.Tensor:
    runner = PagedRunner(lm.model, lm.hf_config, block_size=4, num_blocks=8)
    return torch.cat([runner.step(TOKENS[:7]), runner.step(TOKENS[7:8], decode=True), runner.step(TOKENS[8:])])


# q/k/v all 4-bit (-> Int4Linear, exercising q/k row un-permutation), gate Q4_1 + up Q8_0 fuse as 8-bit
QTYPES = {"token_embd": Q.Q8_0, "attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q4_0, "attn_output": Q.Q4_1,
          "ffn_gate": Q.Q4_1, "ffn_up": Q.Q8_0, "ffn_down": Q.Q8_0, "output": Q.F16}


def test_gguf_logits_equal_dequantized_model(make_hf_checkpoint, write_llama_gguf, tmp_path):  # noqa: F811
    _, hf = make_hf_checkpoint(LlamaConfig(**SMALL))
    path = write_llama_gguf(hf, tmp_path / "m.gguf", QTYPES)
    packed = load_model(str(path), dtype="float32", quantization="gguf")
    plain = load_model(str(path), dtype="float32", quantization="none")
    layer = packed.model.model.layers[1]
    assert kernel_type(layer.self_attn.qkv_proj) is Int4Linear and kernel_type(layer.self_attn.o_proj) is Int4Linear
    assert kernel_type(layer.mlp.gate_up_proj) is Int8Linear and kernel_type(layer.mlp.down_proj) is Int8Linear
    assert layer.mlp.down_proj.kernel.path == "blocks"  # Q8_0 read in place by the C kernel
    diff = (_logits(packed) - _logits(plain)).abs().max().item()
    print(f"tiny GGUF: max |logit diff| gguf vs none (float32) {diff:.2e}")
    assert diff < 1e-4
    linear_bytes = [sum(weight_bytes(m) for layer in lm.model.model.layers for m in (layer.self_attn, layer.mlp))
                    for lm in (packed, plain)]
    # float32 scale and offset per 32: 4-bit 0.75 B / weight, 8-bit 1.25 B / weight; here a third are 4-bit
    assert linear_bytes[0] < 0.35 * linear_bytes[1]


def test_k_quants_pack_and_other_types_fall_back(make_hf_checkpoint, write_llama_gguf, tmp_path,  # noqa: F811
                                                 caplog):
    cfg = LlamaConfig(**{**SMALL, "intermediate_size": 256})
    _, hf = make_hf_checkpoint(cfg)
    raw = {f"blk.{i}.ffn_down.weight": (_kquant_rows(Q.Q4_K, 64, 256, i), Q.Q4_K) for i in range(2)}
    qtypes = {**QTYPES, "attn_q": Q.F16, "ffn_up": Q.Q5_0}
    path = write_llama_gguf(hf, tmp_path / "k.gguf", qtypes, raw=raw)
    with caplog.at_level(logging.INFO):
        packed = load_model(str(path), dtype="float32", quantization="gguf")
    assert "GGUF linears of type F16, Q5_0 have no compressed kernel" in caplog.text
    layer = packed.model.model.layers[0]
    assert kernel_type(layer.mlp.down_proj) is Int4Linear
    assert kernel_type(layer.self_attn.qkv_proj) is nn.Linear and kernel_type(layer.mlp.gate_up_proj) is nn.Linear  # mixed parts
    plain = load_model(str(path), dtype="float32", quantization="none")
    assert (_logits(packed) - _logits(plain)).abs().max().item() < 1e-4


def test_gguf_default_and_other_methods(make_hf_checkpoint, write_llama_gguf, tmp_path, monkeypatch):  # noqa: F811
    _, hf = make_hf_checkpoint(LlamaConfig(**SMALL))
    path = write_llama_gguf(hf, tmp_path / "m.gguf", QTYPES)
    assert kvserve.quant.GGUF_DEFAULT == "gguf"  # a GGUF file keeps its blocks unless told otherwise
    assert kernel_type(load_model(str(path), dtype="float32").model.model.layers[0].mlp.down_proj) is Int8Linear
    monkeypatch.setattr(kvserve.quant, "GGUF_DEFAULT", "none")
    assert kernel_type(load_model(str(path), dtype="float32").model.model.layers[0].mlp.down_proj) is nn.Linear
    int8 = load_model(str(path), dtype="float32", quantization="int8")
    assert int8.model.model.layers[0].mlp.down_proj.kernel.per_channel
    plain = load_model(str(path), dtype="float32", quantization="none")
    diff = (_logits(int8) - _logits(plain)).abs().max().item()
    assert 0 < diff < 0.05  # requantized to per-channel int8 at load
    with pytest.raises(ValueError, match="kvserve quantize MODEL --method awq"):
        load_model(str(path), quantization="awq")


def _default_or_skip() -> str:
    try:
        return default_model_path()
    except ValueError as e:
        pytest.skip(str(e))


@pytest.mark.slow
def test_default_model_gguf_greedy_tokens_and_memory():
    path = _default_or_skip()
    outs = {}
    for q in ("gguf", "none"):
        lm = load_model(None, dtype="bfloat16", quantization=q)
        prompt = lm.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                                  add_generation_prompt=True, tokenize=False)
        runner = PagedRunner(lm.model, lm.hf_config, block_size=16, num_blocks=8, dtype=torch.bfloat16)
        logits = runner.step(lm.tokenizer(prompt).input_ids)
        tokens = [int(logits[-1].argmax())]
        for _ in range(7):
            tokens.append(int(runner.step(tokens[-1:], decode=True)[-1].argmax()))
        outs[q] = (tokens, weight_bytes(lm.model), lm)
    size = os.path.getsize(path)
    resident = outs["gguf"][1]
    print(f"default model: file {size / 1e6:.1f} MB, resident gguf {resident / 1e6:.1f} MB "
          f"({resident / size:.2f}x), none {outs['none'][1] / 1e6:.1f} MB; tokens {outs['gguf'][0]}")
    gguf_model = outs["gguf"][2].model
    assert kernel_type(gguf_model.model.layers[0].mlp.gate_up_proj) is Int4Linear
    # the tied Q8_0 token table stays in its blocks: the LM head's matmul and the lookups read them
    assert gguf_model.lm_head.kernel is gguf_model.model.embed_tokens.kernel is not None
    assert gguf_model.lm_head.kernel.path == "blocks" and gguf_model.lm_head.weight is None
    assert outs["gguf"][0] == outs["none"][0]
    assert resident < 1.3 * size


def test_self_quantized_gguf_draft_is_the_files_own_blocks(make_hf_checkpoint, write_llama_gguf, tmp_path):  # noqa: F811
    """speculative_config self_quantized with "gguf": the target runs dequantized (-q none), its draft
    is the file's blocks; outputs equal the dequantized model's alone. A target already running the
    blocks is refused by field name."""
    from kvserve import LLM, SamplingParams

    _, hf = make_hf_checkpoint(LlamaConfig(**SMALL))
    path = str(write_llama_gguf(hf, tmp_path / "m.gguf", QTYPES))
    spec = {"method": "self_quantized", "quantization": "gguf", "num_speculative_tokens": 3, "adaptive": False}
    prompts = [TOKENS, TOKENS[::-1], TOKENS[2:] * 2]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outs = []
    for s in (None, spec):
        llm = LLM(model=path, quantization="none", dtype="float32", num_kv_blocks=64, block_size=4,
                  speculative_config=s)
        try:
            outs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
            if s is not None:
                stats = llm.engine.stats()
                assert stats["spec_decode_num_accepted_tokens"] > stats["spec_decode_num_draft_tokens"] // 3
        finally:
            llm.close()
    assert outs[0] == outs[1]
    with pytest.raises(ValueError, match="speculative_config.quantization gguf"):
        LLM(model=path, dtype="float32", num_kv_blocks=16, speculative_config=spec)
