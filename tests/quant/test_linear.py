"""Quantized linear kernels against F.linear on the dequantized weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kvserve.quant.linear as linear_mod
from kvserve.quant.base import QuantizedWeight, quantize_fp8, quantize_rtn
from kvserve.quant.linear import (
    INT4_DEQUANT_MIN_TOKENS,
    INT8_DEQUANT_MIN_TOKENS,
    Fp8Linear,
    Int4Linear,
    Int8Linear,
    _int4_layout,
    _unpack_int4,
    fp8_to_bfloat16,
    quantized_linear,
    scaled_mm_works,
)

N_IN, N_OUT = 128, 96
# 1-D, 3-D (6 rows: a full tile of 4 and a partial one), and 2-D inputs long enough for the
# dequantize-and-matmul paths
SHAPES = [(N_IN,), (2, 3, N_IN), (INT8_DEQUANT_MIN_TOKENS + 1, N_IN), (INT4_DEQUANT_MIN_TOKENS + 4, N_IN)]


@pytest.fixture
def torch_kernels(monkeypatch):
    """Build modules as on a machine without the C blocks kernel: torch's int4 / int8 kernels."""
    monkeypatch.setattr(linear_mod.qmatmul, "supports", lambda *a: False)


def _weight(kind: str, group: int | None, seed: int = 0, n_out: int = N_OUT, n_in: int = N_IN, perm: bool = True):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n_out, n_in, generator=g) * 0.05
    if kind == "fp8":
        return quantize_fp8(w)
    bits = 4 if kind == "int4" else 8
    qw = quantize_rtn(w, bits, group, symmetric=kind == "int8-sym")
    if perm:  # act-order style: stored column j holds input channel perm[j]
        qw.perm = torch.randperm(n_in, generator=g)
    return qw


def _check(module, weight, dtype: torch.dtype, shape: tuple[int, ...], bias: torch.Tensor | None) -> None:
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    y = module(x)
    assert y.dtype == dtype and tuple(y.shape) == (*shape[:-1], weight.shape[0])
    ref = F.linear(x.float(), weight.dequantize(torch.float32), None if bias is None else bias.to(dtype).float())
    err = (y.float() - ref).abs().max().item()
    scale = ref.abs().max().item()
    # float32: only summation order differs; bf16: scales/zeros and the output are rounded to bf16
    assert err <= (2e-6 if dtype == torch.float32 else 2e-2) * scale, f"error {err:.3g} vs max {scale:.3g}"


CASES = [("int4", 32), ("int4", 64), ("int4", 128), ("int8", 32), ("int8", 64), ("int8", None), ("int8-sym", None),
         ("fp8", None)]


