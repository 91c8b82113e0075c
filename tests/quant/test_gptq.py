"""GPTQ layout (AutoGPTQ v1 / GPTQModel v2 zero points, 4 / 8 bits, g_idx) and the GPTQ quantizer."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import nn

from kvserve.quant.base import LINEAR_SUFFIXES, QuantizedWeight, quantize_fp8, quantize_rtn
from kvserve.quant.calib import LayerInputs, first_layer_inputs, layer_forward
from kvserve.quant.gptq import (
    GPTQMethod,
    Hessian,
    gptq_fp8,
    gptq_layer,
    gptq_quantize,
    pack_gptq,
    rtn_quantize,
    unpack_gptq,
)
from tests.conftest import VOCAB, tiny_config


def tiny_calibrated_model(seed: int = 0, **overrides) -> tuple[nn.Module, LayerInputs]:
    """A tiny random Llama (hidden 64, 2 layers) whose norms have a few outlier channels, as trained LLMs do,
    and the inputs of its first layer for 8 random-token sequences."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", **overrides), dtype=torch.float32).eval()
    model.requires_grad_(False)
    for layer in model.model.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight.mul_(1 + 0.5 * torch.rand(64))
            norm.weight[torch.randperm(64)[:3]] *= 10
    sequences = [torch.randint(3, VOCAB, (48,)).tolist() for _ in range(8)]
    return model, first_layer_inputs(model, sequences)


def rtn_layer(bits: int | str, group_size: int | None) -> Callable[[nn.Module, LayerInputs], None]:
    """Round-to-nearest (base.quantize_rtn, or quantize_fp8 for bits 'fp8') of every linear of a layer, in place."""
    def apply(layer: nn.Module, inputs: LayerInputs) -> None:
        for name, module in layer.named_modules():
            if name.endswith(LINEAR_SUFFIXES):
                qw = quantize_fp8(module.weight) if bits == "fp8" else quantize_rtn(module.weight, bits, group_size)
                module.weight.copy_(qw.dequantize())
    return apply


def layer_error(layer: nn.Module, inputs: LayerInputs, quantize: Callable[[nn.Module, LayerInputs], None]) -> float:
    """Mean squared error of the layer's output after `quantize` (run on a copy) against the float layer."""
    reference = torch.cat(layer_forward(layer, inputs), 1)
    quantized = copy.deepcopy(layer)
    with torch.no_grad():
        quantize(quantized, inputs)
    return float((torch.cat(layer_forward(quantized, inputs), 1) - reference).pow(2).mean())


