"""The Triton GEMM over compact group codes (kvserve/quant/triton_matmul.py), through the
Int4Linear / Int8Linear "triton" path, against F.linear on the dequantized weight in float32.
In Triton's interpreter on the CPU (TRITON_INTERPRET=1, which tests/conftest.py sets unless
told otherwise; the path is then built only when asked, TRITON_ON_CPU); compiled on CUDA with
TRITON_INTERPRET=0."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

import kvserve.quant.linear as linear_mod
from kvserve.config import triton_interpreting as interpreting
from kvserve.quant import triton_matmul
from kvserve.quant.base import quantize_rtn
from kvserve.quant.linear import Int4Linear, Int8Linear, quantized_linear

if not interpreting() and not torch.cuda.is_available():
    pytest.skip("compiled Triton kernels need CUDA (TRITON_INTERPRET=0 and no GPU)", allow_module_level=True)
DEVICE = "cpu" if interpreting() else "cuda"


@pytest.fixture
def triton_on_cpu(monkeypatch):
    """Build the "triton" path on a CPU too (interpreter); CUDA takes it anyway."""
    monkeypatch.setattr(linear_mod, "TRITON_ON_CPU", True)


def _weight(bits: int, group: int | None, n: int, k: int, symmetric: bool, perm: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    qw = quantize_rtn(torch.randn(n, k, generator=g) * 0.05, bits, group, symmetric=symmetric)
    if perm:  # act-order: stored column j holds input channel perm[j]
        qw.perm = torch.randperm(k, generator=g)
    return qw


# bits, symmetric, group (None: one per output channel), N, K, M, dtype. Odd N everywhere (masked
# N tiles); M 1 / 5 decode tiles, 17 / 64 the middle ones, 300 prefill tiles; group 128 > the prefill BLOCK_K of 64 (two
# tiles per group); group 16 the smallest tile; per channel with K off the tile (masked K tail)
# and K odd (4-bit codes then stay one per byte).
CASES = [
    (4, False, 32, 40, 96, 1, torch.float32),
    (4, True, 32, 72, 160, 17, torch.bfloat16),
    (4, False, 64, 72, 192, 5, torch.bfloat16),
    (4, False, 128, 40, 256, 64, torch.float32),
    (4, True, 128, 72, 384, 1, torch.bfloat16),
    (4, False, None, 40, 200, 5, torch.float32),
    (4, True, None, 72, 97, 17, torch.bfloat16),
    (4, False, 64, 40, 128, 5, torch.float16),
    (8, False, 16, 40, 96, 17, torch.float32),
    (8, False, 32, 72, 160, 64, torch.bfloat16),
    (8, True, 64, 40, 192, 1, torch.float32),
    (8, False, 128, 72, 256, 17, torch.float32),
    (8, False, None, 40, 200, 1, torch.bfloat16),
    (8, True, None, 72, 96, 64, torch.float32),
    (4, False, 64, 40, 128, 300, torch.float32),  # past 256 rows: the prefill tiles
]


@pytest.mark.parametrize("bits,symmetric,group,n,k,m,dtype", CASES)
def test_kernel_matches_dequantized_weight(bits, symmetric, group, n, k, m, dtype, triton_on_cpu):
    qw = _weight(bits, group, n, k, symmetric, perm=bits == 4, seed=n + k + m)
    module = (Int4Linear if bits == 4 else Int8Linear)(qw, None, dtype, DEVICE)
    assert module.path == "triton"
    assert module.codes.dtype == torch.uint8 and module.codes.shape == (n, k // 2 if bits == 4 and k % 2 == 0 else k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
    y = module(x.to(DEVICE)).cpu()
    assert y.dtype == dtype and y.shape == (m, n)
    ref = F.linear(x.float(), qw.dequantize())
    err = (y.float() - ref).abs().max().item()
    scale = ref.abs().max().item()
    # float32: summation order only (ieee dot, no tf32); fp16 / bf16: the output rounding
    assert err <= (1e-5 if dtype == torch.float32 else 1e-2) * scale, f"error {err:.3g} vs max {scale:.3g}"
    torch.testing.assert_close(module.dequantize().cpu(), qw.dequantize())


@pytest.mark.parametrize("bits,group", [(4, 32), (8, 64), (8, None)])
def test_triton_path_matches_the_default_cpu_path(bits, group, monkeypatch):
    """Same weight, bias, act-order permutation and 3-D input: the CPU default (C / torch kernels)
    and the module built for the Triton path agree; the CPU default is untouched by the flag's absence."""
    qw = _weight(bits, group, 72, 128, symmetric=False, perm=True, seed=bits)
    bias = torch.randn(72, generator=torch.Generator().manual_seed(2)) * 0.1
    default = quantized_linear(qw, bias, torch.float32)
    assert default.path != "triton"
    monkeypatch.setattr(linear_mod, "TRITON_ON_CPU", True)
    module = quantized_linear(qw, bias, torch.float32, DEVICE)
    assert module.path == "triton"
    for shape in ((128,), (2, 3, 128), (0, 128), (40, 128)):
        x = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
        y = module(x.to(DEVICE)).cpu()
        assert y.shape == (*shape[:-1], 72)
        torch.testing.assert_close(y, default(x), rtol=1e-5, atol=1e-5)


def test_groups_the_kernel_cannot_tile_fall_back(triton_on_cpu):
    """tl.dot needs K tiles of 16 inside one group: group 8 is dequantized per call instead."""
    assert not triton_matmul.supports(96, 8) and triton_matmul.supports(96, 96)
    module = Int4Linear(_weight(4, 8, 40, 96, symmetric=False, perm=False, seed=0), None, torch.float32, DEVICE)
    assert module.path != "triton"
    with pytest.raises(ValueError, match="group_size % 16"):
        triton_matmul.matmul(torch.zeros(1, 96), torch.zeros(40, 48, dtype=torch.uint8), torch.zeros(40, 12),
                             torch.zeros(40, 12), 8)


@pytest.mark.parametrize("bits", [4, 8])
def test_rows_dequantize_only_the_rows_asked_for(bits, triton_on_cpu):
    """A quantized embedding's lookup on the compact paths (CUDA): the rows, not the whole table."""
    qw = _weight(bits, 32, 40, 96, symmetric=False, perm=False, seed=bits)
    module = (Int4Linear if bits == 4 else Int8Linear)(qw, None, torch.float32, DEVICE)
    ids = torch.tensor([[3, 0], [39, 3]], device=DEVICE)
    torch.testing.assert_close(module.rows(ids).cpu(), qw.dequantize()[ids.reshape(-1).cpu()])
