"""Mixtral GGUF files (llama.cpp's layout: a "llama" file with experts) against transformers.

The reference is the HF model the file was written from (with the experts a quantized file
holds): transformers' own GGUF loader (5.x) reads such a file as a LlamaForCausalLM, drops
the expert tensors and initializes a random dense MLP, so it cannot serve as one."""

from __future__ import annotations

import copy
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from kvserve.models import load_model
from kvserve.models.loader import open_checkpoint
from tests.models.conftest import _permute, add_gguf_llama_header, add_gguf_tokenizer, randomize_

Q = gguf.GGMLQuantizationType
E, I, LAYERS = 4, 64, 2
TOKENS = [5, 17, 42, 99, 7, 250, 3, 64, 128, 11, 200, 31, 77, 150, 9]
# GGUF tensor kind -> type; llama-quantize keeps norms and the router (ffn_gate_inp) in F32.
F32 = {}
QUANT = {"ffn_gate_exps": Q.Q8_0, "ffn_up_exps": Q.Q4_0, "ffn_down_exps": Q.Q8_0}
_ATTN = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}


def _hf_mixtral(vocab_size: int):
    from transformers import AutoModelForCausalLM, MixtralConfig

    config = MixtralConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=I, num_hidden_layers=LAYERS,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                           rms_norm_eps=1e-5, num_experts_per_tok=2, num_local_experts=E, rope_theta=1e6,
                           sliding_window=None)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    randomize_(hf)
    return hf.eval()


def _gguf_tensors(hf) -> dict[str, np.ndarray]:
    """llama.cpp's convert_hf_to_gguf for a Mixtral: q/k rows permuted, experts stacked [E, out, in]."""
    cfg, sd = hf.config, {k: v.float().numpy() for k, v in hf.state_dict().items()}
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"],
           "output.weight": sd["lm_head.weight"]}
    for n in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{n}.", f"blk.{n}."
        for hf_proj, g in _ATTN.items():
            out[f"{b}{g}.weight"] = sd[f"{p}self_attn.{hf_proj}.weight"]
        out[f"{b}attn_q.weight"] = _permute(out[f"{b}attn_q.weight"], cfg.num_attention_heads)
        out[f"{b}attn_k.weight"] = _permute(out[f"{b}attn_k.weight"], cfg.num_key_value_heads)
        out[f"{b}attn_norm.weight"] = sd[f"{p}input_layernorm.weight"]
        out[f"{b}ffn_norm.weight"] = sd[f"{p}post_attention_layernorm.weight"]
        out[f"{b}ffn_gate_inp.weight"] = sd[f"{p}mlp.gate.weight"]  # the router [E, H]
        gate_up = sd[f"{p}mlp.experts.gate_up_proj"]  # [E, 2I, H]: gate rows, then up rows
        out[f"{b}ffn_gate_exps.weight"] = gate_up[:, :I]
        out[f"{b}ffn_up_exps.weight"] = gate_up[:, I:]
        out[f"{b}ffn_down_exps.weight"] = sd[f"{p}mlp.experts.down_proj"]  # [E, H, I]
    return out