@pytest.mark.parametrize("kernels", ["blocks", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind,group", CASES)
def test_kernel_matches_dequantized_weight(kind, group, dtype, kernels, request):
    if kernels == "torch":
        request.getfixturevalue("torch_kernels")
    weight = _weight(kind, group, perm=kind != "fp8")
    bias = torch.randn(N_OUT) * 0.1
    module = quantized_linear(weight, bias, dtype)
    expected = {"int4": Int4Linear, "int8": Int8Linear, "int8-sym": Int8Linear, "fp8": Fp8Linear}[kind]
    assert type(module) is expected
    paths = ("blocks",) if kernels == "blocks" and kind != "fp8" else ("int4 kernel", "int8 kernel", "bf16 via bit shift")
    assert module.path in paths
    for shape in SHAPES:
        _check(module, weight, dtype, shape, bias)
    if module.path == "blocks":  # the blocks kernel at every size, not just below dense_from
        module.dense_from = 1 << 30
        for shape in SHAPES:
            _check(module, weight, dtype, shape, bias)
    # the weight the module applies, perm undone
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(module.dequantize(), weight.dequantize(torch.float32), rtol=tol, atol=tol * 0.05)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n_out,group", [(40, 32), (96, 16)])
def test_shapes_the_int4_kernel_rejects_dequantize_per_call(bits, n_out, group, torch_kernels):
    """out % 16 != 0 or group 16: compact storage dequantized per call, same result."""
    weight = _weight("int4" if bits == 4 else "int8", group, n_out=n_out)
    module = quantized_linear(weight, None, torch.float32)
    assert module.path == "dequantize"
    if bits == 4:
        assert module.codes.shape == (n_out, N_IN // 2)  # two codes per byte
    for shape in SHAPES[:3]:
        _check(module, weight, torch.float32, shape, None)


def test_int4_storage_stays_compressed(torch_kernels):
    weight = _weight("int4", 32, perm=False)
    module = Int4Linear(weight, None, torch.bfloat16)
    nbytes = sum(b.numel() * b.element_size() for b in module.buffers())
    assert nbytes == N_OUT * N_IN // 2 + (N_IN // 32) * N_OUT * 2 * 2  # codes + bf16 scale/zero per group


@pytest.mark.parametrize("bits", [4, 8])
def test_blocks_storage_and_int8_activations(bits):
    """Blocks: codes (4-bit: two per byte) and a float32 scale and offset per 32 weights; with int8
    activations the error is that of rounding each 32-value block of x to 8 bits."""
    weight = _weight("int4" if bits == 4 else "int8", 64, perm=False)
    module = quantized_linear(weight, None, torch.float32)
    assert module.path == "blocks"
    nbytes = sum(b.numel() * b.element_size() for b in module.buffers())
    assert nbytes == N_OUT * N_IN * bits // 8 + N_OUT * (N_IN // 32) * 4 * 2
    module.activations = "int8"
    x = torch.randn(6, N_IN, generator=torch.Generator().manual_seed(1))
    ref = F.linear(x, weight.dequantize())
    rel = float((module(x) - ref).norm() / ref.norm())
    assert 0 < rel < 0.02, rel


@pytest.mark.parametrize("bits", [4, 8])
def test_int16_activations_lay_rows_out_interleaved(bits):
    """Choosing int16 activations interleaves a 4- or 8-bit weight's rows by 8 (the layout its kernel
    reads); outputs, rows of the table and bytes stay those of the row-major weight, and another mode
    lays it back out."""
    weight = _weight("int4" if bits == 4 else "int8", 64, perm=False)
    module = quantized_linear(weight, None, torch.float32)
    codes = module.codes.clone()
    x = torch.randn(5, N_IN, generator=torch.Generator().manual_seed(2))
    ref = F.linear(x, weight.dequantize())
    ids = torch.tensor([3, 0, N_OUT - 1])
    nbytes = sum(b.numel() * b.element_size() for b in module.buffers())
    module.activations = "int16"
    assert module.blocks().interleaved
    assert sum(b.numel() * b.element_size() for b in module.buffers()) == nbytes
    assert float((module(x) - ref).norm() / ref.norm()) < 1e-4
    assert torch.allclose(module.rows(ids), weight.dequantize()[ids], rtol=1e-6, atol=1e-7)
    assert torch.allclose(module.dequantize(), weight.dequantize(), rtol=1e-6, atol=1e-7)
    module.activations = "float32"
    assert not module.blocks().interleaved and torch.equal(module.codes, codes)
    with pytest.raises(ValueError, match="activations must be one of"):
        module.activations = "int4"


def test_int4_layout_is_detected_and_decodes_every_tail():
    """The CPU packing (ISA dependent) is recognised; full 64-row blocks and 16/32/48-row tails decode."""
    layout = _int4_layout()
    assert layout is not None
    for n in (16, 48, 64, 96, 112, 128):
        q = torch.randint(0, 16, (n, 64), generator=torch.Generator().manual_seed(n), dtype=torch.int32)
        packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
        assert torch.equal(_unpack_int4(packed, n, 64, layout), q.t().to(torch.uint8)), n


def test_fp8_bit_shift_is_exact_for_every_code():
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    finite = ~torch.isnan(codes.float())
    assert finite.sum() == 254
    assert torch.equal(fp8_to_bfloat16(codes)[finite], codes.to(torch.bfloat16)[finite])


def test_scaled_mm_path_matches_dequantized_weight_within_fp8_activation_error():
    """The path CUDA sm89+ takes (torch._scaled_mm, per-token fp8 activations), run on this CPU,
    whose torch implements _scaled_mm too: it matches F.linear on the dequantized weight within
    the error of rounding x to e4m3 (~2% relative per element, far less after the sum)."""
    assert scaled_mm_works(torch.device("cpu"))
    weight = _weight("fp8", None)
    bias = torch.randn(N_OUT) * 0.1
    module = Fp8Linear(weight, bias, torch.bfloat16)
    module.path = "_scaled_mm"
    for shape in SHAPES:
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        y = module(x)
        assert y.dtype == torch.bfloat16 and tuple(y.shape) == (*shape[:-1], N_OUT)
        ref = F.linear(x.float(), weight.dequantize(), bias.float())
        rel = float((y.float() - ref).norm() / ref.norm())
        assert 0 < rel < 0.03, rel  # > 0: the activations really were quantized


def test_asymmetric_per_channel_int8_uses_a_rank_one_correction(torch_kernels):
    weight = _weight("int8", None, perm=False)
    module = Int8Linear(weight, None, torch.float32)
    assert not weight.symmetric and module.shift is not None
    assert module.weight_int8.dtype == torch.int8
    _check(module, weight, torch.float32, (3, N_IN), None)


def test_bad_inputs_raise_value_errors():
    int4 = _weight("int4", 32)
    with pytest.raises(ValueError, match="Int8Linear needs an 8-bit weight"):
        Int8Linear(int4, None, torch.float32)
    with pytest.raises(ValueError, match="Int4Linear needs a 4-bit weight"):
        Int4Linear(_weight("int8", 32), None, torch.float32)
    with pytest.raises(ValueError, match="bias has shape"):
        Int4Linear(int4, torch.zeros(3), torch.float32)
    fp8 = _weight("fp8", None)
    fp8.scale = fp8.scale[:5]
    with pytest.raises(ValueError, match="fp8 weight scale has shape"):
        Fp8Linear(fp8, None, torch.float32)
    with pytest.raises(ValueError, match="group_size 48 does not divide"):
        QuantizedWeight(int4.q, int4.scale, int4.offset, 4, 48)
