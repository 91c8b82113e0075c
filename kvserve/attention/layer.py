"""The Attention module models use; the backend is swapped in by the model runner."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.attention.backend import AttentionBackend, AttentionMetadata, get_backend


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend: AttentionBackend = get_backend("torch")

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads * head_dim]
        k: torch.Tensor,  # [T, num_kv_heads * head_dim]
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, num_heads * head_dim]
        t = q.shape[0]
        out = self.backend.forward(
            q.view(t, self.num_heads, self.head_dim),
            k.view(t, self.num_kv_heads, self.head_dim),
            v.view(t, self.num_kv_heads, self.head_dim),
            kv_cache[0], kv_cache[1], meta, self.scale,
        )
        return out.reshape(t, self.num_heads * self.head_dim)


def set_attention_backend(model: nn.Module, backend: AttentionBackend) -> None:
    for m in model.modules():
        if isinstance(m, Attention):
            m.backend = backend
