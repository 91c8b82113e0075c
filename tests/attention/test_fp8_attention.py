"""The torch backend with a float8 e4m3 KV cache (kv_cache_dtype fp8).

Two references: attention over exactly the K/V an fp8 cache holds (codes * scale), which the
backend must match to float32 rounding, and attention over a float32 cache, which it must
match within the fp8 quantization error stated below.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvserve.attention import FP8, AttentionMetadata, get_backend, quantize_fp8
from kvserve.kernels import paged_attention

BS, HQ, HKV, D = 4, 8, 2, 16
K_SCALE, V_SCALE = 2.0**-2, 2.0**-3  # powers of two, as the runner calibrates them
# Stated tolerance against a float32 cache. fp8 e4m3 keeps 3 mantissa bits: each K/V element is
# off by up to 2^-4 relative (6.25%), ~2.6% RMS. On these inputs (scores of std ~1, outputs up to
# ~5) the attention output's relative RMS error measured 2.2-2.6% over 20 seeds and its worst
# element 2-6% of the largest output; the bounds leave room for the seeds not measured.
FP8_REL_RMS = 0.04
FP8_MAX_ERR = 0.10  # times max |output|


def reference(q, k, v, scale):
    """Causal attention of the last q.shape[0] positions over the full k/v (float32)."""
    L, Q = k.shape[0], q.shape[0]
    k = k.float().repeat_interleave(HQ // HKV, 1)
    v = v.float().repeat_interleave(HQ // HKV, 1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    qpos = torch.arange(L - Q, L)[:, None]
    s = s.masked_fill(torch.arange(L)[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


def fp8_roundtrip(x: torch.Tensor, scale: float) -> torch.Tensor:
    return quantize_fp8(x, scale).float() * scale


def _batch(seed: int, dtype: torch.dtype, cache_dtype: torch.dtype):
    """A mixed batch: 5 decodes, a fresh prefill, two prefill chunks over cached context.

    Returns (q, k_new, v_new, caches, meta, per-request (q, full k, full v, cached context)).
    """
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks = 64
    kc = torch.zeros(num_blocks, BS, HKV, D, dtype=cache_dtype)
    vc = torch.zeros(num_blocks, BS, HKV, D, dtype=cache_dtype)
    free = list(range(num_blocks))
    rng.shuffle(free)
    shapes = [(rng.randrange(1, 40), 1) for _ in range(5)] + [(0, 9), (13, 5), (7, 6)]
    reqs, tables, qsl, slots = [], [], [0], []
    for ctx, new in shapes:
        n = ctx + new
        blocks = [free.pop() for _ in range(-(-n // BS))]
        k, v = torch.randn(n, HKV, D).to(dtype), (torch.randn(n, HKV, D) * 2).to(dtype)
        for p in range(ctx):  # the cached part is in the pages already, as the backend stores it
            kc[blocks[p // BS], p % BS] = quantize_fp8(k[p], K_SCALE) if cache_dtype == FP8 else k[p].to(cache_dtype)
            vc[blocks[p // BS], p % BS] = quantize_fp8(v[p], V_SCALE) if cache_dtype == FP8 else v[p].to(cache_dtype)
        reqs.append((torch.randn(new, HQ, D).to(dtype), k, v, ctx))
        tables.append(blocks)
        qsl.append(qsl[-1] + new)
        slots += [blocks[p // BS] * BS + p % BS for p in range(ctx, n)]
    width = max(map(len, tables))
    seq_lens = [c + n for c, n in shapes]
    meta = AttentionMetadata(num_decodes=5, query_start_loc=qsl, seq_lens=seq_lens,
                             slot_mapping=torch.tensor(slots), block_tables=torch.tensor(
                                 [t + [0] * (width - len(t)) for t in tables]),
                             seq_lens_tensor=torch.tensor(seq_lens), block_size=BS)
    q = torch.cat([r[0] for r in reqs])
    k_new = torch.cat([k[ctx:] for _, k, _, ctx in reqs])
    v_new = torch.cat([v[ctx:] for _, _, v, ctx in reqs])
    return q, k_new, v_new, (kc, vc), meta, reqs


def _run(seed, dtype, cache_dtype, c_kernel):
    q, k_new, v_new, (kc, vc), meta, reqs = _batch(seed, dtype, cache_dtype)
    backend = get_backend("cpu" if c_kernel else "torch")  # cpu: the torch backend + C kernels
    scales = (K_SCALE, V_SCALE) if cache_dtype == FP8 else (1.0, 1.0)
    out = backend.forward(q, k_new, v_new, kc, vc, meta, 0.25, *scales)
    return out, (kc, vc), meta, reqs


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("c_kernel", [True, False])
def test_fp8_cache_matches_attention_over_the_dequantized_cache(seed, c_kernel):
    """Decode, fresh prefill and chunked prefill read back exactly codes * scale."""
    out, _, meta, reqs = _run(seed, torch.float32, FP8, c_kernel)
    for i, (q, k, v, ctx) in enumerate(reqs):
        if ctx:  # everything this request attends to was read from the cache
            k, v = fp8_roundtrip(k, K_SCALE), fp8_roundtrip(v, V_SCALE)
        ref = reference(q, k, v, 0.25)
        torch.testing.assert_close(out[meta.query_start_loc[i]:meta.query_start_loc[i + 1]], ref,
                                   atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("c_kernel", [True, False])
def test_fp8_cache_with_bf16_queries(c_kernel):
    """A bf16 model with an fp8 cache: same reference, to bf16 precision."""
    out, _, meta, reqs = _run(0, torch.bfloat16, FP8, c_kernel)
    assert out.dtype == torch.bfloat16
    for i, (q, k, v, ctx) in enumerate(reqs):
        if ctx:
            k, v = fp8_roundtrip(k, K_SCALE), fp8_roundtrip(v, V_SCALE)
        ref = reference(q, k, v, 0.25)
        torch.testing.assert_close(out[meta.query_start_loc[i]:meta.query_start_loc[i + 1]].float(), ref,
                                   atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("seed", range(3))
def test_fp8_cache_close_to_float32_cache(seed):
    """Against a float32 cache: within the stated tolerance, exact where nothing is read from the cache."""
    out8, _, meta, _ = _run(seed, torch.float32, FP8, True)
    out32, _, _, _ = _run(seed, torch.float32, torch.float32, True)
    rel_rms = float((out8 - out32).pow(2).mean().sqrt() / out32.pow(2).mean().sqrt())
    max_err = float((out8 - out32).abs().max() / out32.abs().max())
    assert 1e-3 < rel_rms < FP8_REL_RMS, f"relative RMS error {rel_rms:.4f}"  # > 1e-3: the cache really is fp8
    assert max_err < FP8_MAX_ERR, f"max error {max_err:.4f} of max |output|"
    fresh = meta.query_start_loc[5], meta.query_start_loc[6]  # the prefill with no cached context
    torch.testing.assert_close(out8[fresh[0]:fresh[1]], out32[fresh[0]:fresh[1]], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("c_kernel", [True, False])
def test_writes_store_saturated_codes(c_kernel):
    """New K/V land in their slots as quantize_fp8(x, scale); beyond +-448 * scale they saturate, never NaN."""
    q, k_new, v_new, _, meta, _ = _batch(0, torch.float32, FP8)
    k_new[0, 0, :3] = torch.tensor([1e4, -1e4, float("inf")])
    kc = torch.zeros(64, BS, HKV, D, dtype=FP8)
    vc = torch.zeros(64, BS, HKV, D, dtype=FP8)
    backend = get_backend("cpu" if c_kernel else "torch")  # cpu: the torch backend + C kernels
    backend.forward(q, k_new, v_new, kc, vc, meta, 0.25, K_SCALE, V_SCALE)
    stored_k = kc.view(-1, HKV, D)[meta.slot_mapping].float()
    stored_v = vc.view(-1, HKV, D)[meta.slot_mapping].float()
    assert torch.equal(stored_k, quantize_fp8(k_new, K_SCALE).float())
    assert torch.equal(stored_v, quantize_fp8(v_new, V_SCALE).float())
    assert stored_k[0, 0, :3].tolist() == [448.0, -448.0, 448.0]
    assert not stored_k.isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_quantize_rounds_like_torch(dtype):
    """The C write's float -> e4m3 conversion equals quantize_fp8 bit for bit: every fp8 value, every
    midpoint between neighbours (ties to even) and the floats either side of it, random values from
    2^-20 to 2^16, saturation and signed zeros; x given as a strided view, as a fused qkv output's."""
    if paged_attention.load_kernel() is None:
        pytest.skip("no C compiler: the torch path serves fp8 caches")
    torch.manual_seed(0)
    values = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    values = values[~values.isnan()].unique()
    mids = (values[1:] + values[:-1]) / 2
    up, down = torch.nextafter(mids, torch.tensor(1e9)), torch.nextafter(mids, torch.tensor(-1e9))
    rnd = torch.randn(20000) * torch.exp2(torch.randint(-20, 16, (20000,)).float())
    edge = torch.tensor([448.0, 449.0, 463.9, 464.0, 1e30, float("inf"), -float("inf"), 0.0, -0.0, 1e-30])
    x = torch.cat([values, mids, up, down, rnd, edge]).to(dtype)
    x = torch.cat([x, torch.zeros(-x.numel() % D, dtype=dtype)]).view(-1, D)
    fused = torch.cat([x, torch.randn_like(x)], dim=1)[:, :D].view(-1, 1, D)  # rows D * 2 apart
    for scale in (1.0, 2.0**-5, 8.0):
        cache = torch.zeros(fused.shape[0], 1, 1, D, dtype=FP8)
        slots = torch.randperm(fused.shape[0])
        paged_attention.write_fp8(cache, slots, fused, scale)
        assert torch.equal(cache.view(-1, D)[slots].view(torch.uint8), quantize_fp8(x, scale).view(torch.uint8))


def test_c_dequant_is_exact_for_every_code():
    """The C kernel's e4m3 -> float conversion (decode and prefill gather) agrees with torch's on
    all 254 finite codes, subnormals included, to float32 and to bfloat16. Blocks of 254 codes are
    converted 16 at a time with AVX-512 and the last 14 one by one: rotating the codes through 19
    blocks sends every code through both paths."""
    if paged_attention.load_kernel() is None:
        pytest.skip("no C compiler: the torch path serves fp8 caches")
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    cache = torch.stack([torch.zeros_like(codes)] + [codes.roll(r) for r in range(0, 254, 14)]).view(FP8)
    ids = torch.arange(1, cache.shape[0]).flip(0)
    expected = cache[ids].float() * 0.5
    for dtype in (torch.float32, torch.bfloat16):
        got = paged_attention.dequant_blocks(cache, ids, dtype, 0.5)
        assert got.dtype == dtype and torch.equal(got.float(), expected.to(dtype).float())
