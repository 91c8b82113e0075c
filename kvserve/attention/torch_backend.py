"""Paged attention in plain torch: runs on CPU and unchanged on a CUDA device.

The `cpu` backend (cpu_backend.py) is this one with its decode, fp8 write and fp8 read done
by compiled C kernels where they apply; the steps it replaces are the methods marked as such."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.attention.backend import FP8, AttentionBackend, AttentionMetadata, quantize_fp8, register_backend

# Decodes are grouped by context length so that padding to the group's longest
# context wastes at most this fraction of the gathered K/V.
_MAX_PAD_WASTE = 0.25
# With few KV heads, decode scores every (query head, KV head) pair straight from the
# gathered [B, L, Hkv, D] layout and keeps the matching ones: Hkv times the (tiny)
# matmul work, but no transposed copy of K/V, which costs more at this size.
_MAX_KV_HEADS_ALL_PAIRS = 4


@register_backend
class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self) -> None:
        # Scratch buffers reused by every layer and step: gathering K/V into fresh
        # multi-megabyte tensors each call costs more than the attention math.
        self._buffers: dict[str, torch.Tensor] = {}

    def _buffer(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        n = 1
        for d in shape:
            n *= d
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < n or buf.dtype != like.dtype or buf.device != like.device:
            buf = self._buffers[name] = torch.empty(n, dtype=like.dtype, device=like.device)
        return buf[:n].view(shape)

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, k_scale: float = 1.0,
                v_scale: float = 1.0):
        self._write(k_cache, meta.slot_mapping, k, k_scale)
        self._write(v_cache, meta.slot_mapping, v, v_scale)
        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            self._decodes(q[:nd], k_cache, v_cache, meta, scale, k_scale, v_scale, out[:nd])
        if nd < meta.num_reqs:
            self._prefills(q, k, v, k_cache, v_cache, meta, scale, k_scale, v_scale, out)
        return out

    def _prefills(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float, k_scale: float,
                  v_scale: float, out: torch.Tensor) -> None:
        """Into out: the rows of requests num_decodes.. (prefill chunks), causal over each one's context
        (the cpu backend's C kernel)."""
        for i in range(meta.num_decodes, meta.num_reqs):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            seq_len = meta.seq_lens[i]
            qpos = None if meta.query_positions is None else meta.query_positions[start:end]
            if seq_len == end - start and qpos is None:  # no cached context: attend to the fresh K/V
                kk, vv = k[start:end], v[start:end]
                if k_cache.dtype not in (q.dtype, FP8):  # as the cache holds them (a float32 model's bfloat16 KV)
                    kk, vv = kk.to(k_cache.dtype), vv.to(v_cache.dtype)
            else:
                ids = meta.block_tables[i, :-(-seq_len // meta.block_size)]
                kk = self._gather(k_cache, ids, q.dtype, k_scale)[:seq_len]
                vv = self._gather(v_cache, ids, q.dtype, v_scale)[:seq_len]
            out[start:end] = _prefill(q[start:end], kk, vv, seq_len, scale, qpos)

    def _decodes(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, k_scale: float,
                 v_scale: float, out: torch.Tensor) -> None:
        """Into out: the first num_decodes requests, one query token each [nd, Hq, D] (the cpu
        backend's C kernel)."""
        # The K scale folds into the softmax scale and the V scale into the output.
        for group in _decode_groups(meta.seq_lens[:q.shape[0]]):
            o = self._decode(q[group], k_cache, v_cache, meta, group, scale * k_scale)
            out[group] = o if v_scale == 1.0 else o * v_scale

    def _write(self, cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: float) -> None:
        """Store x [T, Hkv, D] at these slots of cache [num_blocks, block_size, Hkv, D]."""
        rows = cache.view(-1, *cache.shape[2:])
        if cache.dtype != FP8:
            rows.index_copy_(0, slots, x.to(cache.dtype))
        else:
            self._write_fp8(cache, slots, x, scale)

    def _write_fp8(self, cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: float) -> None:
        """x as float8 codes of x / scale at these slots (the cpu backend's C kernel)."""
        # index_copy_ has no float8 kernel on the CPU: copy the codes as bytes
        rows = cache.view(-1, *cache.shape[2:]).view(torch.uint8)
        rows.index_copy_(0, slots, quantize_fp8(x, scale).view(torch.uint8))

    def _gather(self, cache: torch.Tensor, ids: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
        """These blocks' K or V as [len(ids) * block_size, Hkv, D]: codes * scale in dtype for an fp8
        cache (the cpu backend's C kernel), else rows of the cache's own dtype (the caller casts)."""
        rows = _select_blocks(cache, ids).view((-1,) + tuple(cache.shape[2:]))
        return rows.to(dtype) * scale if cache.dtype == FP8 else rows

    def _decode(self, q, k_cache, v_cache, meta: AttentionMetadata, group: slice | list[int], scale: float):
        """One query token per request; each attends to its whole context.

        Whole blocks are gathered with index_select on a 2-D view (a row copy, far
        faster than advanced indexing), then attention runs as two batched matmuls
        (with one query row, SDPA's CPU kernels are several times slower).
        """
        seq_lens = meta.seq_lens_tensor[group]
        nblocks = -(-int(seq_lens.max()) // meta.block_size)
        tables = meta.block_tables[group, :nblocks].reshape(-1)
        b, hq, d = q.shape
        hkv = k_cache.shape[2]
        length = nblocks * meta.block_size
        kk, vv = (self._gather_rows(name, cache, tables, q.dtype).view(b, length, hkv, d)
                  for name, cache in (("k", k_cache), ("v", v_cache)))
        pad = torch.arange(length, device=q.device)[None, :] >= seq_lens[:, None]  # [B, L]
        if hkv <= _MAX_KV_HEADS_ALL_PAIRS:
            return _decode_all_pairs(q, kk, vv, pad, scale)
        kk = self._buffer("kt", (b, hkv, length, d), q).copy_(kk.transpose(1, 2))
        vv = self._buffer("vt", (b, hkv, length, d), q).copy_(vv.transpose(1, 2))
        scores = torch.matmul(q.view(b, hkv, hq // hkv, d), kk.transpose(-1, -2)).float() * scale
        scores.masked_fill_(pad[:, None, None, :], float("-inf"))  # [B, Hkv, G, L]
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        return torch.matmul(probs, vv).view(b, hq, d)

    def _gather_rows(self, name: str, cache: torch.Tensor, blocks: torch.Tensor, dtype) -> torch.Tensor:
        out = self._buffer(name, (blocks.numel(), cache[0].numel()), cache)
        _select_blocks(cache, blocks, out)
        return out if out.dtype == dtype else out.to(dtype)


def _select_blocks(cache: torch.Tensor, ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """cache[ids] as [len(ids), block elements] (into out if given), copied with index_select on a 2-D
    view: a row copy, far faster than advanced indexing."""
    rows = cache.view(cache.shape[0], -1)
    if cache.dtype == FP8:  # as bytes: some torch builds have no float8 index_select on CUDA
        rows, out = rows.view(torch.uint8), None if out is None else out.view(torch.uint8)
    return torch.index_select(rows, 0, ids, out=out).view(cache.dtype)


def _prefill(q, k, v, seq_len: int, scale: float, qpos: torch.Tensor | None = None):
    """q [Q, Hq, D] are the last Q positions of a context of seq_len tokens, or sit at qpos [Q]."""
    q_len = q.shape[0]
    # 4-D [1, H, L, D]: with 3-D inputs SDPA skips its fused (flash) CPU kernel for the
    # math path, which is 3-6x slower on long prompts.
    qt, kt, vt = (x.to(q.dtype).transpose(0, 1)[None] for x in (q, k, v))
    gqa = qt.shape[1] != kt.shape[1]
    if q_len == seq_len and qpos is None:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        # Query i sits at position qpos[i] (by default seq_len - q_len + i) and sees keys 0..that position.
        if qpos is None:
            qpos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        mask = torch.arange(seq_len, device=q.device)[None, :] <= qpos[:, None]
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return o[0].transpose(0, 1)


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


def _decode_all_pairs(q, kk, vv, pad, scale: float):
    """q [B, Hq, D]; kk, vv [B, L, Hkv, D]; pad [B, L] marks positions past each context."""
    b, hq, d = q.shape
    length, hkv = kk.shape[1], kk.shape[2]
    g = hq // hkv
    all_scores = torch.bmm(q, kk.view(b, length * hkv, d).transpose(1, 2)).view(b, hkv, g, length, hkv)
    scores = torch.diagonal(all_scores, dim1=1, dim2=4).float() * scale  # [B, G, L, Hkv]
    scores = scores.masked_fill(pad[:, None, :, None], float("-inf"))
    probs = torch.softmax(scores, dim=2).permute(0, 3, 1, 2).reshape(b, hq, length).to(q.dtype)
    all_out = torch.bmm(probs, vv.view(b, length, hkv * d)).view(b, hkv, g, hkv, d)
    return torch.diagonal(all_out, dim1=1, dim2=3).permute(0, 3, 1, 2).reshape(b, hq, d)
