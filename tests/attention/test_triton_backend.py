"""The triton backend's kernels against the torch backend: paged decode, prefill chunks over a
cached prefix, fp8 KV, odd block and head sizes, grouped-query heads, split-K decodes over long
contexts; the padding rows of a CUDA-graph decode batch (slot -1, seq_len 0). In Triton's
interpreter on the CPU (TRITON_INTERPRET=1, which tests/conftest.py sets unless told otherwise);
compiled on CUDA with TRITON_INTERPRET=0 (scripts/gpu_check.sh)."""

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


def _decodes(seed: int, ctxs: list[int], width: int, bs: int, hq: int, hkv: int, d: int, dtype, cache_dtype,
             scales, device: str):
    """Decodes after these cached contexts, over a shuffled paged cache with block tables `width`
    wide; block 0 is used by none of them. Returns meta, q, k, v and the (K, V) caches."""
    torch.manual_seed(seed)
    need = [-(-(c + 1) // bs) for c in ctxs]
    free = (torch.randperm(sum(need)) + 1).tolist()
    caches = [torch.zeros(sum(need) + 1, bs, hkv, d) for _ in range(2)]
    tables = torch.zeros(len(ctxs), width, dtype=torch.int64)
    slots = []
    for i, (ctx, n) in enumerate(zip(ctxs, need)):
        blocks = torch.tensor([free.pop() for _ in range(n)])
        tables[i, :n] = blocks
        pos = torch.arange(ctx)
        for c in caches:
            c[blocks[pos // bs], pos % bs] = torch.randn(ctx, hkv, d)
        slots.append(int(blocks[ctx // bs]) * bs + ctx % bs)
    if cache_dtype == FP8:
        caches = [quantize_fp8(c, s) for c, s in zip(caches, scales)]
    n, seq_lens = len(ctxs), [c + 1 for c in ctxs]
    meta = AttentionMetadata(num_decodes=n, query_start_loc=list(range(n + 1)), seq_lens=seq_lens,
                             slot_mapping=torch.tensor(slots, device=device), block_tables=tables.to(device),
                             seq_lens_tensor=torch.tensor(seq_lens, device=device), block_size=bs)
    q, k, v = (torch.randn(n, h, d).to(device=device, dtype=dtype) for h in (hq, hkv, hkv))
    return meta, q, k, v, [c.to(device=device, dtype=cache_dtype) for c in caches]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,cache_dtype,bs,hq,hkv,d,tol", [
    (torch.float32, torch.float32, 16, 4, 2, 80, 2e-5),  # head size 80 (padded to 128)
    (torch.bfloat16, torch.bfloat16, 5, 4, 1, 12, 2e-2),  # 5-token blocks, 12 dims, 4 heads per KV head
    (torch.float32, FP8, 16, 2, 2, 16, 2e-5),
])
def test_split_k_decodes_over_long_contexts_match_the_torch_backend(device, dtype, cache_dtype, bs, hq, hkv, d, tol):
    from kvserve.attention.triton_backend import num_splits

    width = -(-2048 // bs)
    assert num_splits(width * bs)[0] > 1
    scales = (0.02, 0.05) if cache_dtype == FP8 else (1.0, 1.0)
    meta, q, k, v, caches = _decodes(bs + d, [0, 1, 37, 700, 1999], width, bs, hq, hkv, d, dtype, cache_dtype,
                                     scales, device)
    outs, written = {}, {}
    for name in ("torch", "triton"):
        kc, vc = (c.clone() for c in caches)
        outs[name] = get_backend(name).forward(q, k, v, kc, vc, meta, 0.3, *scales).float()
        written[name] = (kc, vc)
    torch.testing.assert_close(outs["triton"], outs["torch"], atol=tol, rtol=tol)
    for a, b in zip(written["triton"], written["torch"]):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", [torch.float32, FP8])
def test_kv_write_skips_negative_slots(device, cache_dtype):
    """Slot -1 marks a padding row of a captured decode batch: nothing of it is written."""
    cache = torch.randn(4, 4, 2, 8).to(device=device, dtype=cache_dtype)
    before = cache.clone()
    x = torch.randn(4, 2, 8, device=device)
    get_backend("triton").write(cache, torch.tensor([3, -1, 13, -1], device=device), x, 0.05)
    rows, want = cache.view(16, 2, 8), before.view(16, 2, 8).clone()
    want[[3, 13]] = x[[0, 2]].to(cache_dtype) if cache_dtype != FP8 else quantize_fp8(x[[0, 2]], 0.05)
    assert torch.equal(rows.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
def test_padding_rows_of_a_captured_decode_batch_give_zeros_and_leave_the_rest_alone(device):
    """A decode batch padded as worker/cuda_graphs.py pads it (slot -1, seq_len 0, table of block 0,
    host lists that say nothing true): the real rows come out as without padding, the padding rows
    as zeros, reading nothing (block 0 holds NaN) and writing nothing."""
    bs, hq, hkv, d = 8, 4, 2, 16
    meta, q, k, v, caches = _decodes(1, [5, 300, 40], 64, bs, hq, hkv, d, torch.float32, torch.float32,
                                     (1.0, 1.0), device)
    for c in caches:
        c[0] = float("nan")
    n, b = 3, 5
    padded = AttentionMetadata(
        num_decodes=b, query_start_loc=list(range(b + 1)), seq_lens=[0] * b,
        slot_mapping=torch.cat([meta.slot_mapping, torch.full((b - n,), -1, device=device)]),
        block_tables=torch.cat([meta.block_tables, torch.zeros(b - n, 64, dtype=torch.int64, device=device)]),
        seq_lens_tensor=torch.cat([meta.seq_lens_tensor, torch.zeros(b - n, dtype=torch.int64, device=device)]),
        block_size=bs, query_start_tensor=torch.arange(b + 1, dtype=torch.int32, device=device))
    extra = [torch.randn(b - n, *x.shape[1:], device=device) for x in (q, k, v)]
    runs = []
    for m, xs in ((meta, (q, k, v)), (padded, [torch.cat(p) for p in zip((q, k, v), extra)])):
        kc, vc = (c.clone() for c in caches)
        runs.append((get_backend("triton").forward(*xs, kc, vc, m, 0.3), kc, vc))
    (want, *want_caches), (out, *got_caches) = runs
    assert torch.equal(out[:n], want)
    assert torch.equal(out[n:], torch.zeros_like(out[n:]))
    for a, w in zip(got_caches, want_caches):
        assert torch.equal(a.view(torch.uint8), w.view(torch.uint8))
