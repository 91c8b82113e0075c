"""Tensor-parallel linears and vocab-parallel embeddings (Megatron's split, vLLM's names).

Each module holds only this rank's shard. Its `weight_loader(param, full_tensor,
shard_id)` narrows a checkpoint tensor to the shard for each of its parameters, so a
model's load_weights never knows the rank. With a one-rank group every module is an ordinary
nn.Linear / nn.Embedding and costs nothing extra.

- ColumnParallelLinear splits the output features; a fused one (q/k/v, gate/up) lists
  its parts' full sizes and splits each part, so rank r holds [q_r | k_r | v_r].
- RowParallelLinear splits the input features and all-reduces the partial products;
  its bias is added once, after the sum.
- A quantized kernel (quant/) replaces only the matmul: `set_kernel`, the split and
  the all-reduce stay here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.distributed.comm import Group
from kvserve.distributed.parallel import split_range


def _divide(n: int, size: int, what: str) -> int:
    if n % size:
        raise ValueError(f"tensor_parallel_size={size} does not divide {what} ({n})")
    return n // size


class ParallelLinear(nn.Linear):
    """nn.Linear over this rank's shard; subclasses say how a full weight is narrowed."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: Group) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.tp = tp
        self.kernel: nn.Module | None = None

    def set_kernel(self, kernel: nn.Module) -> None:
        """Run `kernel` (a quantized matmul built from the shard) instead of the float weight."""
        if "weight" in self._parameters:
            del self._parameters["weight"]
            self.weight = None
        self.kernel = kernel

    def set_weight(self, weight: torch.Tensor) -> None:
        """Back to a float matmul over `weight` (this shard's, [out, in])."""
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.kernel = None

    @property
    def kernel_bias(self) -> torch.Tensor | None:
        """The bias a kernel built for this shard adds itself."""
        return self.bias

    def part_rows(self, shard_id: int | None) -> slice:
        """Rows of this module's (local) weight that checkpoint part shard_id fills."""
        return slice(0, self.out_features)

    def shard(self, w, shard_id: int | None = None):
        """This rank's piece of a full checkpoint tensor (or QuantizedWeight / Fp8Weight)."""
        return w

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        dst = param.data[self.part_rows(shard_id)]
        src = self.shard(loaded, shard_id)
        if tuple(dst.shape) != tuple(src.shape):
            raise ValueError(f"shape {tuple(loaded.shape)} (shard {tuple(src.shape)}) does not fit {tuple(dst.shape)}")
        dst.copy_(src)

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(x)
        return F.linear(x, self.weight, bias)


class ColumnParallelLinear(ParallelLinear):
    """Output features split across ranks; output_sizes lists a fused weight's full parts.

    Each part splits evenly unless `shards` gives this rank's (start, size) in every part
    (attention heads that do not divide evenly)."""

    def __init__(self, in_features: int, output_sizes: int | list[int], bias: bool, tp: Group,
                 what: str = "the output features", shards: list[tuple[int, int]] | None = None) -> None:
        self.output_sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        if shards is None:
            shards = [(tp.rank * (n := _divide(size, tp.size, what)), n) for size in self.output_sizes]
        self.shards = shards
        self.local_sizes = [n for _, n in shards]
        super().__init__(in_features, sum(self.local_sizes), bias, tp)

    def part_rows(self, shard_id: int | None) -> slice:
        i = shard_id or 0
        start = sum(self.local_sizes[:i])
        return slice(start, start + self.local_sizes[i])

    def shard(self, w, shard_id: int | None = None):
        if self.tp.size == 1:
            return w
        start, n = self.shards[shard_id or 0]
        sl = slice(start, start + n)
        return w.rows(sl) if hasattr(w, "rows") else w[sl]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._matmul(x, self.bias)


def kv_head_range(num_kv_heads: int, tp: Group) -> tuple[int, int]:
    """This rank's key/value heads [start, end): whole heads, as even as they go."""
    return split_range(num_kv_heads, tp.rank, tp.size)


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v: each rank holds its key/value heads and the query heads that share them."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool, tp: Group) -> None:
        start, end = kv_head_range(num_kv_heads, tp)
        group = num_heads // num_kv_heads
        q = (start * group * head_dim, (end - start) * group * head_dim)
        kv = (start * head_dim, (end - start) * head_dim)
        super().__init__(hidden, [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], bias, tp,
                         shards=[q, kv, kv])
        self.num_heads, self.num_kv_heads = (end - start) * group, end - start


class RowParallelLinear(ParallelLinear):
    """Input features split across ranks; partial products are summed over the group.

    `shard` (start, size) gives this rank's input features when they do not split evenly."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: Group,
                 what: str = "the input features", shard: tuple[int, int] | None = None) -> None:
        if shard is None:
            n = _divide(in_features, tp.size, what)
            shard = (tp.rank * n, n)
        self.in_start = shard[0]
        super().__init__(shard[1], out_features, bias, tp)

    @property
    def kernel_bias(self) -> torch.Tensor | None:
        return None  # added after the all-reduce, once

    def shard(self, w, shard_id: int | None = None):
        if self.tp.size == 1 or len(w.shape) == 1:  # the bias is whole on every rank
            return w
        sl = slice(self.in_start, self.in_start + self.in_features)
        return w.cols(sl) if hasattr(w, "cols") else w[:, sl]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(self._matmul(x, None))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows of the vocabulary split across ranks (the last shard padded); the lookup is an
    all-reduce of each rank's rows with the others' zeroed."""

    def __init__(self, vocab_size: int, hidden: int, tp: Group) -> None:
        super().__init__()
        self.vocab_size, self.tp = vocab_size, tp
        self.per_rank = -(-vocab_size // tp.size)
        self.start = tp.rank * self.per_rank
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden))
        self.kernel: nn.Module | None = None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        if loaded.shape[0] != self.vocab_size or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(f"shape {tuple(loaded.shape)} does not fit ({self.vocab_size}, {param.shape[1]})")
        rows = loaded[self.start:self.start + self.per_rank]
        param.data.zero_()
        param.data[:rows.shape[0]].copy_(rows)

    def set_kernel(self, kernel: nn.Module) -> None:
        """Keep the table compressed in `kernel` (a quantized linear over [vocab, hidden], one rank):
        lookups dequantize their rows, the LM head runs the kernel's matmul."""
        if self.tp.size != 1:
            raise ValueError("a compressed vocabulary table needs tensor_parallel_size 1")
        if "weight" in self._parameters:
            del self._parameters["weight"]
            self.weight = None
        self.kernel = kernel

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel.rows(ids).to(self.kernel.dtype)
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        h.masked_fill_(outside[:, None], 0)
        return self.tp.all_reduce(h)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection over the same vocabulary split; logits are gathered whole."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(hidden)
        logits = F.linear(hidden, self.weight)
        if self.tp.size > 1:
            logits = self.tp.all_gather(logits, dim=-1)[:, :self.vocab_size]
        return logits
