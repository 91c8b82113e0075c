"""Whole KV blocks at one rank, for the KV connectors' worker roles.

A block's K/V are split across ranks: its layers across pipeline stages, its KV heads across
tensor-parallel ranks (rank = stage * tp_size + tp_rank). A worker role that moves whole blocks
(prefill/decode transfer) gathers them at the output rank (last stage, first tensor-parallel rank,
whose step output reaches the engine) and scatters whole blocks from there, over the world's
process group; the engine process never holds them. A whole block is laid out as one rank's
(`ModelRunner.read_kv_blocks`): [layers, 2, block_size, kv_heads, head_dim].

Every rank calls `gather` / `scatter` for the same blocks in the same step (the step's connector
plan is the same on every rank), so the sends and receives pair up.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


def whole_block_shape(shapes: list[tuple[int, ...]], tp: int, pp: int) -> tuple[int, ...]:
    """One whole block's shape from every rank's piece of it (in rank order)."""
    layers = sum(shapes[s * tp][0] for s in range(pp))
    heads = sum(shapes[t][3] for t in range(tp))
    first = shapes[0]
    return (layers, first[1], first[2], heads, first[4])


def assemble(parts: list[torch.Tensor], tp: int, pp: int) -> torch.Tensor:
    """[n, *whole] from every rank's [n, *piece], in rank order."""
    stages = [torch.cat(parts[s * tp:(s + 1) * tp], dim=4) for s in range(pp)]
    return torch.cat(stages, dim=1)


def split(data: torch.Tensor, shapes: list[tuple[int, ...]], tp: int, pp: int) -> list[torch.Tensor]:
    """Each rank's piece of [n, *whole] blocks, in rank order."""
    pieces, layer = [], 0
    for s in range(pp):
        n_layers = shapes[s * tp][0]
        stage = data[:, layer:layer + n_layers]
        layer += n_layers
        head = 0
        for t in range(tp):
            heads = shapes[s * tp + t][3]
            pieces.append(stage[:, :, :, :, head:head + heads].contiguous())
            head += heads
    return pieces


class WholeBlocks:
    """Built once per rank (every rank at once: it exchanges the pieces' shapes)."""

    def __init__(self, runner, tp: int, pp: int, rank: int) -> None:
        self.runner = runner
        self.tp, self.pp, self.rank = tp, pp, rank
        self.world = tp * pp
        self.leader = (pp - 1) * tp
        self.is_leader = rank == self.leader
        mine = tuple(runner.kv_block_shape)
        if self.world == 1:
            self.shapes = [mine]
        else:
            self.shapes: list[tuple[int, ...]] = [()] * self.world
            dist.all_gather_object(self.shapes, mine)
        self.shape = whole_block_shape(self.shapes, tp, pp)
        self.dtype = runner.kv_dtype

    def gather(self, block_ids: list[int]) -> torch.Tensor | None:
        """[n, *whole] on the leader (None elsewhere)."""
        mine = self.runner.read_kv_blocks(block_ids)
        if self.world == 1:
            return mine
        if not self.is_leader:
            dist.send(_bytes(mine), self.leader)
            return None
        parts = []
        for r in range(self.world):
            if r == self.rank:
                parts.append(mine)
                continue
            buf = torch.empty(len(block_ids) * math.prod(self.shapes[r]) * self.dtype.itemsize, dtype=torch.uint8)
            dist.recv(buf, r)
            parts.append(buf.view(self.dtype).view(len(block_ids), *self.shapes[r]))
        return assemble(parts, self.tp, self.pp)

    def scatter(self, block_ids: list[int], data: torch.Tensor | None) -> None:
        """Write [n, *whole] blocks (given on the leader, None elsewhere) into every rank's piece."""
        if self.is_leader and tuple(data.shape) != (len(block_ids), *self.shape):  # every rank raises alike
            raise ValueError(f"KV block data is {list(data.shape)}; {len(block_ids)} blocks of this cache are "
                             f"{[len(block_ids), *self.shape]}")
        if self.world == 1:
            self.runner.write_kv_blocks(block_ids, data)
            return
        if self.is_leader:
            pieces = split(data, self.shapes, self.tp, self.pp)
            for r, piece in enumerate(pieces):
                if r != self.rank:
                    dist.send(_bytes(piece), r)
            self.runner.write_kv_blocks(block_ids, pieces[self.rank])
            return
        buf = torch.empty(len(block_ids) * math.prod(self.shapes[self.rank]) * self.dtype.itemsize, dtype=torch.uint8)
        dist.recv(buf, self.leader)
        self.runner.write_kv_blocks(block_ids, buf.view(self.dtype).view(len(block_ids), *self.shapes[self.rank]))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """As flat bytes (gloo has no float8 type)."""
    return t.contiguous().view(torch.uint8).reshape(-1)
