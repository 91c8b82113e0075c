"""The worker role of blending (BlendWorker, inside the rank): warm-ups, re-rotation, the check layer and selective recompute.

For one span [start, end) of a request (connector.py's BlendPlan):

1. The chunks' K/V (computed at positions 0.. on their own) are copied into the request's blocks,
   every layer, K re-rotated by the chunk's offset: RoPE at position o + j is RoPE at j followed by
   a rotation by o, so this is exact up to rounding.
2. Every token of the span runs through layers 0..check_layer, writing fresh K/V there.
3. At the check layer each reused token's fresh K/V are compared with the reused copy. The question
   (the prompt's tokens after the span that this step computes) runs through every layer over the
   reused K/V, and the attention it pays each span token there, summed over the layers after the
   check layer, weighs that token's V movement: the tokens with the largest attention x |dV| are
   picked (a token the question does not read cannot move the answer however far it moved; one it
   reads moves it in proportion to its error). Every token no chunk supplied (separators, chunk
   tails, text between chunks) and the forced ones (chunks' first tokens) are picked too, up to the
   recompute ratio. When the mean relative K/V deviation exceeds max_deviation (the quality
   guard) every token is picked.
4. The picked tokens continue through the remaining layers from their check-layer hidden states,
   each attending to the keys up to its own position; the others keep the reused K/V there.

A recompute ratio of 0 skips 2-3 (naive reuse): only the tokens no chunk supplied are computed.
At ratio 1 the result is a plain prefill's.

Under tensor and pipeline parallelism every rank runs this for the same plan: the forwards go
through the stages (`_run_layers`), each rank copies and re-rotates its own layers and heads, and
the per-token measures (K/V deviation at the check layer, the question's attention) are partial
sums over each rank's heads and layers, added up over all ranks (`_sum_over_ranks`), so every
rank picks the same tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from kvserve.attention import FP8, AttentionMetadata
from kvserve.attention.backend import quantize_fp8
from kvserve.blend.connector import BlendPlan, BlendResult, BlendStepMeta, Warmup, num_to_recompute
from kvserve.core.kv_connector import KVConnectorWorker
from kvserve.distributed.parallel import IntermediateTensors


@torch.inference_mode()
def run_blend(runner, meta: BlendStepMeta) -> dict[str, BlendResult]:
    """Carry out a step's blending on `runner` (this rank's ModelRunner; every rank runs it)."""
    if meta.warmups:
        _warm(runner, meta.warmups)
    return {p.request_id: _blend(runner, p) for p in meta.plans}


def _slots(block_ids: list[int], positions: torch.Tensor, block_size: int) -> torch.Tensor:
    table = torch.tensor(block_ids, dtype=torch.int64)
    return table[positions // block_size] * block_size + positions % block_size


def _prefill_meta(runner, block_tables: list[list[int]], query_lens: list[int], seq_lens: list[int],
                  slots: torch.Tensor, query_positions: torch.Tensor | None = None) -> AttentionMetadata:
    width = max(len(t) for t in block_tables)
    table = torch.zeros((len(block_tables), width), dtype=torch.int64)
    for i, t in enumerate(block_tables):
        table[i, :len(t)] = torch.tensor(t, dtype=torch.int64)
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    dev = runner.device
    return AttentionMetadata(
        num_decodes=0, query_start_loc=qsl, seq_lens=list(seq_lens), slot_mapping=slots.to(dev),
        block_tables=table.to(dev), seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int64, device=dev),
        block_size=runner.block_size,
        query_positions=None if query_positions is None else query_positions.to(dev))


def _run_layers(runner, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, first: int,
                last: int, inter: IntermediateTensors | None = None):
    """Layers [first, last) of the whole model, through the pipeline: each stage runs its share of
    them, from the hidden states after layer first - 1 (`inter`, given on the stage that holds that
    layer) or from the previous stage, and hands its output to the next stage. Returns what layer
    last - 1 gives on the stage that holds it (IntermediateTensors, or the final hidden states when
    last ends the model); None elsewhere."""
    lo, hi = runner.layer_range
    pp = runner.parallel.pp
    a, b = max(first, lo), min(last, hi)
    if a >= b:
        if inter is not None and first == hi and first < last:  # layer first - 1 was this stage's last
            pp.send([inter.hidden, inter.residual], pp.rank + 1)
        return None
    if a > 0 and (a > first or inter is None):  # layer a - 1 ran on the previous stage
        t = ids.shape[0]
        h, r = (torch.empty(t, runner.hidden_size, dtype=runner.dtype, device=runner.device) for _ in range(2))
        inter = IntermediateTensors(*pp.recv([h, r], pp.rank - 1))
    out = runner.model(ids, positions, runner.kv_caches, meta, inter if a > 0 else None, layers=(a, b))
    if b < last:
        pp.send([out.hidden, out.residual], pp.rank + 1)
        return None
    return out


def _sum_over_ranks(t: torch.Tensor) -> torch.Tensor:
    """A per-token measure summed over every rank's share (heads, layers): the same on every rank."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        t = t.contiguous()
        dist.all_reduce(t)
    return t


