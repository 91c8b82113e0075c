"""The triton backend's kernels against the torch backend: paged decode, prefill chunks over a
cached prefix, fp8 KV, odd block and head sizes, grouped-query heads. In Triton's interpreter on
the CPU (TRITON_INTERPRET=1, which tests/conftest.py sets unless told otherwise); compiled on
CUDA with TRITON_INTERPRET=0 (scripts/gpu_check.sh)."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from kvserve.attention import FP8, AttentionMetadata, get_backend, quantize_fp8  # noqa: E402
from kvserve.config import triton_interpreting as interpreting  # noqa: E402

if not interpreting() and not torch.cuda.is_available():
    pytest.skip("compiled Triton kernels need CUDA (TRITON_INTERPRET=0 and no GPU)", allow_module_level=True)
DEVICES = ["cpu"] if interpreting() else ["cuda"]


def _batch(seed: int, bs: int, hq: int, hkv: int, d: int, dtype: torch.dtype, device: str):
    """A flat batch over a shuffled paged cache: 5 decodes of varied context, a prefill with no
    context, prefill chunks after cached prefixes (one longer than a query tile of 16)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks = 96
    free = list(range(num_blocks))
    rng.shuffle(free)
    shapes = [(rng.randrange(1, 45), 1) for _ in range(5)] + [(0, 11), (bs + 3, 5), (2 * bs, 21)]
    tables, qsl, slots, seq_lens, ks, vs, k_ctx, v_ctx = [], [0], [], [], [], [], [], []
    for ctx, new in shapes:
        n = ctx + new
        blocks = [free.pop() for _ in range(-(-n // bs))]
        tables.append(blocks)
        k, v = torch.randn(n, hkv, d), torch.randn(n, hkv, d)
        k_ctx.append(k[:ctx])
        v_ctx.append(v[:ctx])
        ks.append(k[ctx:])
        vs.append(v[ctx:])
        qsl.append(qsl[-1] + new)
        seq_lens.append(n)
        slots += [blocks[p // bs] * bs + p % bs for p in range(ctx, n)]
    width = max(map(len, tables))
    meta = AttentionMetadata(num_decodes=5, query_start_loc=qsl, seq_lens=seq_lens,
                             slot_mapping=torch.tensor(slots, device=device),
                             block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], device=device),
                             seq_lens_tensor=torch.tensor(seq_lens, device=device), block_size=bs)
    q = torch.randn(qsl[-1], hq, d).to(device=device, dtype=dtype)
    k, v = (torch.cat(x).to(device=device, dtype=dtype) for x in (ks, vs))
    return meta, q, k, v, tables, shapes, k_ctx, v_ctx


def _caches(tables, shapes, k_ctx, v_ctx, bs, hkv, d, cache_dtype, scales, device):
    """Both caches with every request's cached context already in its pages (fp8: as codes)."""
    out = []
    for ctx_list, scale in zip((k_ctx, v_ctx), scales):
        cache = torch.zeros(96, bs, hkv, d, dtype=torch.float32)
        for blocks, (ctx, _), x in zip(tables, shapes, ctx_list):
            for p in range(ctx):
                cache[blocks[p // bs], p % bs] = x[p]
        if cache_dtype == FP8:
            cache = quantize_fp8(cache, scale)
        out.append(cache.to(device=device, dtype=cache_dtype))
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bs,hq,hkv,d", [(4, 8, 2, 8), (16, 4, 4, 16), (5, 6, 3, 12)])  # odd: 5-token blocks, 12 dims
def test_paged_attention_matches_the_torch_backend(device, bs, hq, hkv, d):
    meta, q, k, v, tables, shapes, k_ctx, v_ctx = _batch(bs + d, bs, hq, hkv, d, torch.float32, device)
    outs, caches = {}, {}
    for name in ("torch", "triton"):
        kc, vc = _caches(tables, shapes, k_ctx, v_ctx, bs, hkv, d, torch.float32, (1.0, 1.0), device)
        outs[name] = get_backend(name).forward(q, k, v, kc, vc, meta, 0.3)
        caches[name] = (kc, vc)
    torch.testing.assert_close(outs["triton"], outs["torch"], atol=2e-5, rtol=2e-5)
    for a, b in zip(caches["triton"], caches["torch"]):  # the new tokens' K/V landed in their slots
        assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
def test_bfloat16_queries_and_cache(device):
    bs, hq, hkv, d = 8, 4, 2, 16
    meta, q, k, v, tables, shapes, k_ctx, v_ctx = _batch(7, bs, hq, hkv, d, torch.bfloat16, device)
    outs = {}
    for name in ("torch", "triton"):
        kc, vc = _caches(tables, shapes, k_ctx, v_ctx, bs, hkv, d, torch.bfloat16, (1.0, 1.0), device)
        outs[name] = get_backend(name).forward(q, k, v, kc, vc, meta, 0.25).float()
    torch.testing.assert_close(outs["triton"], outs["torch"], atol=2e-2, rtol=2e-2)


def _attend_to_cache(meta, q, kc, vc, scale):
    """Causal attention of each request's queries over its K/V as the (float) cache holds them."""
    hq, hkv = q.shape[1], kc.shape[2]
    out = torch.empty_like(q)
    for r, n in enumerate(meta.seq_lens):
        ids = meta.block_tables[r, :-(-n // meta.block_size)]
        k, v = (c[ids].reshape(-1, hkv, c.shape[-1])[:n].repeat_interleave(hq // hkv, 1) for c in (kc, vc))
        a, b = meta.query_start_loc[r], meta.query_start_loc[r + 1]
        s = torch.einsum("qhd,khd->hqk", q[a:b], k) * scale
        pos = torch.arange(n - (b - a), n, device=q.device)[:, None]
        s = s.masked_fill(torch.arange(n, device=q.device)[None, :] > pos, float("-inf"))
        out[a:b] = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_fp8_cache_writes_codes_and_reads_them_scaled(device):
    """The same saturated codes as the torch backend writes; attention over code * scale. (The
    torch backend attends to a context-free prefill's fresh K/V instead of the codes.)"""
    bs, hq, hkv, d = 4, 4, 2, 8
    k_scale, v_scale = 0.02, 0.05
    meta, q, k, v, tables, shapes, k_ctx, v_ctx = _batch(3, bs, hq, hkv, d, torch.float32, device)
    k, v = k * 30, v * 30  # some values beyond 448 * scale: the write saturates them
    caches = {}
    for name in ("torch", "triton"):
        kc, vc = _caches(tables, shapes, k_ctx, v_ctx, bs, hkv, d, FP8, (k_scale, v_scale), device)
        out = get_backend(name).forward(q, k, v, kc, vc, meta, 0.3, k_scale, v_scale)
        caches[name] = (kc, vc)
    for a, b in zip(caches["triton"], caches["torch"]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))  # the same codes, saturated at 448
    kc, vc = caches["triton"]
    ref = _attend_to_cache(meta, q, kc.float() * k_scale, vc.float() * v_scale, 0.3)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_on_a_cpu_without_the_interpreter_it_says_so(monkeypatch):
    from kvserve.attention.triton_backend import TritonAttentionBackend

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    meta, q, k, v, *_ = _batch(0, 4, 4, 2, 8, torch.float32, "cpu")
    kc = vc = torch.zeros(96, 4, 2, 8)
    with pytest.raises(RuntimeError, match="CUDA device"):
        TritonAttentionBackend().forward(q, k, v, kc, vc, meta, 0.3)
