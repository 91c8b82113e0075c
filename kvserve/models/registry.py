"""Architecture name (HF `config.architectures[0]`) -> model class."""

from __future__ import annotations

from typing import Any

from torch import nn

from kvserve.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from kvserve.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def register_model(architecture: str, cls: type[nn.Module]) -> None:
    _MODELS[architecture] = cls


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in _MODELS:
        raise ValueError(f"unsupported model architecture {architecture!r}; "
                         f"supported: {', '.join(supported_architectures())}")
    return _MODELS[architecture]


def architecture_of(hf_config: Any) -> str:
    archs = getattr(hf_config, "architectures", None) or []
    if not archs:
        raise ValueError("model config has no 'architectures' entry; "
                         f"supported: {', '.join(supported_architectures())}")
    return archs[0]


def model_class_for(hf_config: Any) -> type[nn.Module]:
    return get_model_class(architecture_of(hf_config))
