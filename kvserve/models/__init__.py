from kvserve.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM
from kvserve.models.loader import LoadedModel, default_model_path, load_model, resolve_dtype
from kvserve.models.registry import get_model_class, model_class_for, register_model, supported_architectures

__all__ = ["LlamaForCausalLM", "LoadedModel", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
           "default_model_path", "get_model_class", "load_model", "model_class_for", "register_model",
           "resolve_dtype", "supported_architectures"]
