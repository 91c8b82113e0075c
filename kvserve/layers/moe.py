"""Mixture-of-experts feed-forward: top-k routing, then every expert's tokens in one matmul.

`FusedMoE` stacks the experts' weights: w13 [E_local, 2 * I_local, H] (gate rows, then
up rows) and w2 [E_local, H, I_local]. A forward sorts the (token, expert) pairs by
expert and runs one batched silu(x W1^T) * (x W3^T) W2^T per expert that received
tokens, instead of a loop over tokens. Three layouts over a tensor-parallel group:

- one rank: all experts, whole;
- tensor parallel: all experts, each one's intermediate dim split (Megatron's column /
  row split inside every expert); the partial outputs are all-reduced;
- expert parallel: E / tp whole experts per rank. The attention around the layer stays
  tensor-parallel, so every rank enters with the same [T, H]: rank r routes its slice
  of the tokens, sends each (token, expert) row to the expert's owner (all-to-all),
  the owner computes, the rows come back (all-to-all) and are combined, and the token
  slices are all-gathered so every rank again holds [T, H].

Routing and combining follow transformers' default experts forward op for op (float32
softmax over all experts, top-k, optional renormalisation, the routing weights in
float32 or the model dtype, a sum over the k slots), so outputs agree to rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.distributed.comm import Group
from kvserve.distributed.parallel import Parallel

_SHARDS = ("w1", "w2", "w3")  # Mixtral's names: gate, down, up


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          weights_fp32: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k], expert ids [T, k] int64).

    weights_fp32: keep the routing weights in float32 (Mixtral); otherwise they are cast
    to the logits' dtype before scaling the expert outputs (Qwen2-MoE, Qwen3-MoE)."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if not weights_fp32:
        weights = weights.to(router_logits.dtype)
    return weights, ids


def grouped_experts(x: torch.Tensor, counts: list[int], w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """Rows x [N, H] sorted by expert, counts[e] rows for local expert e -> unweighted outputs [N, H]."""
    out = x.new_empty(x.shape)
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = slice(start, start + n)
        gate, up = F.linear(x[rows], w13[e]).chunk(2, dim=-1)
        out[rows] = F.linear(F.silu(gate) * up, w2[e])
        start += n
    return out


def _sort_by_expert(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (order into the flat pairs, their token indices, their expert ids), sorted by expert.

    Stable, so within an expert the rows stay in token order."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    return order, order // ids.shape[1], flat[order]


def _combine(rows: torch.Tensor, order: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Expert outputs rows [T * k, H] (sorted by expert, order from _sort_by_expert) -> [T, H].

    transformers' default experts forward (grouped_mm): each row is scaled in the routing
    weights' dtype (float32 for Mixtral), put back in (token, slot) order and summed over the
    k slots, then cast. A sum instead of index_add_ is also deterministic on CUDA (no atomics)."""
    weighted = rows * weights.reshape(-1)[order, None]
    pairs = torch.empty_like(weighted)
    pairs[order] = weighted
    return pairs.view(*weights.shape, rows.shape[-1]).sum(dim=1).to(dtype)


