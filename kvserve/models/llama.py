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

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from kvserve.attention import Attention, AttentionMetadata
from kvserve.distributed.comm import Group
from kvserve.distributed.parallel import IntermediateTensors, Parallel
from kvserve.layers.linear import (ColumnParallelLinear, ParallelLMHead, QKVParallelLinear, RowParallelLinear,
                                   VocabParallelEmbedding)
from kvserve.layers.norm import RMSNorm
from kvserve.layers.activation import silu_and_mul
from kvserve.layers.rotary import (RotaryEmbedding, apply_rotary, compute_inv_freq, rope_parameters_of,
                                   rotate_qk)

logger = logging.getLogger(__name__)

KVCache = tuple[torch.Tensor, torch.Tensor]


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    """This rank's query and key/value heads (all of them with one tensor-parallel rank)."""

    def __init__(self, config: Any, qkv_bias: bool, qk_norm: bool, tp: Group) -> None:
        super().__init__()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = _head_dim(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, total_heads, total_kv_heads, qkv_bias, tp)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        o_bias = bool(getattr(config, "attention_bias", False))
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, config.hidden_size, o_bias, tp,
                                        shard=self.qkv_proj.shards[0])
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5)
        # Set by LlamaForCausalLM.probe_queries: receives the queries [T, heads, head_dim] the
        # attention is given (after q-norm and RoPE).
        self.query_probe: Callable[[torch.Tensor], None] | None = None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            q = self.q_norm(q.view(t, self.num_heads, self.head_dim)).view(t, self.q_size)
            k = self.k_norm(k.view(t, self.num_kv_heads, self.head_dim)).view(t, self.kv_size)
        q, k = rotate_qk(q, k, self.head_dim, cos, sin)
        if self.query_probe is not None:
            self.query_probe(q.view(t, self.num_heads, self.head_dim))
        return self.o_proj(self.attn(q, k, v, kv_cache, meta))


class LlamaMLP(nn.Module):
    def __init__(self, config: Any, tp: Group, intermediate_size: int | None = None) -> None:
        super().__init__()
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r}; only 'silu' is supported")
        bias = bool(getattr(config, "mlp_bias", False))
        n = intermediate_size or config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(config.hidden_size, [n, n], bias, tp, "intermediate_size")
        self.down_proj = RowParallelLinear(n, config.hidden_size, bias, tp, "intermediate_size")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, qkv_bias: bool, qk_norm: bool, parallel: Parallel, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, qkv_bias, qk_norm, parallel.tp)
        self.mlp = self.build_mlp(config, parallel, layer_idx)
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

    @staticmethod
    def build_mlp(config: Any, parallel: Parallel, layer_idx: int) -> nn.Module:
        """The feed-forward block of layer layer_idx (MoE models return theirs)."""
        return LlamaMLP(config, parallel.tp)


class LlamaModel(nn.Module):
    """The decoder stack of one pipeline stage: layers [start, end) are built, the others
    are None (their names stay model.layers.N so checkpoints map one to one)."""

    def __init__(self, config: Any, qkv_bias: bool, qk_norm: bool, parallel: Parallel,
                 layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer) -> None:
        super().__init__()
        self.pp = parallel.pp
        self.start, self.end = parallel.layer_range(config.num_hidden_layers)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel.tp) \
            if self.pp.is_first else None
        self.layers = nn.ModuleList(
            layer_cls(config, qkv_bias, qk_norm, parallel, i) if self.start <= i < self.end else None
            for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if self.pp.is_last else None
        self.rotary_emb = RotaryEmbedding(_head_dim(config), config.max_position_embeddings,
                                          rope_parameters_of(config))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, intermediate: IntermediateTensors | None = None,
                layers: tuple[int, int] | None = None) -> torch.Tensor | IntermediateTensors:
        """layers: run only layers [a, b) of this stage, from `intermediate` unless a is the model's
        first; the hidden states after b come back as IntermediateTensors unless b ends the model."""
        if len(kv_caches) != self.end - self.start:
            raise ValueError(f"expected {self.end - self.start} kv caches (one per layer), got {len(kv_caches)}")
        first, last = layers or (self.start, self.end)
        if not self.start <= first < last <= self.end:
            raise ValueError(f"layers [{first}, {last}) are not within this stage's [{self.start}, {self.end})")
        if first == 0:
            h, residual = self.embed_tokens(input_ids), None
        else:
            h, residual = intermediate.hidden, intermediate.residual
        cos, sin = self.rotary_emb(positions)
        for i in range(first, last):
            h, residual = self.layers[i](h, residual, cos, sin, kv_caches[i - self.start], meta)
        if last < self.end or not self.pp.is_last:
            return IntermediateTensors(h, residual)
        h, _ = self.norm(h, residual)
        return h


