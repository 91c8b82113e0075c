"""Loading HF checkpoints with --quantization: int8 / fp8 at load, kvserve's own int8 / fp8
layouts (auto-detected), 'none' as a dequantized reference, and every refusal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from kvserve.models import load_model
from kvserve.quant import Fp8Linear, Int4Linear, Int8Linear, pack_fp8, pack_int8, quant_config
from kvserve.quant.base import linear_prefix, quantize_fp8, quantize_rtn
from tests.conftest import make_tokenizer, tiny_config
from tests.models.conftest import PagedRunner, kernel_type, randomize_

TOKENS = [5, 17, 42, 99, 7, 250, 3, 64, 128, 11]
QUANTIZE = {"int8": lambda w: quantize_rtn(w, 8, None), "fp8": quantize_fp8, "int4": lambda w: quantize_rtn(w, 4, 32)}
PACK = {"int8": pack_int8, "fp8": pack_fp8}


def _save(model, out: Path, state: dict[str, torch.Tensor] | None = None, qc: dict | None = None) -> Path:
    """An HF directory: config.json (+ quantization_config), model.safetensors, tokenizer."""
    out.mkdir(parents=True, exist_ok=True)
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(out)
    if qc is not None:
        cfg = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**cfg, "quantization_config": qc}))
    tensors = {k: v.contiguous() for k, v in (state if state is not None else model.state_dict()).items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, str(out / "model.safetensors"))
    make_tokenizer().save_pretrained(out)
    return out


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def float_ckpt(request, tmp_path_factory):
    """(dir, HF model float32) — Qwen2 has q/k/v biases."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(tiny_config(request.param), dtype=torch.float32,
                                          attn_implementation="eager")
    randomize_(hf, seed=3)
    hf.eval()
    return _save(hf, tmp_path_factory.mktemp(request.param)), hf


def _hf_logits(hf, state: dict[str, torch.Tensor]) -> torch.Tensor:
    ref = type(hf)(hf.config).eval()
    ref.load_state_dict(state)
    with torch.no_grad():
        return ref(torch.tensor([TOKENS])).logits[0].float()


def _our_logits(lm) -> torch.Tensor:
    runner = PagedRunner(lm.model, lm.hf_config, block_size=4, num_blocks=8)
    return torch.cat([runner.step(TOKENS[:7]), runner.step(TOKENS[7:8], decode=True), runner.step(TOKENS[8:])])


def _dequantized_state(hf, method: str) -> dict[str, torch.Tensor]:
    """The HF state dict with every decoder linear replaced by its quantized-then-dequantized weight."""
    return {k: QUANTIZE[method](v).dequantize() if linear_prefix(k) and k.endswith(".weight") else v
            for k, v in hf.state_dict().items()}


def _linears(lm) -> list[nn.Module]:
    return [m for layer in lm.model.model.layers for m in
            (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)]


@pytest.mark.parametrize("method", ["int4", "int8", "fp8"])
def test_quantize_at_load_matches_dequantized_reference(float_ckpt, method):
    path, hf = float_ckpt
    lm = load_model(str(path), dtype="float32", quantization=method)
    kernel = {"int4": Int4Linear, "int8": Int8Linear, "fp8": Fp8Linear}[method]
    assert all(kernel_type(m) is kernel for m in _linears(lm))
    assert lm.model.lm_head.weight.dtype == torch.float32  # the LM head stays in --dtype
    ours = _our_logits(lm)
    ref = _hf_logits(hf, _dequantized_state(hf, method))
    diff = (ours - ref).abs().max().item()
    # the quantization really happened: the float model is much further away
    gap = (_hf_logits(hf, hf.state_dict()) - ref).abs().max().item()
    print(f"{method} at load: max |logit diff| vs dequantized reference {diff:.2e} (float model: {gap:.2e})")
    assert diff < 1e-4 and gap > 50 * diff
    if hf.config.model_type == "qwen2":
        qkv = lm.model.model.layers[1].self_attn.qkv_proj
        want = torch.cat([hf.model.layers[1].self_attn.q_proj.bias, hf.model.layers[1].self_attn.k_proj.bias,
                          hf.model.layers[1].self_attn.v_proj.bias])
        assert torch.equal(qkv.bias, want)


def _write_quantized(hf, out: Path, method: str) -> Path:
    state = {}
    for k, v in hf.state_dict().items():
        prefix = linear_prefix(k)
        if prefix and k.endswith(".weight"):
            state.update({f"{prefix}.{s}": t for s, t in PACK[method](QUANTIZE[method](v)).items()})
        else:
            state[k] = v
    return _save(hf, out, state, quant_config(method))


