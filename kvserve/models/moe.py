"""Mixture-of-experts Llama-family models: Mixtral, Qwen2-MoE (shared expert), Qwen3-MoE.

The attention, norms, embeddings and dense MLPs are llama.py's; only the feed-forward
block of the sparse layers differs: a replicated router (`gate`, a plain nn.Linear) and
the routed experts (`FusedMoE`, tensor- or expert-parallel, see layers/moe.py), plus in
Qwen2-MoE a dense shared expert scaled by sigmoid(shared_expert_gate(x)).

Checkpoint names: each expert's gate / up / down linear (Mixtral w1 / w3 / w2, Qwen
gate_proj / up_proj / down_proj) fills its slice of the stacked w13 / w2. Experts are
not quantized (quant/ only swaps attention and dense MLP linears): they load in --dtype.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from kvserve.distributed.parallel import Parallel
from kvserve.layers.moe import FusedMoE
from kvserve.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP

_EXPERT_RE = re.compile(r"(model\.layers\.\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight")
_MIXTRAL_EXPERT = {"w1": "w1", "w2": "w2", "w3": "w3"}
_QWEN_EXPERT = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ an optional gated shared expert): forward(x [T, H]) -> [T, H]."""

    def __init__(self, config: Any, parallel: Parallel, num_experts: int, intermediate_size: int,
                 renormalize: bool, weights_fp32: bool, intermediate_name: str,
                 shared_intermediate_size: int | None = None) -> None:
        super().__init__()
        hidden = config.hidden_size
        # Replicated on every rank: expert parallel routes each rank's token slice locally.
        self.gate = nn.Linear(hidden, num_experts, bias=False)
        self.experts = FusedMoE(num_experts, config.num_experts_per_tok, hidden, intermediate_size, parallel,
                                renormalize=renormalize, weights_fp32=weights_fp32,
                                intermediate_name=intermediate_name)
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate_size:
            self.shared_expert = LlamaMLP(config, parallel.tp, shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def _qwen_is_sparse(config: Any, layer_idx: int) -> bool:
    """transformers' rule for Qwen2-MoE / Qwen3-MoE: which layers route to experts."""
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer_idx + 1) % config.decoder_sparse_step == 0)


class MixtralDecoderLayer(LlamaDecoderLayer):
    @staticmethod
    def build_mlp(config: Any, parallel: Parallel, layer_idx: int) -> nn.Module:
        # Mixtral keeps the routing weights in float32 and always renormalises the top k.
        return SparseMoeBlock(config, parallel, config.num_local_experts, config.intermediate_size,
                              renormalize=True, weights_fp32=True, intermediate_name="intermediate_size")


class QwenMoeDecoderLayer(LlamaDecoderLayer):
    """Qwen2-MoE and Qwen3-MoE: dense or sparse by transformers' rule; Qwen2-MoE adds a shared expert."""

    @staticmethod
    def build_mlp(config: Any, parallel: Parallel, layer_idx: int) -> nn.Module:
        if not _qwen_is_sparse(config, layer_idx):
            return LlamaMLP(config, parallel.tp, config.intermediate_size)
        return SparseMoeBlock(config, parallel, config.num_experts, config.moe_intermediate_size,
                              renormalize=bool(config.norm_topk_prob), weights_fp32=False,
                              intermediate_name="moe_intermediate_size",
                              shared_intermediate_size=getattr(config, "shared_expert_intermediate_size", None))


class _MoeForCausalLM(LlamaForCausalLM):
    """Maps the experts' HF names onto FusedMoE's stacked parameters."""

    moe_prefix = "mlp"  # the HF module name of a sparse block (Mixtral: block_sparse_moe)
    expert_names: dict[str, str] = _QWEN_EXPERT  # HF expert linear -> FusedMoE shard (w1 / w2 / w3)

    def _map_name(self, name: str) -> tuple[str | None, Any]:
        m = _EXPERT_RE.fullmatch(name)
        if m is not None:
            layer, expert, linear = m.group(1), int(m.group(2)), m.group(3)
            if linear not in self.expert_names:
                return name, None  # not a weight we have: load_weights warns about it
            if not self.owns(name):
                return None, None
            shard = self.expert_names[linear]
            return f"{layer}.mlp.experts.{'w2' if shard == 'w2' else 'w13'}", (expert, shard)
        if self.moe_prefix != "mlp":
            name = name.replace(f".{self.moe_prefix}.", ".mlp.")
        for i, proj in enumerate(("gate_proj", "up_proj")):
            if f".mlp.shared_expert.{proj}." in name:
                return (name.replace(proj, "gate_up_proj"), i) if self.owns(name) else (None, None)
        return super()._map_name(name)

    def hf_weight_names(self) -> set[str]:
        names: set[str] = set()
        inverse = {shard: hf for hf, shard in self.expert_names.items()}
        for name in super().hf_weight_names():
            layer, _, param = name.partition(".mlp.experts.")
            if param in ("w13", "w2"):
                num_experts = self.get_submodule(f"{layer}.mlp.experts").num_experts
                shards = ("w1", "w3") if param == "w13" else ("w2",)
                names.update(f"{layer}.{self.moe_prefix}.experts.{e}.{inverse[s]}.weight"
                             for e in range(num_experts) for s in shards)
            else:
                names.add(name.replace(".mlp.", f".{self.moe_prefix}.") if self.moe_prefix != "mlp" else name)
        return names


class MixtralForCausalLM(_MoeForCausalLM):
    layer_cls = MixtralDecoderLayer
    moe_prefix = "block_sparse_moe"
    expert_names = _MIXTRAL_EXPERT


class Qwen2MoeForCausalLM(_MoeForCausalLM):
    layer_cls = QwenMoeDecoderLayer

    @property
    def qkv_bias(self) -> bool:  # Qwen2-MoE's config calls it qkv_bias (default on), not attention_bias
        return bool(getattr(self.config, "qkv_bias", True))


class Qwen3MoeForCausalLM(_MoeForCausalLM):
    layer_cls = QwenMoeDecoderLayer
    qk_norm = True