class LlamaForCausalLM(nn.Module):
    # None: take `attention_bias` from the config (Llama, Mistral, Qwen3); Qwen2 always has q/k/v bias.
    qkv_bias: bool | None = None
    qk_norm: bool = False
    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer

    def __init__(self, config: Any, parallel: Parallel | None = None) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel = parallel or Parallel()
        qkv_bias = bool(getattr(config, "attention_bias", False)) if self.qkv_bias is None else self.qkv_bias
        sliding = getattr(config, "sliding_window", None)
        if sliding and getattr(config, "use_sliding_window", True) and sliding < config.max_position_embeddings:
            logger.info("sliding_window=%d is ignored: all layers attend to the full context", sliding)
        self.model = LlamaModel(config, qkv_bias, self.qk_norm, parallel, self.layer_cls)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, parallel.tp) \
            if parallel.pp.is_last else None
        self.tie_weights()

    def tie_weights(self) -> None:
        """With tied embeddings the LM head reads the embedding (when one stage holds both)."""
        if self.tie_word_embeddings and self.lm_head is not None and self.model.embed_tokens is not None:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_metadata: AttentionMetadata, intermediate: IntermediateTensors | None = None,
                layers: tuple[int, int] | None = None) -> torch.Tensor | IntermediateTensors:
        """input_ids, positions: [T] int64 (flat batch). Returns final-norm hidden states [T, hidden]
        (on a pipeline stage before the last: what the next stage takes as `intermediate`).
        layers: only these [a, b) (LlamaModel.forward)."""
        return self.model(input_ids, positions, kv_caches, attn_metadata, intermediate, layers)

    @property
    def attention_scale(self) -> float:
        """What attention multiplies q.k by (1 / sqrt(head_dim))."""
        return next(layer for layer in self.model.layers if layer is not None).self_attn.attn.scale

    @contextlib.contextmanager
    def probe_queries(self, layers: Iterable[int]) -> Iterator[dict[int, torch.Tensor]]:
        """Within the block, every forward records, for each of `layers` (model indices on this
        stage), the queries its attention is given: float32 [T, heads, head_dim], after q-norm and
        RoPE, by layer (a later forward overwrites an earlier one's)."""
        queries: dict[int, torch.Tensor] = {}
        attns = [self.model.layers[i].self_attn for i in layers]
        for i, a in zip(layers, attns):
            a.query_probe = lambda q, i=i: queries.__setitem__(i, q.float().clone())
        try:
            yield queries
        finally:
            for a in attns:
                a.query_probe = None

    def rerotate_keys(self, k: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """K [n, kv_heads, head_dim] cached at positions p, as they would be at p + offsets [n]:
        RoPE at o + j is RoPE at j followed by a rotation by o, so this is exact up to rounding.
        Float32 [n, kv_heads, head_dim]. (No scaling factor: the cached K carries it.)"""
        rot = self.model.rotary_emb
        inv_freq, _ = compute_inv_freq(rot.head_dim, rot.params, rot.max_position)
        # A span's tokens share a few offsets (one per reused chunk): rotate by each once.
        uniq, index = torch.unique(offsets, return_inverse=True)
        angles = uniq.double()[:, None] * inv_freq.double()[None, :]
        cos, sin = (x.float()[index][:, None].to(k.device) for x in (angles.cos(), angles.sin()))
        return apply_rotary(k.float(), cos, sin)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] in float32 (the last pipeline stage only)."""
        return self.lm_head.compute_logits(hidden).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named tensors into this rank's shards; raises ValueError on a shape mismatch or
        when a weight is missing. Tensors of other pipeline stages are skipped.

        Returns the set of HF names that were loaded.
        """
        params = dict(self.named_parameters(remove_duplicate=False))
        expected = self.hf_weight_names()
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            target, shard_id = self._map_name(name)
            if target is None:
                continue
            if target not in params:
                logger.warning("ignoring unexpected weight %s", name)
                continue
            self._load_one(name, params[target], target, tensor, shard_id)
            loaded.add(name)
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"missing weight tensor {missing[0]!r}"
                             + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        return loaded

    def _load_one(self, name: str, param: nn.Parameter, target: str, tensor: torch.Tensor,
                  shard_id: int | None) -> None:
        module = self.get_submodule(target.rpartition(".")[0])
        loader = getattr(module, "weight_loader", None)
        with torch.no_grad():
            if loader is None:
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
                param.data.copy_(tensor)
                return
            try:
                loader(param, tensor, shard_id)
            except ValueError as e:
                raise ValueError(f"weight {name!r}: {e}") from None

    def owns(self, name: str) -> bool:
        """Whether HF tensor `name` belongs on this pipeline stage."""
        if name.startswith("model.layers."):
            i = int(name.split(".")[2])
            return self.model.start <= i < self.model.end
        if name.startswith("model.embed_tokens."):
            return self.model.embed_tokens is not None or (self.tie_word_embeddings and self.lm_head is not None)
        return self.lm_head is not None  # the final norm and lm_head

    def _map_name(self, name: str) -> tuple[str | None, int | None]:
        """HF name -> (our parameter name, the part of a fused weight it fills: 0/1/2 of q/k/v,
        0/1 of gate/up). None when the tensor is not this stage's."""
        if not self.owns(name):
            return None, None
        if name == "model.embed_tokens.weight" and self.model.embed_tokens is None:
            return "lm_head.weight", None  # tied: the last stage's LM head reads the embedding
        if self.tie_word_embeddings and name == "lm_head.weight":
            return None, None
        for i, proj in enumerate(("q_proj", "k_proj", "v_proj")):
            if f".self_attn.{proj}." in name:
                return name.replace(proj, "qkv_proj"), i
        for i, proj in enumerate(("gate_proj", "up_proj")):
            if f".mlp.{proj}." in name:
                return name.replace(proj, "gate_up_proj"), i
        return name, None

    def hf_weight_names(self) -> set[str]:
        """The HF parameter names a complete checkpoint provides for this rank."""
        names: set[str] = set()
        for name, _ in self.named_parameters(remove_duplicate=False):
            if ".kernel." in name:  # a quantized kernel's copy of its linear's bias
                continue
            if self.tie_word_embeddings and name == "lm_head.weight":
                if self.model.embed_tokens is None:
                    names.add("model.embed_tokens.weight")
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
