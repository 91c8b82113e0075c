"""Llama-family decoder models: Llama, Mistral, Qwen2 (q/k/v bias), Qwen3 (per-head q/k norm).

Plain torch modules over a flat batch: tokens of all requests are concatenated
([T]) and attention reads/writes the paged KV cache through `Attention` and the
explicit `AttentionMetadata`. q/k/v and gate/up are fused into single matmuls;
`load_weights` takes HF parameter names and fills the fused weights.

Not modelled: sliding-window attention (Mistral `sliding_window`, Qwen2
`use_sliding_window`). Every layer attends to the full context, which equals the
reference as long as sequences stay within the window; longer sequences differ.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.attention import Attention, AttentionMetadata
from kvserve.layers.norm import RMSNorm
from kvserve.layers.rotary import RotaryEmbedding, apply_rotary, rope_parameters_of

logger = logging.getLogger(__name__)

KVCache = tuple[torch.Tensor, torch.Tensor]


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = _head_dim(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        o_bias = bool(getattr(config, "attention_bias", False))
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q, cos, sin).reshape(t, self.q_size)
        k = apply_rotary(k, cos, sin).reshape(t, self.kv_size)
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class LlamaMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}; only 'silu' is supported")
        bias = bool(getattr(config, "mlp_bias", False))
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, qkv_bias, qk_norm)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, cos, sin, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, qkv_bias, qk_norm) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(_head_dim(config), config.max_position_embeddings,
                                          rope_parameters_of(config))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} kv caches (one per layer), got {len(kv_caches)}")
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary_emb(positions)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            h, residual = layer(h, residual, cos, sin, kv_cache, meta)
        h, _ = self.norm(h, residual)
        return h


class LlamaForCausalLM(nn.Module):
    # None: take `attention_bias` from the config (Llama, Mistral, Qwen3); Qwen2 always has q/k/v bias.
    qkv_bias: bool | None = None
    qk_norm: bool = False

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        qkv_bias = bool(getattr(config, "attention_bias", False)) if self.qkv_bias is None else self.qkv_bias
        sliding = getattr(config, "sliding_window", None)
        if sliding and getattr(config, "use_sliding_window", True) and sliding < config.max_position_embeddings:
            logger.info("sliding_window=%d is ignored: all layers attend to the full context", sliding)
        self.model = LlamaModel(config, qkv_bias, self.qk_norm)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T] int64 (flat batch). Returns final-norm hidden states [T, hidden]."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in float32."""
        return self.lm_head(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors; raises ValueError on a shape mismatch or when a weight is missing.

        Returns the set of HF names that were loaded.
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        expected = self.hf_weight_names()
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (self.tie_word_embeddings and name == "lm_head.weight"):
                continue
            target, sl = self._map_name(name)
            if target not in params:
                logger.warning("ignoring unexpected weight %s", name)
                continue
            dst = params[target].data if sl is None else params[target].data[sl]
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            with torch.no_grad():
                dst.copy_(tensor)
            loaded.add(name)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"missing weight tensor {missing[0]!r}"
                             + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        return loaded

    def _map_name(self, name: str) -> tuple[str, slice | None]:
        """HF name -> (our parameter name, rows of it) for fused q/k/v and gate/up."""
        attn = self.model.layers[0].self_attn if len(self.model.layers) else None
        for i, proj in enumerate(("q_proj", "k_proj", "v_proj")):
            if f".self_attn.{proj}." in name:
                q, kv = attn.q_size, attn.kv_size
                start = (0, q, q + kv)[i]
                return name.replace(proj, "qkv_proj"), slice(start, start + (q if i == 0 else kv))
        for i, proj in enumerate(("gate_proj", "up_proj")):
            if f".mlp.{proj}." in name:
                n = self.config.intermediate_size
                return name.replace(proj, "gate_up_proj"), slice(i * n, (i + 1) * n)
        return name, None

    def hf_weight_names(self) -> set[str]:
        """The HF parameter names a complete checkpoint provides for this model."""
        names: set[str] = set()
        for name, _ in self.named_parameters(remove_duplicate=False):
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue
            if ".qkv_proj." in name:
                names.update(name.replace("qkv_proj", p) for p in ("q_proj", "k_proj", "v_proj"))
            elif ".gate_up_proj." in name:
                names.update(name.replace("gate_up_proj", p) for p in ("gate_proj", "up_proj"))
            else:
                names.add(name)
        return names


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