def ref_pack_gptq(q: torch.Tensor, zeros: torch.Tensor, bits: int, v1: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoGPTQ's packing loops: q [out, in] along the input dim, zeros [groups, out] along out (v1: zero - 1)."""
    per = 32 // bits
    intweight = q.t().to(torch.int64)  # [in, out]
    qweight = torch.zeros(intweight.shape[0] // per, intweight.shape[1], dtype=torch.int64)
    for row in range(qweight.shape[0]):
        for j in range(per):
            qweight[row] |= intweight[row * per + j] << (bits * j)
    z = zeros.to(torch.int64) - (1 if v1 else 0)
    qzeros = torch.zeros(z.shape[0], z.shape[1] // per, dtype=torch.int64)
    for col in range(qzeros.shape[1]):
        for j in range(per):
            qzeros[:, col] |= z[:, col * per + j] << (bits * j)
    wrap = lambda t: torch.where(t >= 2**31, t - 2**32, t).to(torch.int32)
    return wrap(qweight), wrap(qzeros)


def ref_dequant(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """W[o, i] = (q[o, i] - zero[g_idx[i], o]) * scale[g_idx[i], o], with the true (unshifted) zero."""
    return (q.float() - zeros.float()[g_idx].t()) * scales.float()[g_idx].t()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
@pytest.mark.parametrize("act_order", [False, True])
def test_layout_against_reference_formula(bits, fmt, act_order):
    torch.manual_seed(bits)
    out, n_in, g = 16, 64, 16
    maxq = 2**bits - 1
    q = torch.randint(0, maxq + 1, (out, n_in))
    zeros = torch.randint(1, maxq + 1, (n_in // g, out))  # v1 can store 1..2**bits
    scales = (torch.rand(n_in // g, out) + 0.01).half()
    g_idx = torch.arange(n_in) // g
    if act_order:
        g_idx = g_idx[torch.randperm(n_in)]
    qweight, qzeros = ref_pack_gptq(q, zeros, bits, v1=fmt == "gptq")
    tensors = {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx.to(torch.int32)}
    qw = unpack_gptq(tensors, bits, g, fmt)
    assert (qw.perm is not None) == act_order
    torch.testing.assert_close(qw.dequantize(), ref_dequant(q, zeros, scales, g_idx), rtol=0, atol=0)
    if act_order:  # stored columns are sorted by group
        assert torch.equal(g_idx[qw.perm], torch.arange(n_in) // g)
    repacked = pack_gptq(qw, fmt)
    for name, t in tensors.items():
        assert torch.equal(repacked[name], t), name


def test_known_bit_patterns():
    """Low bits first along the input dim; v1 stores zero - 1, v2 the zero itself."""
    out, n_in = 8, 8
    q = torch.arange(8).repeat(out, 1)  # q[o, i] = i
    scale = torch.ones(out, 1)
    sym4 = QuantizedWeight(q.to(torch.uint8), scale, -8 * scale, 4, n_in)
    v1, v2 = pack_gptq(sym4, "gptq"), pack_gptq(sym4, "gptq_v2")
    assert v1["qweight"].shape == (1, 8) and int(v1["qweight"][0, 0]) == 0x76543210
    assert int(v1["qzeros"][0, 0]) == 0x77777777
    assert int(v2["qzeros"][0, 0]) == 0x88888888 - 2**32
    q8 = torch.tensor([[1, 2, 3, 4]] * 4)
    s8 = torch.ones(4, 1)
    p8 = pack_gptq(QuantizedWeight(q8.to(torch.uint8), s8, -128 * s8, 8, 4), "gptq")
    assert int(p8["qweight"][0, 0]) == 0x04030201 and int(p8["qzeros"][0, 0]) == 0x7F7F7F7F


def test_v1_cannot_store_zero_point_zero():
    scale = torch.ones(8, 1)
    qw = QuantizedWeight(torch.zeros(8, 8, dtype=torch.uint8), scale, torch.zeros(8, 1), 4, 8)
    with pytest.raises(ValueError, match="zero point of 0"):
        pack_gptq(qw, "gptq")
    assert torch.equal(unpack_gptq(pack_gptq(qw, "gptq_v2"), 4, 8, "gptq_v2").offset, qw.offset)


def test_method_config_and_convert_errors():
    m = GPTQMethod.from_config({"quant_method": "gptq", "bits": 4, "group_size": 16, "desc_act": True, "sym": True,
                                "checkpoint_format": "gptq"})
    qw = rtn_quantize(torch.randn(16, 32), 4, 16, min_zero=1)
    tensors = pack_gptq(qw)
    torch.testing.assert_close(m.convert("model.layers.0.mlp.up_proj", tensors).dequantize(), qw.dequantize())
    prefix = "model.layers.0.mlp.up_proj"
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.scales"):
        m.convert(prefix, {k: v for k, v in tensors.items() if k != "scales"})
    with pytest.raises(ValueError, match=r"up_proj\.g_idx \(desc_act is true\)"):
        m.convert(prefix, {k: v for k, v in tensors.items() if k != "g_idx"})
    with pytest.raises(ValueError, match=r"up_proj\.qzeros has shape"):
        m.convert(prefix, {**tensors, "qzeros": tensors["qzeros"][:1]})
    with pytest.raises(ValueError, match=r"up_proj\.scales has shape"):
        m.convert(prefix, {**tensors, "scales": tensors["scales"].t()})
    with pytest.raises(ValueError, match="group_size 24 does not divide the input dim 32"):
        GPTQMethod(4, 24).convert(prefix, tensors)
    bad_g_idx = tensors["g_idx"].clone()
    bad_g_idx[0] = 1
    with pytest.raises(ValueError, match=r"g_idx does not give every group"):
        m.convert(prefix, {**tensors, "g_idx": bad_g_idx})
    for cfg, msg in [({"bits": 3}, "bits=3"), ({"checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
                     ({"is_marlin_format": True}, "is_marlin_format"), ({"quant_method": "awq"}, "expected 'gptq'"),
                     ({"group_size": 0}, "group_size"), ({"dynamic": {"-:.*down": {}}}, "dynamic")]:
        with pytest.raises(ValueError, match=msg):
            GPTQMethod.from_config({"quant_method": "gptq", "bits": 4, "group_size": 16, **cfg})


def test_identity_hessian_is_round_to_nearest():
    """With H = I no error is propagated: GPTQ reduces to RTN on the same grid."""
    w = torch.randn(24, 64)
    for sym in (False, True):
        a = gptq_quantize(w, torch.eye(64), 4, 16, sym=sym, min_zero=1)
        b = rtn_quantize(w, 4, 16, sym=sym, min_zero=1)
        assert torch.equal(a.q, b.q) and torch.equal(a.scale, b.scale) and torch.equal(a.offset, b.offset)


def _correlated_inputs(n: int, n_in: int) -> torch.Tensor:
    torch.manual_seed(0)
    mix = torch.randn(n_in, n_in) / n_in**0.5
    scales = torch.logspace(0, 1, n_in)[torch.randperm(n_in)]  # channels of very different energy
    return (torch.randn(n, n_in) + torch.randn(n, 4) @ torch.randn(4, n_in)) @ mix * scales


@pytest.mark.parametrize("bits,sym,act_order", [(4, False, False), (4, True, True), (8, False, True)])
def test_gptq_beats_rtn_on_correlated_inputs(bits, sym, act_order):
    x = _correlated_inputs(512, 128)
    w = torch.randn(48, 128)
    acc = Hessian(128)
    acc.add(x[:200])
    acc.add(x[200:])
    torch.testing.assert_close(acc.value(), 2 * x.t() @ x / 512, rtol=1e-4, atol=1e-3)
    qw = gptq_quantize(w, acc.value(), bits, 32, sym=sym, act_order=act_order, min_zero=0 if sym else 1)
    assert (qw.perm is not None) == act_order
    err = lambda q: float((x @ (w - q.dequantize()).t()).norm())
    gptq_err, rtn_err = err(qw), err(quantize_rtn(w, bits, 32, symmetric=sym))
    assert gptq_err < 0.8 * rtn_err, (gptq_err, rtn_err)
    if act_order:  # the stored order is by descending diag(H)
        assert torch.equal(qw.perm, torch.argsort(torch.diag(acc.value()), descending=True))


def test_dead_input_channel_gets_zero_weight():
    x = torch.randn(64, 32)
    x[:, 5] = 0
    qw = gptq_quantize(torch.randn(8, 32), 2 * x.t() @ x / 64, 4, 16, min_zero=1)
    assert torch.all(qw.dequantize()[:, 5].abs() < 1e-6)


def test_gptq_layer_beats_rtn_on_tiny_llama():
    """Layer output error of layer 0 of a tiny Llama with outlier channels: GPTQ (act-order) < RTN."""
    model, inputs = tiny_calibrated_model()
    layer = model.model.layers[0]
    rtn_err = layer_error(layer, inputs, rtn_layer(4, 32))
    gptq_err = layer_error(layer, inputs, lambda lyr, inp: gptq_layer(
        lyr, inp, lambda w, h: gptq_quantize(w, h, 4, 32, act_order=True, min_zero=1)))
    assert gptq_err < 0.9 * rtn_err, (gptq_err, rtn_err)


def test_gptq_fp8_layer_beats_round_to_nearest_fp8_on_tiny_llama():
    model, inputs = tiny_calibrated_model()
    layer = model.model.layers[0]
    rtn_err = layer_error(layer, inputs, rtn_layer("fp8", None))
    gptq_err = layer_error(layer, inputs, lambda lyr, inp: gptq_layer(lyr, inp, gptq_fp8))
    assert gptq_err < 0.85 * rtn_err, (gptq_err, rtn_err)


def test_gptq_fp8_is_round_to_nearest_without_correlations():
    """H = I propagates no error: the codes and scales are quantize_fp8's, whatever the rounding order."""
    w = torch.randn(24, 64) * 0.1
    w[3, 5] = 7.0  # a row whose absmax saturates the scale
    ref = quantize_fp8(w)
    for act_order in (False, True):
        fw = gptq_fp8(w, torch.eye(64), act_order=act_order)
        assert fw.weight.dtype == torch.float8_e4m3fn
        assert torch.equal(fw.weight.view(torch.uint8), ref.weight.view(torch.uint8))
        assert torch.equal(fw.scale, ref.scale)


def test_gptq_fp8_beats_round_to_nearest_and_never_saturates_to_nan():
    x = _correlated_inputs(512, 128)
    w = torch.randn(48, 128)
    h = 2 * x.t() @ x / 512
    fw = gptq_fp8(w, h)
    assert not torch.isnan(fw.weight.float()).any()  # updated weights beyond 448 x scale saturate
    err = lambda q: float((x @ (w - q.dequantize()).t()).norm())
    assert err(fw) < 0.7 * err(quantize_fp8(w)), (err(fw), err(quantize_fp8(w)))


def test_one_group_per_row_keeps_channel_order_with_act_order():
    """int8 per channel (kvserve's layout has no g_idx): act-order orders the rounding only."""
    x = _correlated_inputs(512, 128)
    w = torch.randn(48, 128)
    h = 2 * x.t() @ x / 512
    qw = gptq_quantize(w, h, 8, None, act_order=True)
    assert qw.perm is None and qw.group_size == 128
    err = lambda q: float((x @ (w - q.dequantize()).t()).norm())
    assert err(qw) < 0.8 * err(quantize_rtn(w, 8, None)), (err(qw), err(quantize_rtn(w, 8, None)))
