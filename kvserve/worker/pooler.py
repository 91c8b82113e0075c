"""Pooling of one request's final hidden states across its prefill chunks (embeddings)."""

from __future__ import annotations

import torch

from kvserve.pooling_params import PoolingParams


class Pooler:
    """Accumulates one embedding request's hidden rows chunk by chunk: MEAN keeps a running sum
    (float32) and a count, LAST the newest row. The runner makes a new one whenever the request is
    (re)scheduled from scratch, so a preempted request's recompute starts clean."""

    def __init__(self, spec: PoolingParams) -> None:
        self.spec = spec
        self.sum: torch.Tensor | None = None
        self.count = 0
        self.last: torch.Tensor | None = None

    def add(self, rows: torch.Tensor) -> None:
        """This step's hidden rows [n, hidden] of the request, in position order."""
        if self.spec.pooling_type == "MEAN":
            s = rows.float().sum(dim=0)
            self.sum = s if self.sum is None else self.sum + s
            self.count += rows.shape[0]
        else:
            self.last = rows[-1].float()

    def result(self) -> list[float]:
        vec = self.sum / self.count if self.spec.pooling_type == "MEAN" else self.last
        assert vec is not None, "pooled before any hidden state was added"
        if self.spec.normalize:
            vec = torch.nn.functional.normalize(vec, dim=0)
        return vec.tolist()
