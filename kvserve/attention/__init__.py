from kvserve.attention.backend import AttentionBackend, AttentionMetadata, get_backend, register_backend
from kvserve.attention import torch_backend  # noqa: F401  (registers "torch")
from kvserve.attention.layer import Attention, set_attention_backend

__all__ = ["Attention", "AttentionBackend", "AttentionMetadata", "get_backend", "register_backend",
           "set_attention_backend"]
