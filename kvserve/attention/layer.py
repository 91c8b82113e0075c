"""The Attention module models use; the backend is swapped in by the model runner."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.attention.backend import AttentionBackend, AttentionMetadata, get_backend


class Attention(nn.Module):
    """One layer's attention over its paged KV cache.

    k_scale / v_scale: what the layer's fp8 cache codes are multiplied by (1 for other
    caches); set by the model runner from a calibration forward. While kv_amax is a tensor
    (that calibration forward), each call folds max |k| and max |v| into it, [2] float32.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.backend: AttentionBackend = get_backend("torch")
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.kv_amax: torch.Tensor | None = None

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads * head_dim]
        k: torch.Tensor,  # [T, num_kv_heads * head_dim]
        v: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, num_heads * head_dim]
        t = q.shape[0]
        if self.kv_amax is not None:
            amax = torch.stack((k.abs().amax(), v.abs().amax())).float()
            self.kv_amax = torch.maximum(self.kv_amax, amax)
        out = self.backend.forward(
            q.view(t, self.num_heads, self.head_dim),
            k.view(t, self.num_kv_heads, self.head_dim),
            v.view(t, self.num_kv_heads, self.head_dim),
            kv_cache[0], kv_cache[1], meta, self.scale, self.k_scale, self.v_scale,
        )
        return out.reshape(t, self.num_heads * self.head_dim)


def set_attention_backend(model: nn.Module, backend: AttentionBackend) -> None:
    for m in model.modules():
        if isinstance(m, Attention):
            m.backend = backend
