"""KQuantLinear: a linear over raw GGUF K-quant rows (Q4_K, Q5_K, Q6_K), read in place.

The rows keep the file's bytes (Q6_K: 210 bytes per 256 weights, a fifth of float32's; Q6_K parts
whose rows come in 8s regrouped by 8 rows, kquant.interleave), so a decode step reads ~4x fewer
bytes than a dequantized weight. Decode-sized batches: the C kernel (kvserve/kernels/kquant)
multiplies them with int16 activations. Prefill-sized batches are compute-bound: from `int8_from`
tokens int8 activations against the codes (kquant.matmul_int8, 8 rows at a time decoded into a
copy every token uses), and from `dense_from` the weight dequantized per call and one F.linear in
`dense_dtype` (bfloat16 where the CPU has bfloat16 units; None: x's dtype), where tuning found
each faster (kvserve.kernels.tuning.tune_kquant_linears). A fused linear (q/k/v, gate/up) may hold
parts of different K-quant types: each is a range of output rows. Without the C kernel, or off the CPU, the
weight is dequantized once at build instead (path "dense"), as the loader did before these types
were kept.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kvserve.quant.gguf import KQuantWeight
from kvserve.quant.linear import InplaceWeight, _QuantLinear
from kvserve.kernels import kquant
from kvserve.kernels.tuning import NEVER

logger = logging.getLogger(__name__)

DENSE_FROM = 16  # tokens from which dequantize + F.linear beats the kernel (prefill); untuned default


class KQuantLinear(_QuantLinear):
    """y = x @ W.T (+ bias) for W the rows of `parts` stacked in order.

    Buffers: `raw` uint8, every part's rows back to back (one buffer, so `.to()` moves it whole);
    `parts` lists (qtype, rows, byte offset) per part. `matrix()` is the C view of the buffer."""

    def __init__(self, parts: KQuantWeight | Sequence[KQuantWeight], bias: torch.Tensor | None,
                 dtype: torch.dtype, device: str | torch.device = "cpu") -> None:
        parts = [parts] if isinstance(parts, KQuantWeight) else list(parts)
        device = torch.device(device)
        n_in = parts[0].shape[1]
        if any(p.shape[1] != n_in for p in parts) or not 0 < len(parts) <= kquant.MAX_PARTS:
            raise ValueError(f"K-quant parts must share the input dim and number 1..{kquant.MAX_PARTS}: "
                             f"{[p.shape for p in parts]}")
        super().__init__(sum(p.shape[0] for p in parts), n_in, None, bias, dtype, device)
        self.dense_from = DENSE_FROM
        self.dense_dtype: torch.dtype | None = None
        self.int8_from = NEVER  # from int8_from rows up to dense_from int8 activations against the codes (tuning)
        self.qtypes = [p.qtype for p in parts]
        if device.type != "cpu" or kquant.load() is None:
            self.path = "dense"
            w = torch.cat([p.dequantize() for p in parts])
            self.register_buffer("weight", w.to(device=device, dtype=dtype))
            logger.info("K-quant linear [%d, %d] dequantized to %s: the K-quant kernel runs on a CPU with a C "
                        "compiler only", self.out_features, n_in, dtype)
            return
        self.path = "kquant"
        self.parts, offset, stored = [], 0, []
        for p in parts:  # Q6_K rows in 8s interleaved by 8 (kquant.interleave): the same bytes
            qtype, rows = kquant.interleave(p.qtype, p.blocks)
            self.parts.append((qtype, p.shape[0], offset))
            stored.append(rows.reshape(-1))
            offset += rows.numel()
        self.register_buffer("raw", torch.cat(stored).to(device))

    def part_rows(self) -> list[tuple[int, torch.Tensor]]:
        """(qtype, uint8 rows [n, bytes per row]) of each part: views into `raw`."""
        raw = self._buffers["raw"]
        return [(q, raw[off: off + n * kquant.row_bytes(q, self.in_features)].view(n, -1))
                for q, n, off in self.parts]

    def inplace_weight(self) -> InplaceWeight | None:
        if self.path != "kquant":
            return None
        return InplaceWeight(self.out_features, self.in_features, min(self.dense_from, self.int8_from),
                             kquant_parts=self.part_rows())

    def matrix(self) -> kquant.KqMatrix:
        """The C view of the weight (built once; again if the buffer was moved)."""
        m = self.__dict__.get("_matrix")
        raw = self._buffers["raw"]
        if m is None or self.__dict__.get("_matrix_of") is not raw:
            m = self.__dict__["_matrix"] = kquant.make_matrix(self.part_rows(), self.in_features)
            self.__dict__["_matrix_of"] = raw
        return m

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        if self.path == "dense":
            return F.linear(x, self.weight.to(x.dtype))
        if x.shape[0] >= self.dense_from:  # prefill-sized: compute-bound, one dense matmul
            dt = self.dense_dtype or x.dtype
            return F.linear(x.to(dt), kquant.dequantize(self.matrix(), dt, reuse=True)).to(x.dtype)
        if x.shape[0] >= self.int8_from:  # mid-sized, int8 codes (tuning chose)
            return kquant.matmul_int8(x.float(), self.matrix()).to(x.dtype)
        return kquant.matmul(x.float(), self.matrix()).to(x.dtype)

    def _stored_weight(self) -> torch.Tensor:
        if self.path == "dense":
            return self.weight.float()
        return kquant.dequantize(self.matrix())

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of W in float32, only those dequantized: an embedding lookup in a K-quant table."""
        ids = ids.reshape(-1)
        if self.path == "dense":
            return self.weight.index_select(0, ids).float()
        return kquant.take_rows(self.matrix(), ids)

    def extra_repr(self) -> str:
        names = {kquant.Q4_K: "Q4_K", kquant.Q5_K: "Q5_K", kquant.Q6_K: "Q6_K"}
        return f"{super().extra_repr()}, types={'+'.join(names[q] for q in self.qtypes)}"