def _write(hf, tokenizer, path: Path, qtypes: dict[str, Q], per_expert: bool = False) -> Path:
    """A Mixtral GGUF; per_expert: the older layout, one `ffn_gate.E` tensor per expert."""
    cfg = hf.config
    w = gguf.GGUFWriter(str(path), "llama")
    add_gguf_llama_header(w, cfg, 4 * cfg.hidden_size)  # llama.cpp writes the dense width: must not be used
    w.add_expert_count(cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    add_gguf_tokenizer(w, tokenizer)
    for name, arr in _gguf_tensors(hf).items():
        kind = name.split(".")[-2]
        qtype = qtypes.get(kind, Q.F32)
        if per_expert and kind.endswith("_exps"):
            for e in range(arr.shape[0]):
                w.add_tensor(name.replace("_exps.", f".{e}."), gguf.quants.quantize(arr[e], qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, gguf.quants.quantize(np.ascontiguousarray(arr), qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _dequantized_reference(hf, qtypes: dict[str, Q]):
    """The HF model with its experts replaced by what the quantized GGUF file holds."""
    ref = copy.deepcopy(hf)
    with torch.no_grad():
        for layer in ref.model.layers:
            ex = layer.mlp.experts
            rt = {}
            for kind, t in (("ffn_gate_exps", ex.gate_up_proj[:, :I]), ("ffn_up_exps", ex.gate_up_proj[:, I:]),
                            ("ffn_down_exps", ex.down_proj)):
                q = qtypes.get(kind, Q.F32)
                rt[kind] = gguf.quants.dequantize(gguf.quants.quantize(t.detach().numpy().copy(), q), q).reshape(t.shape)
            ex.gate_up_proj.copy_(torch.from_numpy(np.concatenate([rt["ffn_gate_exps"], rt["ffn_up_exps"]], 1)))
            ex.down_proj.copy_(torch.from_numpy(rt["ffn_down_exps"]))
    return ref


def _run(model, config, paged_runner) -> torch.Tensor:
    """Prefill TOKENS[:12], then decode the rest one by one: logits [15, vocab]."""
    runner = paged_runner(model, config)
    out = [runner.step(TOKENS[:12])] + [runner.step([t], decode=True) for t in TOKENS[12:]]
    return torch.cat(out)


@pytest.mark.parametrize("layout,qtypes", [("stacked", F32), ("per_expert", F32), ("stacked", QUANT)],
                         ids=["stacked-f32", "per_expert-f32", "stacked-q8_0-q4_0"])
def test_mixtral_gguf_matches_transformers(layout, qtypes, tiny_tokenizer, paged_runner, tmp_path):
    hf = _hf_mixtral(len(tiny_tokenizer))
    path = _write(hf, tiny_tokenizer, tmp_path / "mixtral.gguf", qtypes, per_expert=layout == "per_expert")
    lm = load_model(str(path), dtype="float32")
    cfg = lm.hf_config
    assert type(lm.model).__name__ == "MixtralForCausalLM" and cfg.architectures == ["MixtralForCausalLM"]
    assert (cfg.num_local_experts, cfg.num_experts_per_tok, cfg.intermediate_size) == (E, 2, I)
    assert cfg.num_hidden_layers == LAYERS and cfg.sliding_window is None and not cfg.tie_word_embeddings

    ref = _dequantized_reference(hf, qtypes) if qtypes else hf
    ours = dict(lm.model.named_parameters())
    want = ref.model.layers[1].mlp
    assert torch.equal(ours["model.layers.1.mlp.experts.w13"], want.experts.gate_up_proj)  # [E, 2I, H]: w1 then w3
    assert torch.equal(ours["model.layers.1.mlp.experts.w2"], want.experts.down_proj)
    assert torch.equal(ours["model.layers.1.mlp.gate.weight"], want.gate.weight)
    if qtypes:  # the quantization really moved the experts (so the reference had to follow)
        assert not torch.equal(want.experts.down_proj, hf.model.layers[1].mlp.experts.down_proj)

    logits = _run(lm.model, cfg, paged_runner)
    with torch.no_grad():
        expected = ref(torch.tensor([TOKENS])).logits[0]
    assert expected.std() > 0.3
    assert (logits - expected).abs().max().item() < 1e-4

    count, weights = open_checkpoint(str(path)).weights()
    assert count == len(list(weights)) == 3 + LAYERS * (7 + 3 * E)  # the progress bar's total


def test_mixtral_gguf_greedy_generate_matches_transformers(tiny_tokenizer, tmp_path):
    from kvserve import LLM, SamplingParams
    from tests.conftest import assert_greedy_parity, hf_greedy

    hf = _hf_mixtral(len(tiny_tokenizer))
    path = _write(hf, tiny_tokenizer, tmp_path / "mixtral.gguf", QUANT)
    ref = _dequantized_reference(hf, QUANT)
    prompts = [TOKENS[:7], TOKENS[3:15], [42]]
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64)
    try:
        ours = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, logprobs=5, ignore_eos=True),
                            use_tqdm=False)
    finally:
        llm.close()
    assert_greedy_parity(ours, hf_greedy(ref, prompts, 8))


def test_stacked_experts_of_the_wrong_count_are_named(tiny_tokenizer, tmp_path):
    hf = _hf_mixtral(len(tiny_tokenizer))
    hf.config.num_local_experts = E + 1  # the metadata claims one expert more than the tensors hold
    path = _write(hf, tiny_tokenizer, tmp_path / "bad.gguf", F32)
    with pytest.raises(ValueError, match=r"tensor 'blk\.0\.ffn_gate_exps\.weight' has shape \[64, 64, 4\], "
                                         r"expected \[in, out, 5\] \(expert_count\)"):
        load_model(str(path), dtype="float32")