@pytest.mark.parametrize("method", ["int8", "fp8"])
def test_saved_checkpoint_is_detected_and_none_dequantizes_it(float_ckpt, method, tmp_path):
    path, hf = float_ckpt
    qpath = _write_quantized(hf, tmp_path / method, method)
    stored = load_file(str(qpath / "model.safetensors"))
    assert stored["model.layers.0.mlp.up_proj.weight"].dtype == (torch.int8 if method == "int8"
                                                                  else torch.float8_e4m3fn)
    detected = load_model(str(qpath), dtype="float32")
    assert all(kernel_type(m) is (Int8Linear if method == "int8" else Fp8Linear) for m in _linears(detected))
    at_load = load_model(str(path), dtype="float32", quantization=method)
    torch.testing.assert_close(_our_logits(detected), _our_logits(at_load), rtol=0, atol=1e-5)
    plain = load_model(str(qpath), dtype="float32", quantization="none")
    assert all(kernel_type(m) is nn.Linear for m in _linears(plain))
    ref = _hf_logits(hf, _dequantized_state(hf, method))
    assert (_our_logits(plain) - ref).abs().max().item() < 1e-4
    agreeing = load_model(str(qpath), dtype="float32", quantization=method)
    assert all(kernel_type(m) is kernel_type(detected.model.model.layers[0].mlp.down_proj) for m in _linears(agreeing))


def test_none_and_default_on_a_float_checkpoint_load_plain_linears(float_ckpt):
    path, _ = float_ckpt
    for q in (None, "none"):
        assert all(kernel_type(m) is nn.Linear for m in _linears(load_model(str(path), dtype="float32", quantization=q)))


@pytest.fixture(scope="module")
def int8_ckpt(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=torch.float32)
    randomize_(hf, seed=4)
    return _write_quantized(hf, tmp_path_factory.mktemp("int8"), "int8")


def _variant(src: Path, out: Path, edit_state=None, edit_qc=None) -> Path:
    """A copy of checkpoint `src` with its tensors and/or quantization_config edited."""
    out.mkdir()
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            (out / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((src / "config.json").read_text())
    if edit_qc is not None:
        cfg["quantization_config"] = edit_qc(dict(cfg.get("quantization_config") or {}))
    (out / "config.json").write_text(json.dumps(cfg))
    state = load_file(str(src / "model.safetensors"))
    save_file(edit_state(state) if edit_state else state, str(out / "model.safetensors"))
    return out


def test_refusals_name_the_problem(float_ckpt, int8_ckpt, tmp_path):
    path, _ = float_ckpt
    for method in ("awq", "gptq"):
        with pytest.raises(ValueError, match=f"kvserve quantize MODEL --method {method} --out DIR"):
            load_model(str(path), quantization=method)
    with pytest.raises(ValueError, match="--quantization gguf needs a GGUF file"):
        load_model(str(path), quantization="gguf")
    with pytest.raises(ValueError, match=r"--quantization gptq contradicts the checkpoint's quantization_config "
                                         r"\(quant_method 'int8'\)"):
        load_model(str(int8_ckpt), quantization="gptq")
    with pytest.raises(ValueError, match=r"--quantization fp8 contradicts .*'int8'"):
        load_model(str(int8_ckpt), quantization="fp8")
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_model(str(path), quantization="int3")


def test_malformed_quantized_checkpoints(int8_ckpt, tmp_path):
    cases = {
        "no_scale": (lambda s: {k: v for k, v in s.items() if k != "model.layers.1.mlp.up_proj.weight_scale"},
                     None, r"tensor model\.layers\.1\.mlp\.up_proj\.weight_scale is missing"),
        "no_linear": (lambda s: {k: v for k, v in s.items() if not k.startswith("model.layers.0.self_attn.k_proj")},
                      None, r"missing weight tensor model\.layers\.0\.self_attn\.k_proj\.weight"),
        "extra": (lambda s: {**s, "model.layers.0.mlp.down_proj.input_scale": torch.ones(1)},
                  None, r"unexpected checkpoint tensor 'model\.layers\.0\.mlp\.down_proj\.input_scale'"),
        "float_codes": (lambda s: {**s, "model.layers.0.mlp.down_proj.weight":
                                   s["model.layers.0.mlp.down_proj.weight"].float()},
                        None, r"tensor model\.layers\.0\.mlp\.down_proj\.weight has dtype torch\.float32"),
        "bad_shape": (lambda s: {**s, "model.layers.0.mlp.down_proj.weight_scale": torch.ones(3)},
                      None, r"model\.layers\.0\.mlp\.down_proj\.weight_scale has shape \(3,\)"),
        "group": (None, lambda qc: {**qc, "group_size": 128}, "int8 quantization_config field 'group_size'"),
        "method": (None, lambda qc: {**qc, "quant_method": "bitsandbytes"}, "unsupported quant_method 'bitsandbytes'"),
    }
    for name, (edit_state, edit_qc, match) in cases.items():
        bad = _variant(int8_ckpt, tmp_path / name, edit_state, edit_qc)
        with pytest.raises(ValueError, match=match):
            load_model(str(bad), dtype="float32")


def test_linears_are_never_allocated_in_full_precision(float_ckpt):
    """The placeholders go in on the meta device: after allocation the decoder holds no linear weight."""
    from kvserve.models.loader import _build
    from kvserve.quant import hf_plan

    _, hf = float_ckpt
    net, installer = _build(hf.config, torch.float32, "cpu", hf_plan("int8", hf.config))
    allocated = [n for n, _ in net.named_parameters() if n.startswith("model.layers.") and n.endswith(".weight")
                 and "norm" not in n]
    assert allocated == [] and installer is not None
    linear = sum(v.numel() for k, v in hf.state_dict().items() if linear_prefix(k) and k.endswith(".weight"))
    assert sum(p.numel() for p in net.parameters()) == sum(p.numel() for p in hf.parameters()) - linear


def test_fused_parts_of_different_bits_and_groups_fuse_exactly():
    """GGUF mixes types inside q/k/v and gate/up: 4-bit codes become 8-bit codes, groups split."""
    from kvserve.quant import _harmonize
    from kvserve.quant.base import cat_rows

    g = torch.Generator().manual_seed(0)
    parts = [quantize_rtn(torch.randn(32, 128, generator=g), 4, 128), quantize_rtn(torch.randn(16, 128, generator=g),
                                                                                   8, 32)]
    fused = cat_rows(_harmonize(parts))
    assert (fused.bits, fused.group_size) == (8, 32)
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))