class FusedMoE(nn.Module):
    """The routed experts of one MoE layer: forward(hidden [T, H], router_logits [T, E]) -> [T, H]."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 parallel: Parallel | None = None, renormalize: bool = True, weights_fp32: bool = False,
                 intermediate_name: str = "moe_intermediate_size") -> None:
        super().__init__()
        parallel = parallel or Parallel()
        tp = parallel.tp
        self.tp: Group = tp
        self.num_experts, self.top_k = num_experts, top_k
        self.renormalize, self.weights_fp32 = renormalize, weights_fp32
        self.expert_parallel = parallel.enable_expert_parallel and tp.size > 1
        if parallel.enable_expert_parallel and num_experts % tp.size:
            raise ValueError(f"enable_expert_parallel with tensor_parallel_size={tp.size} does not divide "
                             f"num_experts ({num_experts}): each rank holds num_experts / tensor_parallel_size "
                             "whole experts")
        if not self.expert_parallel and intermediate_size % tp.size:
            raise ValueError(f"tensor_parallel_size={tp.size} does not divide {intermediate_name} "
                             f"({intermediate_size}); choose another size or enable_expert_parallel")
        ways = tp.size if self.expert_parallel else 1
        self.num_local_experts = num_experts // ways
        self.expert_start = tp.rank * self.num_local_experts if self.expert_parallel else 0
        self.intermediate = intermediate_size // (1 if self.expert_parallel else tp.size)
        self.w13 = nn.Parameter(torch.empty(self.num_local_experts, 2 * self.intermediate, hidden_size),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(self.num_local_experts, hidden_size, self.intermediate),
                               requires_grad=False)

    def extra_repr(self) -> str:
        mode = "expert parallel" if self.expert_parallel else f"tp={self.tp.size}"
        return (f"experts={self.num_experts} (local {self.expert_start}..{self.expert_start + self.num_local_experts}),"
                f" top_k={self.top_k}, intermediate={self.intermediate}, {mode}")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, str]) -> None:
        """Fill expert shard_id[0]'s w1 (gate [I, H]), w3 (up [I, H]) or w2 (down [H, I]) from its full
        checkpoint tensor; another rank's expert (expert parallel) is skipped."""
        expert, which = shard_id
        if which not in _SHARDS or not 0 <= expert < self.num_experts:
            raise ValueError(f"unknown expert weight {shard_id!r} (experts 0..{self.num_experts - 1}, {_SHARDS})")
        local = expert - self.expert_start
        if not 0 <= local < self.num_local_experts:
            return
        n = self.intermediate
        part = slice(self.tp.rank * n, (self.tp.rank + 1) * n) if not self.expert_parallel else slice(0, n)
        if which == "w2":
            dst, src = param.data[local], loaded[:, part]
        else:
            rows = slice(0, n) if which == "w1" else slice(n, 2 * n)
            dst, src = param.data[local, rows], loaded[part]
        if tuple(dst.shape) != tuple(src.shape):
            raise ValueError(f"expert {expert} {which}: shape {tuple(loaded.shape)} (shard {tuple(src.shape)}) "
                             f"does not fit {tuple(dst.shape)}")
        dst.copy_(src)

    def forward(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        if hidden.shape[0] == 0:  # every rank of the group has the same T, so all skip the collectives
            return hidden.clone()
        if self.expert_parallel:
            return self._forward_expert_parallel(hidden, router_logits)
        weights, ids = route(router_logits, self.top_k, self.renormalize, self.weights_fp32)
        order, token_idx, expert_ids = _sort_by_expert(ids)
        counts = torch.bincount(expert_ids, minlength=self.num_experts).tolist()
        rows = grouped_experts(hidden[token_idx], counts, self.w13, self.w2)
        out = _combine(rows, order, weights, hidden.dtype)
        return self.tp.all_reduce(out)  # tensor parallel: each rank's rows are partial sums over its I slice

    def _forward_expert_parallel(self, hidden: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        tp, n = self.tp, self.tp.size
        base, extra = divmod(hidden.shape[0], n)
        sizes = [base + (r < extra) for r in range(n)]
        start = sum(sizes[:tp.rank])
        mine = slice(start, start + sizes[tp.rank])
        x = hidden[mine]
        weights, ids = route(router_logits[mine], self.top_k, self.renormalize, self.weights_fp32)
        order, token_idx, expert_ids = _sort_by_expert(ids)
        # Experts are owned in contiguous ranges, so rows sorted by expert are sorted by owner too.
        send = torch.bincount(expert_ids // self.num_local_experts, minlength=n)
        recv = tp.all_to_all(send, [1] * n, [1] * n)
        send_splits, recv_splits = send.tolist(), recv.tolist()
        got_x = tp.all_to_all(x[token_idx], recv_splits, send_splits)
        got_ids = tp.all_to_all(expert_ids, recv_splits, send_splits) - self.expert_start
        back = tp.all_to_all(self._owner_compute(got_x, got_ids), send_splits, recv_splits)
        return self._gather_slices(_combine(back, order, weights, x.dtype), sizes)

    def _owner_compute(self, x: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """Rows from every rank (each sender's sorted, the whole not) -> outputs in the order received."""
        order = torch.argsort(local_ids, stable=True)
        counts = torch.bincount(local_ids, minlength=self.num_local_experts).tolist()
        out = torch.empty_like(x)
        out[order] = grouped_experts(x[order], counts, self.w13, self.w2)
        return out

    def _gather_slices(self, part: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """Every rank's token slice, in rank order: all_gather needs equal shapes, so pad to the longest."""
        longest = max(sizes)
        padded = part.new_zeros(longest, part.shape[1])
        padded[:part.shape[0]] = part
        full = self.tp.all_gather(padded, dim=0)
        return torch.cat([full[r * longest:r * longest + s] for r, s in enumerate(sizes)])
