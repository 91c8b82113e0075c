"""Attention backend interface, metadata of a flat batch, and the registry."""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Describes one flat batch: all scheduled tokens of all requests, concatenated.

    Requests are ordered decodes first (one query token each), then prefill
    chunks. Request i owns query tokens [query_start_loc[i], query_start_loc[i+1])
    and, after this step, has seq_lens[i] tokens of context in the KV cache
    (its cached prefix plus these query tokens).
    """

    num_decodes: int
    query_start_loc: list[int]  # [B + 1]
    seq_lens: list[int]  # [B]
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset of each token
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    seq_lens_tensor: torch.Tensor  # [B] int64
    block_size: int
    # [T] int64, the position of each query token, where a prefill request's query tokens are not
    # the last ones of its context (a blend's recomputed tokens, blend/): each sees the keys up to its
    # own position. None: they are the last ones. The triton backend refuses it.
    query_positions: torch.Tensor | None = None
    # [B + 1] int32 on the device: query_start_loc, made by whoever fills the batch (the model
    # runner; a CUDA graph's static buffer) so a backend need not copy the list over each step.
    # None: the backend builds it from query_start_loc.
    query_start_tensor: torch.Tensor | None = None

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]


FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8 e4m3fn


def saturate_fp8(x: torch.Tensor) -> torch.Tensor:
    """x rounded to the nearest float8 e4m3fn, saturated to +-448 (a plain cast may give NaN out of range)."""
    return torch.clamp(x, -FP8_MAX, FP8_MAX).to(FP8)


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale as float8 e4m3fn, saturated (`saturate_fp8`)."""
    return saturate_fp8(x * (1.0 / scale))


class AttentionBackend(ABC):
    """Writes the new K/V of a flat batch into the paged cache and attends.

    Contract: every token's K/V is written before any attention is computed, so
    a request may read blocks that another request in the same batch writes.
    A float8 e4m3fn cache (kv_cache_dtype fp8) holds quantize_fp8(k, k_scale) and
    quantize_fp8(v, v_scale) and is read back as code * scale; other caches hold K/V
    in their own dtype and the scales are 1.
    """

    name: str = ""

    def tune(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
             bf16_products: bool = False, kv_dtype: torch.dtype | None = None) -> None:
        """Make the choices that depend on the model's attention shapes (heads of one rank), its
        dtype and the cache's (kv_dtype, default dtype), once, before the first forward: by
        measuring, where a backend has choices. bf16_products: prefill attention may take its dot
        products in bfloat16 (the model's prefill linears already round activations to int8 codes,
        a coarser rounding)."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k: torch.Tensor,  # [T, Hkv, D]
        v: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> torch.Tensor:  # [T, Hq, D]
        ...


_BACKENDS: dict[str, type[AttentionBackend]] = {}
# Backends whose module is imported when first asked for (triton is an optional, heavy import).
_LAZY = {"triton": "kvserve.attention.triton_backend"}


def register_backend(cls: type[AttentionBackend]) -> type[AttentionBackend]:
    _BACKENDS[cls.name] = cls
    return cls


def get_backend(name: str = "torch") -> AttentionBackend:
    if name not in _BACKENDS and name in _LAZY:
        importlib.import_module(_LAZY[name])
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; available: {sorted(_BACKENDS)}")
    return _BACKENDS[name]()

