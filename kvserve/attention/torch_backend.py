"""Paged attention in plain torch: runs on CPU and unchanged on a CUDA device."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.attention.backend import AttentionBackend, AttentionMetadata, register_backend

# Decodes are grouped by context length so that padding to the group's longest
# context wastes at most this fraction of the gathered K/V.
_MAX_PAD_WASTE = 0.25


@register_backend
class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float):
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            for group in _decode_groups(meta.seq_lens[:nd]):
                out[group] = _decode(q[group], k_cache, v_cache, meta, group, scale)
        for i in range(nd, meta.num_reqs):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            seq_len = meta.seq_lens[i]
            if seq_len == end - start:  # no cached context: attend to the fresh K/V
                kk, vv = k[start:end], v[start:end]
            else:
                kk, vv = _gather(k_cache, v_cache, meta.block_tables[i], seq_len, meta.block_size)
            out[start:end] = _prefill(q[start:end], kk, vv, seq_len, scale)
        return out


def _gather(k_cache, v_cache, block_table, seq_len: int, block_size: int):
    nblocks = -(-seq_len // block_size)
    ids = block_table[:nblocks]
    shape = (-1,) + tuple(k_cache.shape[2:])
    return k_cache[ids].reshape(shape)[:seq_len], v_cache[ids].reshape(shape)[:seq_len]


def _prefill(q, k, v, seq_len: int, scale: float):
    """q [Q, Hq, D] are the last Q positions of a context of seq_len tokens."""
    q_len = q.shape[0]
    qt, kt, vt = q.transpose(0, 1), k.to(q.dtype).transpose(0, 1), v.to(q.dtype).transpose(0, 1)
    gqa = qt.shape[0] != kt.shape[0]
    if q_len == seq_len:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        # Query i sits at position seq_len - q_len + i and sees keys 0..that position.
        qpos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= qpos[:, None]
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return o.transpose(0, 1)


def _decode(q, k_cache, v_cache, meta: AttentionMetadata, group: slice | list[int], scale: float):
    """One query token per request; each attends to its whole context.

    Written as two batched matmuls over query-head groups rather than SDPA: with
    one query row, SDPA's CPU kernels (and its GQA fallback) are several times slower.
    """
    seq_lens = meta.seq_lens_tensor[group]
    max_len = int(seq_lens.max())
    nblocks = -(-max_len // meta.block_size)
    tables = meta.block_tables[group, :nblocks]  # [B, nblocks]
    b, hq, d = q.shape
    hkv = k_cache.shape[2]
    kv_shape = (b, nblocks * meta.block_size, hkv, d)
    kk = k_cache[tables].view(kv_shape).permute(0, 2, 3, 1).to(q.dtype)  # [B, Hkv, D, L]
    vv = v_cache[tables].view(kv_shape).transpose(1, 2).to(q.dtype)  # [B, Hkv, L, D]
    scores = torch.matmul(q.view(b, hkv, hq // hkv, d), kk).float() * scale  # [B, Hkv, G, L]
    pad = torch.arange(kv_shape[1], device=q.device)[None, :] >= seq_lens[:, None]
    scores.masked_fill_(pad[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, vv).view(b, hq, d)


def _decode_groups(seq_lens: list[int]) -> list[slice | list[int]]:
    """Split decodes into groups whose padded K/V size stays near their real size."""
    n = len(seq_lens)
    if n <= 4 or max(seq_lens) * n <= (1 + _MAX_PAD_WASTE) * sum(seq_lens):
        return [slice(0, n)]
    order = sorted(range(n), key=seq_lens.__getitem__, reverse=True)
    groups: list[list[int]] = []
    cur: list[int] = []
    cur_sum = 0
    for i in order:
        # The first (longest) member sets the padded length of the group.
        if cur and seq_lens[cur[0]] * (len(cur) + 1) > (1 + _MAX_PAD_WASTE) * (cur_sum + seq_lens[i]):
            groups.append(cur)
            cur, cur_sum = [], 0
        cur.append(i)
        cur_sum += seq_lens[i]
    groups.append(cur)
    return groups
