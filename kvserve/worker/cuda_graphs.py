"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode step on a GPU is bound by launches, not by arithmetic: each layer is a dozen small
kernels, each a few microseconds of work and as many of host-side launch. Captured once per
bucket and replayed, the whole forward is one launch. What makes the forward capturable:

- Static inputs. Token ids, positions, KV slots, block tables, context lengths and query
  starts live in buffers made once. A step copies its values into the first rows of its
  bucket and pads the rest: slot -1 (the KV write skips it) and context length 0 (attention
  reads nothing for that row and returns zeros); the padded rows' outputs are dropped.
- No host reads of device values inside the forward, and launch grids that depend on shapes
  only. The triton attention backend is written so (its split-K count follows the block
  table's width, fixed here at max_model_len / block_size); the torch and cpu backends walk
  the requests on the host, so graphs run with triton only; MoE models, whose forward reads the
  experts' token counts on the host, stay eager (`enable`, logged), as does any forward whose
  capture fails.
- The graph's output tensor is read before the next replay overwrites it.

`capture=False` runs the same static-buffer path eagerly: that is how the buckets, the
padding and the buffers are tested on a CPU (kernels in Triton's interpreter).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable

import torch

from kvserve.attention import AttentionMetadata

logger = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]
MAX_CAPTURE_BATCH = 256  # past this a decode step has work enough to hide its launches


def capture_sizes(max_batch: int) -> list[int]:
    """Batch-size buckets up to max_batch: 1, 2, 4, then every 8 (padding wastes at most 7 rows,
    a small share once batches are large enough for that to be cheap), and max_batch itself."""
    top = min(max_batch, MAX_CAPTURE_BATCH)
    sizes = [b for b in (1, 2, 4) if b < top] + list(range(8, top, 8))
    return sizes + [top]


class DecodeGraphs:
    """Runs decode-only steps (every request one query token) through static buffers, replaying a
    captured graph per bucket (capture=True, CUDA) or calling `forward` on the buffers."""

    def __init__(self, forward: Forward, device: torch.device, max_batch: int, max_blocks: int,
                 block_size: int, capture: bool = True) -> None:
        self.forward = forward
        self.buckets = capture_sizes(max_batch)
        self.max_blocks = max_blocks
        self.block_size = block_size
        self.capture = capture
        b, dev = self.buckets[-1], device
        self.input_ids = torch.zeros(b, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(b, dtype=torch.int64, device=dev)
        self.slots = torch.full((b,), -1, dtype=torch.int64, device=dev)
        self.block_tables = torch.zeros(b, max_blocks, dtype=torch.int64, device=dev)
        self.seq_lens = torch.zeros(b, dtype=torch.int64, device=dev)
        self.query_start = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _meta(self, b: int, seq_lens: list[int]) -> AttentionMetadata:
        """Bucket b's metadata over the static buffers. The lists are what eager code reads; a
        captured graph keeps the device buffers only, whatever the lists said at capture."""
        return AttentionMetadata(
            num_decodes=b, query_start_loc=list(range(b + 1)), seq_lens=seq_lens, slot_mapping=self.slots[:b],
            block_tables=self.block_tables[:b], seq_lens_tensor=self.seq_lens[:b], block_size=self.block_size,
            query_start_tensor=self.query_start[:b + 1])

    def capture_all(self) -> None:
        """Capture every bucket, largest first (the smaller ones then fit in its memory pool). The
        buffers hold padding only (slots -1, lengths 0), so warm-up and capture write no KV."""
        pool = torch.cuda.graph_pool_handle()
        for b in reversed(self.buckets):
            meta = self._meta(b, [0] * b)
            for _ in range(2):  # outside the capture: Triton compiles, allocators settle
                self.forward(self.input_ids[:b], self.positions[:b], meta)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.forward(self.input_ids[:b], self.positions[:b], meta)
            self.graphs[b] = (graph, out)

    def runs(self, meta: AttentionMetadata) -> bool:
        """Whether this step fits: decodes only, within the largest bucket and the table width."""
        return (meta.num_decodes == meta.num_reqs <= self.buckets[-1] and meta.query_positions is None
                and meta.block_tables.shape[1] <= self.max_blocks)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Final hidden states [n, hidden] of a decode-only step (`runs(meta)`)."""
        n = meta.num_reqs
        b = self.buckets[bisect.bisect_left(self.buckets, n)]
        # device to device: queued on the stream like the replay that reads them
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slots[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens_tensor)
        self.block_tables[:n, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        # Padding: no KV written, nothing attended. Rows past b keep old values no replay reads.
        self.input_ids[n:b] = 0
        self.positions[n:b] = 0
        self.slots[n:b] = -1
        self.seq_lens[n:b] = 0
        if not self.capture:
            meta = self._meta(b, meta.seq_lens + [0] * (b - n))
            return self.forward(self.input_ids[:b], self.positions[:b], meta)[:n]
        graph, out = self.graphs[b]
        graph.replay()
        return out[:n]


def enable(forward: Forward, device: torch.device, max_batch: int, max_blocks: int, block_size: int,
           capture: bool = True, why_not: str | None = None) -> DecodeGraphs | None:
    """DecodeGraphs with every bucket captured, or None (logged) when the forward cannot be captured:
    why_not says so up front (a model known to sync on the host); a failed capture is the safety net."""
    if why_not is not None:
        logger.info("CUDA graphs are off: %s; decode runs eagerly", why_not)
        return None
    graphs = DecodeGraphs(forward, device, max_batch, max_blocks, block_size, capture)
    if not capture:
        return graphs
    try:
        graphs.capture_all()
    except Exception as e:  # a host sync in the forward, a kernel the capture refuses, a Triton compile error
        logger.warning("CUDA graphs are off: the decode forward could not be captured (%s); running eagerly", e)
        return None
    logger.info("CUDA graphs: decode captured for batch sizes %s", graphs.buckets)
    return graphs
