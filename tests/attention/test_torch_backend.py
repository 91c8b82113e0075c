"""The paged torch backend against plain causal attention over contiguous K/V."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve.attention import AttentionMetadata, get_backend

BS, HQ, D = 4, 8, 8


def reference(q, k, v, scale, HKV):
    """Causal attention of the last q.shape[0] positions over the full k/v."""
    L, Q, HQ = k.shape[0], q.shape[0], q.shape[1]
    k = k.repeat_interleave(HQ // HKV, 1)
    v = v.repeat_interleave(HQ // HKV, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    qpos = torch.arange(L - Q, L)[:, None]
    s = s.masked_fill(torch.arange(L)[None, :] > qpos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("HKV", [2, 8])  # both torch decode layouts: all-pairs (few KV heads) and transposed
@pytest.mark.parametrize("c_kernel", [True, False])
def test_mixed_batch_matches_reference(seed, HKV, c_kernel):
    _mixed_batch(seed, HKV, c_kernel, D)


def test_c_prefill_kernel_in_a_mixed_batch(monkeypatch):
    """With a head size the prefill kernel takes (64), the cpu backend runs every prefill chunk of
    the batch through it in one call, and the batch still matches the reference."""
    from kvserve.kernels import cpu, paged_attention

    if cpu.isa_level() == "generic" or paged_attention.load_kernel() is None:
        pytest.skip("the prefill kernel is used at the AVX2 levels and up")
    calls = []
    real = paged_attention.paged_prefill
    monkeypatch.setattr(paged_attention, "paged_prefill", lambda *a: calls.append(a[6:8]) or real(*a))
    _mixed_batch(0, 2, True, 64)
    assert calls == [(6, 9)]  # requests 6..8: the three prefill chunks


def _mixed_batch(seed, HKV, c_kernel, D):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks = 64
    kc = torch.zeros(num_blocks, BS, HKV, D)
    vc = torch.zeros(num_blocks, BS, HKV, D)
    free = list(range(num_blocks))
    rng.shuffle(free)
    # (context already cached, new query tokens): 6 decodes of varied length, then prefills.
    shapes = [(rng.randrange(1, 40), 1) for _ in range(6)] + [(0, 9), (13, 5), (3, 1 + 4)]
    full_k, full_v, tables = [], [], []
    for ctx, new in shapes:
        n = ctx + new
        blocks = [free.pop() for _ in range(-(-n // BS))]
        tables.append(blocks)
        k, v = torch.randn(n, HKV, D), torch.randn(n, HKV, D)
        full_k.append(k)
        full_v.append(v)
        for p in range(ctx):  # the cached part is already in the pages
            kc[blocks[p // BS], p % BS] = k[p]
            vc[blocks[p // BS], p % BS] = v[p]
    qs = [torch.randn(new, HQ, D) for _, new in shapes]
    q = torch.cat(qs)
    k_new = torch.cat([k[ctx:] for k, (ctx, _) in zip(full_k, shapes)])
    v_new = torch.cat([v[ctx:] for v, (ctx, _) in zip(full_v, shapes)])
    qsl = [0]
    slots = []
    for (ctx, new), blocks in zip(shapes, tables):
        qsl.append(qsl[-1] + new)
        slots += [blocks[p // BS] * BS + p % BS for p in range(ctx, ctx + new)]
    width = max(map(len, tables))
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    seq_lens = [c + n for c, n in shapes]
    meta = AttentionMetadata(num_decodes=6, query_start_loc=qsl, seq_lens=seq_lens,
                             slot_mapping=torch.tensor(slots), block_tables=bt,
                             seq_lens_tensor=torch.tensor(seq_lens), block_size=BS)
    backend = get_backend("cpu" if c_kernel else "torch")  # cpu: the torch backend + C kernels
    out = backend.forward(q, k_new, v_new, kc, vc, meta, 0.3)
    for i in range(len(shapes)):
        ref = reference(qs[i], full_k[i], full_v[i], 0.3, HKV)
        torch.testing.assert_close(out[qsl[i]:qsl[i + 1]], ref, atol=1e-5, rtol=1e-5)
    # every new token's K landed in its slot
    torch.testing.assert_close(kc.view(-1, HKV, D)[torch.tensor(slots)], k_new)


def test_decode_groups_cover_every_request_once():
    from kvserve.attention.torch_backend import _decode_groups

    lens = [5, 900, 7, 880, 30, 31, 29, 1000, 2, 3]
    groups = _decode_groups(lens)
    seen = sorted(i for g in groups for i in (range(len(lens))[g] if isinstance(g, slice) else g))
    assert seen == list(range(len(lens)))
    assert len(groups) > 1  # padding everything to 1000 would waste most of the gather


def test_c_kernel_builds_here_and_handles_bf16():
    """The machines this project runs on have a C compiler: the fast path must be live."""
    from kvserve.kernels import paged_attention

    q = torch.randn(3, 8, 16, dtype=torch.bfloat16)
    kc = torch.randn(10, 4, 2, 16, dtype=torch.bfloat16)
    vc = torch.randn(10, 4, 2, 16, dtype=torch.bfloat16)
    assert paged_attention.supports(q, kc)
    tables = torch.tensor([[3, 7, 1], [0, 0, 0], [9, 2, 0]])
    lens = torch.tensor([11, 1, 6])
    out = paged_attention.paged_decode(q, kc, vc, tables, lens, 11, 0.25)
    for b in range(3):
        blocks = tables[b, :-(-int(lens[b]) // 4)]
        k = kc[blocks].reshape(-1, 2, 16)[:lens[b]].float()
        v = vc[blocks].reshape(-1, 2, 16)[:lens[b]].float()
        ref = reference(q[b:b + 1].float(), k, v, 0.25, 2)[0]
        torch.testing.assert_close(out[b].float(), ref, atol=2e-2, rtol=2e-2)


def test_c_kernel_leaves_floating_point_state_alone():
    """Loading the kernel must not turn on flush-to-zero in the caller's process (crtfastmath.o)."""
    import subprocess
    import sys

    code = ("import sys; from kvserve.kernels import paged_attention as k; assert k.load_kernel() is not None; "
            "print(sys.float_info.min * 0.5 > 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.strip() == "True", out.stderr


# head sizes: 64- and 32-float register sums with and without a tail, 8- and 16-float score loads
@pytest.mark.parametrize("d", [32, 64, 80, 40, 128, 24])
@pytest.mark.parametrize("group", [3, 8])  # query heads per kv head: 4 at a time in the AVX-512 sums, and a rest
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_c_kernel_head_sizes_and_long_contexts(d, group, dtype):
    """Wide heads over a few hundred positions (past the kernel's 256-position chunks, with a block
    size that does not divide them, and lengths that leave a short last group of 8 positions),
    scores spread enough that exp's range matters."""
    from kvserve.kernels import paged_attention

    g = torch.Generator().manual_seed(d)
    nb, bs, hkv, hq = 90, 12, 2, 2 * group
    q = torch.randn(3, hq, d, generator=g) * 3
    kc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    vc = torch.randn(nb, bs, hkv, d, generator=g).to(dtype)
    tables = torch.randperm(nb, generator=g).view(3, 30)
    lens = torch.tensor([300, 1, 77])
    out = paged_attention.paged_decode(q, kc, vc, tables, lens, 300, d ** -0.5)
    for b in range(3):
        k = kc[tables[b]].reshape(-1, hkv, d)[:lens[b]].float()
        v = vc[tables[b]].reshape(-1, hkv, d)[:lens[b]].float()
        k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        p = (torch.einsum("hd,khd->hk", q[b], k) * d ** -0.5).softmax(-1)
        torch.testing.assert_close(out[b], torch.einsum("hk,khd->hd", p, v), atol=2e-5, rtol=2e-5)
