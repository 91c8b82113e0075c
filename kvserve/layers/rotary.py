"""Rotary position embedding (neox / HF "rotate_half" layout) with a precomputed cos/sin cache."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from kvserve.kernels import ops

# Rope types whose frequencies depend on the sequence length at run time; a
# position-indexed cache cannot express them.
_DYNAMIC_TYPES = ("dynamic", "longrope")


def rope_parameters_of(config: Any) -> dict[str, Any]:
    """The rope parameters of an HF config as one flat dict with rope_type and rope_theta.

    transformers 5.x keeps them in `config.rope_parameters` (rope_theta inside);
    4.x configs keep `rope_theta` on the config and the scaling in `rope_scaling`.
    """
    raw = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    params = dict(raw)
    if "full_attention" in params and isinstance(params["full_attention"], dict):
        params = dict(params["full_attention"])  # per-layer-type params: models here use full attention
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
    return params


def compute_inv_freq(head_dim: int, params: dict[str, Any], max_position: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] (float32) and the cos/sin scaling factor."""
    base = float(params["rope_theta"])
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / float(params["factor"]), 1.0
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, params, max_position), 1.0
    raise ValueError(f"unsupported rope_type {rope_type!r}; supported: default, linear, llama3"
                     + (" (seq-len dependent types are not supported)" if rope_type in _DYNAMIC_TYPES else ""))


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict[str, Any], max_position: int) -> torch.Tensor:
    factor = float(p["factor"])
    low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_len = float(p.get("original_max_position_embeddings", max_position))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin for positions 0..max_position-1, applied to flat [T, H*D] q and k.

    The cache is computed in float32 and kept in the module's dtype, which is
    what HF does (it casts cos/sin to the activation dtype before applying).
    """

    def __init__(self, head_dim: int, max_position: int, params: dict[str, Any]) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.params = dict(params)
        self.register_buffer("cos_cache", torch.empty(0), persistent=False)
        self.register_buffer("sin_cache", torch.empty(0), persistent=False)
        self.reset_cache()

    def reset_cache(self) -> None:
        """(Re)compute cos/sin; call after `to_empty()` on a model built on the meta device."""
        inv_freq, scaling = compute_inv_freq(self.head_dim, self.params, self.max_position)
        t = torch.arange(self.max_position, dtype=torch.float32, device="cpu")
        freqs = torch.outer(t, inv_freq)  # [P, D/2]
        device, dtype = self.cos_cache.device, self.cos_cache.dtype
        if device.type == "meta":
            device = torch.device("cpu")
        self.cos_cache = (freqs.cos() * scaling).to(device=device, dtype=dtype)
        self.sin_cache = (freqs.sin() * scaling).to(device=device, dtype=dtype)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, D/2] for broadcasting over heads."""
        return self.cos_cache[positions].unsqueeze(1), self.sin_cache[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D]; rotates the two halves of D (HF rotate_half layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotate_qk(q: torch.Tensor, k: torch.Tensor, head_dim: int, cos: torch.Tensor,
              sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq * D], k [T, Hkv * D] (column slices of the qkv output) rotated: in place by one fused
    C call each where it runs (float32 on a CPU), else with apply_rotary."""
    t = q.shape[0]
    if ops.usable(q, k, cos) and q.stride(-1) == 1 and k.stride(-1) == 1:
        c, s = cos.reshape(t, -1), sin.reshape(t, -1)
        ops.rotary_(q, q.shape[1] // head_dim, head_dim, c, s)
        ops.rotary_(k, k.shape[1] // head_dim, head_dim, c, s)
        return q, k
    q = apply_rotary(q.view(t, -1, head_dim), cos, sin).reshape(t, -1)
    k = apply_rotary(k.view(t, -1, head_dim), cos, sin).reshape(t, -1)
    return q, k