def test_symmetric_int8_checkpoint_without_zero_points(float_ckpt, tmp_path):
    """"sym": true int8 checkpoints (no weight_zero_point) load as codes times scale; asymmetric ones need
    their zero points."""
    _, hf = float_ckpt
    state, ref = {}, {}
    for k, v in hf.state_dict().items():
        prefix = linear_prefix(k)
        if prefix and k.endswith(".weight"):
            qw = quantize_rtn(v, 8, None, symmetric=True)
            packed = PACK["int8"](qw)
            state.update({f"{prefix}.weight": packed["weight"], f"{prefix}.weight_scale": packed["weight_scale"]})
            ref[k] = qw.dequantize()
        else:
            state[k] = ref[k] = v
    qpath = _save(hf, tmp_path / "sym", state, {**quant_config("int8"), "sym": True})
    assert (_our_logits(load_model(str(qpath), dtype="float32")) - _hf_logits(hf, ref)).abs().max().item() < 1e-4
    asym = _save(hf, tmp_path / "asym", state, quant_config("int8"))
    with pytest.raises(ValueError, match="weight_zero_point"):
        load_model(str(asym), dtype="float32")


@pytest.mark.parametrize("method", ["int4", "int8"])
def test_quantize_lm_head_rounds_the_head_and_keeps_the_embedding(float_ckpt, method):
    """A self_quantized draft's LM head (kvserve.quant.quantize_lm_head): the logits are those of the
    rounded table; token lookups keep the float embedding."""
    from kvserve.quant import quantize_lm_head

    path, hf = float_ckpt
    lm = load_model(str(path), dtype="float32", quantization=method)
    head = lm.model.lm_head
    table = (head.weight if head.weight is not None else lm.model.model.embed_tokens.weight).detach().clone()
    hidden = torch.randn(3, table.shape[1], generator=torch.Generator().manual_seed(0))
    assert quantize_lm_head(lm.model, method, torch.float32, "cpu")
    assert head.kernel is not None and lm.model.model.embed_tokens.weight is not None
    rounded = QUANTIZE[method](table).dequantize() if method == "int4" else quantize_rtn(table, 8, None).dequantize()
    torch.testing.assert_close(lm.model.compute_logits(hidden), hidden @ rounded.T, rtol=0, atol=1e-4)
    assert not quantize_lm_head(lm.model, method, torch.float32, "cpu")  # already compressed: nothing to do