def _cache(runner, layer: int):
    """This rank's (K, V) cache of a model layer, or None when another stage holds it."""
    lo, hi = runner.layer_range
    return runner.kv_caches[layer - lo] if lo <= layer < hi else None


def _warm(runner, warmups: list[Warmup]) -> None:
    """Chunks computed on their own (positions from 0), as one batch of prefills."""
    bs = runner.block_size
    ids, pos, slots = [], [], []
    for w in warmups:
        p = torch.arange(w.start, len(w.token_ids))
        ids.extend(w.token_ids[w.start:])
        pos.append(p)
        slots.append(_slots(w.block_ids, p, bs))
    meta = _prefill_meta(runner, [w.block_ids for w in warmups], [len(w.token_ids) - w.start for w in warmups],
                         [len(w.token_ids) for w in warmups], torch.cat(slots))
    _run_layers(runner, torch.tensor(ids, device=runner.device), torch.cat(pos).to(runner.device), meta, 0,
                runner.num_layers)


def _rows(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(-1, *cache.shape[2:])


def _read(cache: torch.Tensor, slots: torch.Tensor, scale: float) -> torch.Tensor:
    """Rows of the cache at these slots as float32 [n, H, D]."""
    rows = _rows(cache)
    if cache.dtype == FP8:
        return rows.view(torch.uint8)[slots].view(FP8).float() * scale
    return rows[slots].float()


def _write(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, scale: float) -> None:
    rows = _rows(cache)
    if cache.dtype == FP8:
        rows.view(torch.uint8).index_copy_(0, slots, quantize_fp8(x, scale).view(torch.uint8))
    else:
        rows.index_copy_(0, slots, x.to(cache.dtype))


def _scales(runner, layer: int) -> tuple[float, float]:
    """fp8 scales of a model layer held by this stage (the runner keeps its stage's, in order)."""
    if runner.kv_scales is None:
        return 1.0, 1.0
    k, v = runner.kv_scales[layer - runner.layer_range[0]].tolist()
    return k, v


def _copy_chunks(runner, plan: BlendPlan, dst_slots: torch.Tensor) -> torch.Tensor:
    """Write every source's K/V into the span's slots (K re-rotated); returns which of the span's
    tokens were supplied [n] bool."""
    bs, dev = runner.block_size, runner.device
    reused = torch.zeros(plan.end - plan.start, dtype=torch.bool)
    src, dst, off = [], [], []
    for s in plan.sources:
        p = torch.arange(s.start, s.end)
        src.append(_slots(s.block_ids, p - s.offset, bs))
        dst.append(dst_slots[p - plan.start])
        off.append(torch.full((s.end - s.start,), s.offset, dtype=torch.int64))
        reused[s.start - plan.start:s.end - plan.start] = True
    if not src:
        return reused
    src_t, dst_t, offsets = torch.cat(src).to(dev), torch.cat(dst).to(dev), torch.cat(off)
    for layer, (k_cache, v_cache) in enumerate(runner.kv_caches, start=runner.layer_range[0]):
        k_scale, v_scale = _scales(runner, layer)
        k = _read(k_cache, src_t, k_scale)
        _write(k_cache, dst_t, runner.model.rerotate_keys(k, offsets), k_scale)
        v_rows = _rows(v_cache).view(torch.uint8) if v_cache.dtype == FP8 else _rows(v_cache)
        v_rows.index_copy_(0, dst_t, v_rows[src_t])
    return reused


QUERY_ROWS = 32  # question tokens scored at a time (bounds the [rows, heads, positions] scores)


def attention_mass(q: torch.Tensor, k: torch.Tensor, q_positions: torch.Tensor, scale: float) -> torch.Tensor:
    """[P]: the causal attention probabilities that queries q [T, H, D] (at q_positions [T]) pay keys
    k [P, Hkv, D] (at positions 0..P-1), summed over queries and heads (grouped-query heads share
    a key head)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    future = torch.arange(k.shape[0], device=k.device)[None, :] > q_positions[:, None]  # [T, P]
    total = torch.zeros(k.shape[0], dtype=torch.float32, device=k.device)
    for a in range(0, q.shape[0], QUERY_ROWS):
        s = torch.einsum("thd,phd->htp", q[a:a + QUERY_ROWS].float(), k.float()) * scale
        total += s.masked_fill(future[None, a:a + QUERY_ROWS], float("-inf")).softmax(dim=-1).sum(dim=(0, 1))
    return total


def _question_attention(runner, plan: BlendPlan, check: int) -> torch.Tensor | None:
    """[end - start] float32: the attention the question's tokens [end, query_end) pay each span
    token, summed over heads, question tokens and the layers after `check` (where the span still
    holds the reused K/V), over all ranks. The question runs through every layer to get its queries
    there; the K/V it writes on the way are rewritten by the step's forward. None when there is no
    question."""
    if plan.query_end <= plan.end or check + 1 >= runner.num_layers:
        return None
    bs, dev, model = runner.block_size, runner.device, runner.model
    lo, hi = runner.layer_range
    ids = torch.tensor(plan.token_ids[plan.end:plan.query_end], dtype=torch.int64, device=dev)
    positions = torch.arange(plan.end, plan.query_end)
    meta = _prefill_meta(runner, [plan.block_ids], [len(ids)], [plan.query_end],
                         _slots(plan.block_ids, positions, bs))
    with model.probe_queries(range(max(check + 1, lo), hi)) as queries:
        _run_layers(runner, ids, positions.to(dev), meta, 0, runner.num_layers)
    keys = _slots(plan.block_ids, torch.arange(plan.query_end), bs).to(dev)
    total = torch.zeros(plan.query_end, dtype=torch.float32, device=dev)
    for i, q in queries.items():
        k = _read(_cache(runner, i)[0], keys, _scales(runner, i)[0])
        total += attention_mass(q, k, positions.to(dev), model.attention_scale)
    return _sum_over_ranks(total[plan.start:plan.end]).cpu()


def _check(runner, plan: BlendPlan, check: int, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor):
    """Run the span through layers 0..check; returns the hidden states after the check layer (on
    the stage that holds it, None elsewhere) and, per span token summed over all ranks, how far
    its K/V moved there from the reused copy, their size, and how far V alone moved: [3, n]."""
    dev = runner.device
    cache = _cache(runner, check)
    slots_d = slots.to(dev)
    if cache is not None:
        k_scale, v_scale = _scales(runner, check)
        old_k, old_v = _read(cache[0], slots_d, k_scale), _read(cache[1], slots_d, v_scale)
    meta = _prefill_meta(runner, [plan.block_ids], [len(ids)], [plan.end], slots)
    hidden = _run_layers(runner, ids.to(dev), positions.to(dev), meta, 0, check + 1)
    sums = torch.zeros(3, len(ids), dtype=torch.float32, device=dev)
    if cache is not None:
        new_k, new_v = _read(cache[0], slots_d, k_scale), _read(cache[1], slots_d, v_scale)
        dv = ((new_v - old_v) ** 2).sum(dim=(1, 2))
        sums[0] = ((new_k - old_k) ** 2).sum(dim=(1, 2)) + dv
        sums[1] = (new_k ** 2).sum(dim=(1, 2)) + (new_v ** 2).sum(dim=(1, 2))
        sums[2] = dv
    return hidden, _sum_over_ranks(sums).cpu()


def _blend(runner, plan: BlendPlan) -> BlendResult:
    bs, dev = runner.block_size, runner.device
    n = plan.end - plan.start
    positions = torch.arange(plan.start, plan.end)
    slots = _slots(plan.block_ids, positions, bs)
    reused = _copy_chunks(runner, plan, slots)
    for a, b in plan.forced:
        reused[max(a, plan.start) - plan.start:max(min(b, plan.end) - plan.start, 0)] = False
    ids = torch.tensor(plan.token_ids[plan.start:plan.end], dtype=torch.int64)
    num_layers = runner.num_layers
    check = min(plan.check_layer, num_layers - 1)
    want = num_to_recompute(plan.recompute_ratio, n)
    deviation, fallback = None, False
    if plan.recompute_ratio == 0 or not reused.any():
        picked = ~reused  # nothing to check: the tokens no chunk supplied run through every layer
        hidden, first = None, 0
    else:
        hidden, (diff, norm, dv) = _check(runner, plan, check, ids, positions, slots)
        rel = diff / norm.clamp_min(1e-12)
        deviation = float(rel[reused].mean())
        picked = ~reused
        if deviation > plan.max_deviation:
            picked[:] = True
            fallback = True
        else:
            extra = want - int(picked.sum())
            if extra > 0:
                # Ranked by the question's attention x how far V moved (measured on ShareGPT RAG
                # prompts, BENCHMARKS.md: KL 0.14x naive reuse's at 15%, against 0.49x for |dV| alone).
                score = dv.sqrt()
                attention = _question_attention(runner, plan, check)
                if attention is not None:
                    score = score * attention
                picked[torch.topk(score.masked_fill(~reused, float("-inf")), extra).indices] = True
        first = check + 1
    sel = picked.nonzero().flatten()
    if len(sel) and first < num_layers:
        meta = _prefill_meta(runner, [plan.block_ids], [len(sel)], [plan.end], slots[sel], positions[sel])
        inter = None
        if isinstance(hidden, IntermediateTensors):  # this stage ran the check layer
            rows = sel.to(dev)
            inter = IntermediateTensors(hidden.hidden[rows], hidden.residual[rows])
        _run_layers(runner, ids[sel].to(dev), positions[sel].to(dev), meta, first, num_layers, inter)
    recomputed = int(picked.sum())
    return BlendResult(blended=n - recomputed, recomputed=recomputed, deviation=deviation, fallback=fallback)


class BlendWorker(KVConnectorWorker):
    """Blending's worker role, built inside every rank (each runs the same plan on its layers and
    heads). The output rank's results go back in the step's output to BlendConnector."""

    def __init__(self) -> None:
        self._results: dict[str, BlendResult] | None = None

    def before_forward(self, meta: BlendStepMeta | None, runner) -> None:
        self._results = run_blend(runner, meta) if meta is not None else None

    def after_forward(self, meta: BlendStepMeta | None, runner) -> None:
        pass

    def take_output(self) -> dict[str, BlendResult] | None:
        out, self._results = self._results, None
        return out
