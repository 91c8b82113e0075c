"""AWQ GEMM layout (AutoAWQ's interleaved packing) and the activation-aware quantizer."""

from __future__ import annotations

import copy

import pytest
import torch

from kvserve.quant.awq import AWQMethod, apply_scale, awq_layer, pack_awq, search_clip, unpack_awq
from kvserve.quant.base import QuantizedWeight, quantize_rtn
from kvserve.quant.calib import layer_forward
from tests.quant.test_gptq import layer_error, rtn_layer, tiny_calibrated_model

ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ WQLinear_GEMM.from_linear


def ref_pack_awq(intweight: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's loop: intweight [rows, cols] -> int32 [rows, cols / 8], slot i of column c = col 8c + order_map[i]."""
    packed = torch.zeros(intweight.shape[0], intweight.shape[1] // 8, dtype=torch.int64)
    for col in range(packed.shape[1]):
        for i in range(8):
            packed[:, col] |= intweight[:, col * 8 + ORDER_MAP[i]].to(torch.int64) << (i * 4)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def test_layout_against_autoawq_packing():
    torch.manual_seed(0)
    out, n_in, g = 32, 64, 16
    q = torch.randint(0, 16, (out, n_in))
    zeros = torch.randint(0, 16, (out, n_in // g))
    scales = (torch.rand(out, n_in // g) + 0.01).half().float()
    qw = QuantizedWeight(q.to(torch.uint8), scales, -zeros * scales, 4, g)
    packed = pack_awq(qw)
    assert torch.equal(packed["qweight"], ref_pack_awq(q.t()))  # [in, out / 8]
    assert torch.equal(packed["qzeros"], ref_pack_awq(zeros.t()))  # [in / g, out / 8]
    assert packed["scales"].dtype == torch.float16 and packed["scales"].shape == (n_in // g, out)
    back = unpack_awq(packed, g)
    # W[o, i] = (q - z) * s, the formula AutoAWQ's kernels compute
    expected = (q - zeros.repeat_interleave(g, 1)).float() * scales.repeat_interleave(g, 1)
    torch.testing.assert_close(back.dequantize(), expected, rtol=0, atol=0)
    assert torch.equal(back.q, qw.q) and torch.equal(back.offset, qw.offset)


def test_known_bit_pattern():
    """Outputs 0..7 holding q = 0..7 pack to 0x75316420: slot k holds output ORDER_MAP[k]."""
    q = torch.arange(8)[:, None].repeat(1, 8)  # q[o, i] = o
    scale = torch.ones(8, 1)
    packed = pack_awq(QuantizedWeight(q.to(torch.uint8), scale, -3 * scale, 4, 8))
    assert packed["qweight"].shape == (8, 1) and int(packed["qweight"][0, 0]) == 0x75316420
    assert int(packed["qzeros"][0, 0]) == 0x33333333


def test_pack_rejects_what_awq_cannot_hold():
    w = torch.randn(8, 16)
    with pytest.raises(ValueError, match="4-bit"):
        pack_awq(quantize_rtn(w, 8, 8))
    qw = quantize_rtn(w, 4, 8)
    with pytest.raises(ValueError, match="act-order"):
        pack_awq(QuantizedWeight(qw.q, qw.scale, qw.offset, 4, 8, torch.arange(16)))
    with pytest.raises(ValueError, match="integer zero point"):
        pack_awq(QuantizedWeight(qw.q, qw.scale, qw.offset + 0.3 * qw.scale, 4, 8))


def test_method_config_and_convert_errors():
    assert AWQMethod.from_config({"quant_method": "awq", "w_bit": 4, "q_group_size": 32, "zero_point": True,
                                  "version": "GEMM"}).group_size == 32
    for cfg, msg in [({"bits": 8}, "bits=8"), ({"version": "gemv"}, "version='gemv'"),
                     ({"version": "marlin"}, "only AWQ 'gemm'"), ({"zero_point": False}, "zero_point=false"),
                     ({"group_size": -5}, "group_size"), ({"quant_method": "gptq"}, "expected 'awq'")]:
        with pytest.raises(ValueError, match=msg):
            AWQMethod.from_config({"quant_method": "awq", "bits": 4, "group_size": 32, **cfg})
    m = AWQMethod(16)
    qw = quantize_rtn(torch.randn(16, 32), 4, 16)
    tensors = pack_awq(qw)
    prefix = "model.layers.1.self_attn.o_proj"
    torch.testing.assert_close(m.convert(prefix, tensors).dequantize(), unpack_awq(tensors, 16).dequantize())
    with pytest.raises(ValueError, match=r"missing model\.layers\.1\.self_attn\.o_proj\.qzeros"):
        m.convert(prefix, {k: v for k, v in tensors.items() if k != "qzeros"})
    with pytest.raises(ValueError, match=r"o_proj\.scales has shape \(16, 16\), expected \(2, 16\)"):
        m.convert(prefix, {**tensors, "scales": torch.ones(16, 16, dtype=torch.float16)})
    with pytest.raises(ValueError, match=r"o_proj\.qweight must be a 2-D int32"):
        m.convert(prefix, {**tensors, "qweight": tensors["qweight"].float()})
    with pytest.raises(ValueError, match="group_size 48 does not divide the input dim 32"):
        AWQMethod(48).convert(prefix, tensors)
    with pytest.raises(ValueError, match=r"unexpected tensors .*o_proj\.weight"):
        m.convert(prefix, {**tensors, "weight": torch.zeros(16, 32)})


@pytest.mark.parametrize("kv_heads", [2, 4])  # 4: no GQA, so v_proj -> o_proj is scaled too
def test_scale_folding_keeps_the_float_layer(kv_heads):
    model, inputs = tiny_calibrated_model(num_key_value_heads=kv_heads)
    layer = copy.deepcopy(model.model.layers[0])
    reference = layer_forward(layer, inputs)
    attn, mlp = layer.self_attn, layer.mlp
    s = torch.rand(64) + 0.5
    with torch.no_grad():
        apply_scale(layer.input_layernorm, [attn.q_proj, attn.k_proj, attn.v_proj], s)
        apply_scale(mlp.up_proj, [mlp.down_proj], torch.rand(128) + 0.5)
        if kv_heads == 4:
            apply_scale(attn.v_proj, [attn.o_proj], s)
    for a, b in zip(layer_forward(layer, inputs), reference):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_clip_search_never_worse_than_no_clip():
    torch.manual_seed(0)
    w, x = torch.randn(32, 64), torch.randn(300, 64)
    w[:, 3] *= 6  # an outlier weight per row makes shrinking pay off
    bound = search_clip(w, x, 4, 32)
    assert bound.shape == (32, 2) and torch.all(bound <= w.abs().reshape(32, 2, 32).amax(-1) + 1e-6)
    err = lambda q: float((x @ (w - q.dequantize()).t()).pow(2).sum())
    assert err(quantize_rtn(w, 4, 32, clip=bound)) < err(quantize_rtn(w, 4, 32))


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_awq_layer_beats_rtn_on_tiny_llama(kv_heads):
    """Layer output error of layer 0 (outlier norm channels, random tokens): AWQ < RTN at 4 bits, group 32."""
    model, inputs = tiny_calibrated_model(num_key_value_heads=kv_heads)
    layer = model.model.layers[0]
    rtn_err = layer_error(layer, inputs, rtn_layer(4, 32))
    results = {}
    awq_err = layer_error(layer, inputs, lambda lyr, inp: results.update(awq_layer(lyr, inp, 32)))
    assert awq_err < 0.7 * rtn_err, (awq_err, rtn_err)
    assert len(results) == 7 and all(qw.bits == 4 and qw.group_size == 32 for qw in results.values())


def test_awq_layer_leaves_the_checkpoint_weights_in_place():
    model, inputs = tiny_calibrated_model()
    layer = model.model.layers[0]
    results = awq_layer(layer, inputs, 32)
    for name, qw in results.items():
        assert torch.equal(layer.get_submodule(name).weight, qw.dequantize()), name
        torch.testing.assert_close(unpack_awq(pack_awq(qw), 32).dequantize(), qw.dequantize(), rtol=2e-3, atol=1e-4)
